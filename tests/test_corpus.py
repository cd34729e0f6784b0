"""``partc train --data`` in one process: token files and text read and packed into
sequences (inputs and next-token targets), each step's samples sharded by data-parallel
replica with the runtime's sampler, resumed runs reading what an uninterrupted one reads,
and the refusals that name the file. (The run under torchrun is a case of
tests/runtime/launcher_worker.py.)"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from partc.cli import launcher
from partc.cli.config import TrainConfig, parse_config, read_config_file
from partc.cli.main import UsageError
from partc.corpus import (ByteTokenizer, StepBatches, TokenCorpus, load_tokenizer,
                          model_batch, model_vocab_size, open_corpus, read_token_file,
                          sequence_length, write_token_file)
from partc.corpus.text_tokens import encode_dataset
from partc.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "samples" / "declaration.txt"


def test_a_sample_is_a_window_and_its_next_tokens():
    corpus = TokenCorpus(ids=np.arange(50, dtype=np.uint16), seq_len=8, source="ids")
    assert corpus.num_samples == 6          # (50 - 1) // 8; ids 49.. never read
    inputs, targets = corpus.samples(torch.tensor([0, 5, 2]))
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.tolist() == [list(range(0, 8)), list(range(40, 48)), list(range(16, 24))]
    assert targets.tolist() == [list(range(1, 9)), list(range(41, 49)), list(range(17, 25))]
    with pytest.raises(DataError, match="holds 8 tokens, fewer than one sample needs"):
        TokenCorpus(ids=np.arange(8), seq_len=8, source="short.bin")


def test_replicas_read_their_rows_of_the_global_batch_and_resume_reads_the_next():
    corpus = TokenCorpus(ids=np.arange(1000) % 251, seq_len=8, source="ids")
    whole = StepBatches(corpus, global_batch_size=8, seed=3)
    run = [whole(step) for step in range(40)]   # over 3 epochs of 124 samples
    for dp in (1, 2, 4):
        replicas = [whole.for_replica(dp, rank) for rank in range(dp)]
        for step in (0, 17, 39):
            parts = [replica(step) for replica in replicas]
            for got, want in zip((torch.cat([p[0] for p in parts]),
                                  torch.cat([p[1] for p in parts])), run[step]):
                assert torch.equal(got, want), (dp, step)
    # A run resumed at step 25 builds its batches afresh (another process, another dp):
    # the step alone says what it reads next.
    resumed = StepBatches(corpus, global_batch_size=8, seed=3).for_replica(2, 1)
    assert torch.equal(resumed(25)[0], run[25][0][4:])
    assert not torch.equal(run[25][0], run[26][0])
    with pytest.raises(DataError, match="no held-out batch of its own; give one with "
                                        "--eval-data"):
        whole(-1)
    other_seed = StepBatches(corpus, global_batch_size=8, seed=4)
    assert not torch.equal(other_seed(0)[0], run[0][0])
    assert whole.state_dict() == {"num_samples": 124, "global_batch_size": 8, "seed": 3,
                                  "seq_len": 8, "tokens": 1000, "source": "ids"}


def test_token_files_are_memory_mapped_in_their_dtype(tmp_path):
    small = write_token_file([1, 2, 65535, 7], tmp_path / "small.bin")
    assert small.stat().st_size == 8                    # uint16: nanoGPT's train.bin
    ids = read_token_file(small)
    assert isinstance(ids, np.memmap) and ids.tolist() == [1, 2, 65535, 7]
    wide = write_token_file([0, 128255, 3], tmp_path / "wide.bin")   # Llama-3's ids
    assert wide.stat().st_size == 12
    assert read_token_file(wide, "uint32").tolist() == [0, 128255, 3]
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(DataError, match="not a whole number of uint32 ids"):
        read_token_file(tmp_path / "odd.bin", "uint32")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        read_token_file(tmp_path / "empty.bin")
    with pytest.raises(DataError, match="does not exist"):
        read_token_file(tmp_path / "missing.bin")
    np.save(tmp_path / "ids.npy", np.arange(20, dtype=np.int32))
    assert open_corpus(tmp_path / "ids.npy", seq_len=4).samples(
        torch.tensor([1]))[0].tolist() == [[4, 5, 6, 7]]
    np.save(tmp_path / "floats.npy", np.ones(20))
    with pytest.raises(DataError, match="integer token ids"):
        read_token_file(tmp_path / "floats.npy")


def test_text_is_tokenized_bytewise_and_ids_are_checked_against_the_model(tmp_path):
    corpus = open_corpus(TEXT, seq_len=64)
    assert len(corpus.ids) == TEXT.stat().st_size       # one id per UTF-8 byte
    assert ByteTokenizer().decode(corpus.samples(torch.tensor([0]))[0][0].tolist()) \
        == TEXT.read_text()[:64]
    with pytest.raises(DataError, match="has 256 ids, the model embeds 128"):
        open_corpus(TEXT, seq_len=64, vocab_size=128)
    bin_file = write_token_file(np.arange(300) % 200, tmp_path / "t.bin")
    batches = StepBatches(open_corpus(bin_file, seq_len=8), global_batch_size=32,
                          vocab_size=128)
    with pytest.raises(DataError, match=r"t.bin: token id 1\d\d at step 2 is outside the "
                                        r"model's vocabulary of 128") as caught:
        batches(2)
    assert (caught.value.step, caught.value.path) == (2, str(bin_file))
    with pytest.raises(DataError, match="--tokenizer is for text"):
        open_corpus(bin_file, seq_len=8, tokenizer=tmp_path)
    with pytest.raises(DataError, match="--data-dtype is for token files"):
        open_corpus(TEXT, seq_len=8, dtype="uint32")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text"):
        open_corpus(tmp_path / "latin1.txt", seq_len=2)


def test_a_hugging_face_tokenizer_from_a_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = sorted(set(TEXT.read_text().split()))
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                         eos_token="</s>").save_pretrained(tmp_path / "tok")
    reader = load_tokenizer(tmp_path / "tok")
    assert (reader.vocab_size, reader.eos_token_id) == (len(vocab), 1)
    corpus = open_corpus(TEXT, seq_len=16, tokenizer=tmp_path / "tok")
    assert corpus.ids.tolist() == [vocab[w] for w in TEXT.read_text().split()]
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


def test_a_datasets_data_set_joins_its_documents_with_the_end_id(tmp_path, monkeypatch):
    """``datasets`` stood in by a module with ``load_from_disk`` (it is optional)."""
    class Rows:
        column_names = ["text"]

        def __getitem__(self, column):
            return ["ab", "c"]

    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda path: {"train": Rows()}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    tokenizer = types.SimpleNamespace(vocab_size=300, eos_token_id=256,
                                      encode=ByteTokenizer().encode)
    assert encode_dataset(tmp_path, tokenizer).tolist() == [97, 98, 256, 99, 256]
    assert open_corpus(tmp_path, seq_len=2).ids.tolist() == [97, 98, 99]   # bytes: no end id
    monkeypatch.setitem(sys.modules, "datasets", None)   # not installed
    with pytest.raises(DataError, match="pip install datasets"):
        open_corpus(tmp_path, seq_len=2)


def test_the_sequence_length_is_the_example_inputs_and_the_vocabulary_the_embedding():
    ids = torch.zeros(2, 24, dtype=torch.int64)
    for inputs in (ids, (ids,), {"input_ids": ids}):
        assert sequence_length(inputs, "f.py:f") == 24
    with pytest.raises(DataError, match=r"f.py:f's example inputs do not start with"):
        sequence_length((torch.zeros(2, 24),), "f.py:f")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Embedding(77, 4))
    assert model_vocab_size(model) == 77
    assert model_vocab_size(torch.nn.Linear(2, 2)) is None


def test_a_batch_reaches_the_model_in_the_form_of_its_example_inputs():
    """By position: the ids and the targets. A tokenizer's batch: its own keys, labels the
    ids (the model shifts them) and no target unless a loss_fn reads one. Inputs token rows
    cannot fill are refused, naming them."""
    ids, targets = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    for example in (ids, (ids,)):
        assert model_batch(example, "f.py:f", loss_fn=True)(ids, targets) == (ids, targets)
    batch, target = model_batch({"input_ids": ids, "attention_mask": ids, "labels": ids},
                                "llama", loss_fn=False)(ids, targets)
    assert list(batch) == ["input_ids", "attention_mask", "labels"] and target is None
    assert batch["input_ids"] is ids and batch["labels"] is ids
    assert torch.equal(batch["attention_mask"], torch.ones_like(ids))
    batch, target = model_batch({"input_ids": ids}, "f.py:f", loss_fn=True)(ids, targets)
    assert list(batch) == ["input_ids"] and target is targets
    with pytest.raises(DataError, match="f.py:f's example inputs also take pixel_values"):
        model_batch({"input_ids": ids, "pixel_values": ids}, "f.py:f", loss_fn=False)
    with pytest.raises(DataError, match="f.py:f's example inputs are 2 by position"):
        model_batch((ids, ids), "f.py:f", loss_fn=True)


def test_the_flags_need_data_and_name_the_dtypes(tmp_path):
    config = parse_config(["m.py:f", "--steps", "2", "--data", "t.bin", "--data-dtype",
                           "uint32", "--eval-data", "v.bin"])
    assert (config.data, config.data_dtype, config.eval_data) == ("t.bin", "uint32", "v.bin")
    (tmp_path / "train.toml").write_text('data = "t.bin"\ndata-dtype = "uint32"\n')
    assert read_config_file(tmp_path / "train.toml") == {"data": "t.bin",
                                                         "data_dtype": "uint32"}
    (tmp_path / "bad.toml").write_text('data-dtype = "int8"\n')
    with pytest.raises(ValueError, match="invalid choice: 'int8'"):
        read_config_file(tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="--tokenizer, --eval-data need --data"):
        TrainConfig(target="m.py:f", steps=1, tokenizer="tok", eval_data="v.bin")
    # A missing file is refused with the flags, before torch or the model.
    with pytest.raises(UsageError, match="--eval-data v.bin does not exist"):
        launcher.check(replace(config, target=f"{ROOT / 'samples' / 'gpt.py'}:factory",
                               data=str(TEXT)), 1)


class _Module:
    """What train() uses of a DistributedModule: records the batches it is given."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def forward_backward(self, inputs, target):
        self.seen.append(inputs)
        return torch.tensor(1.0)

    @contextlib.contextmanager
    def watch_data(self, step: int):
        yield


class _Optimizer:
    param_groups = [{"lr": None}]

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _fed(config: TrainConfig, dp: int, dp_rank: int) -> dict:
    model = torch.nn.Embedding(256, 4)
    workload = {"model": model, "example_inputs": (torch.zeros(1, 16, dtype=torch.long),)}
    files = launcher.open_data(config, workload)
    launcher.feed(workload, files, config, global_batch_size=8, dp=dp, dp_rank=dp_rank)
    return workload


def test_the_launcher_trains_a_replica_on_its_rows_and_resumes_where_it_stopped(tmp_path):
    """4 steps on one replica against 2 steps, then a resume at step 2 on replica 1 of
    2: the resumed run reads the rows the uninterrupted one read at steps 2 and 3; the
    checkpoint's data digest accepts it, and refuses another file."""
    config = TrainConfig(target="m.py:f", steps=4, data=str(TEXT), seed=5)
    whole = _Module()
    launcher.train(whole, _Optimizer(), _fed(config, 1, 0), config)
    first = _Module()
    workload = _fed(config, 1, 0)
    launcher.train(first, _Optimizer(), workload, config,
                   after_step=lambda done: done == 2)
    extra = launcher._record(config, workload, 2)
    resumed = _Module()
    on_two = _fed(config, 2, 1)
    launcher.check_resume(extra, config, on_two, 2, "ckpt/step-2")
    launcher.train(resumed, _Optimizer(), on_two, config, start_step=2)
    assert [len(x) for x in resumed.seen] == [4, 4]           # its replica's rows only
    assert torch.equal(torch.cat(first.seen), torch.cat(whole.seen[:2]))
    for got, want in zip(resumed.seen, whole.seen[2:]):
        assert torch.equal(got, want[4:])
    other = tmp_path / "other.txt"
    other.write_text(TEXT.read_text()[::-1])
    with pytest.raises(ValueError, match="its data order differs"):
        launcher.check_resume(extra, config, _fed(TrainConfig(
            target="m.py:f", steps=4, data=str(other), seed=5), 1, 0), 2, "ckpt/step-2")
    with pytest.raises(DataError, match="--eval-every with --data"):
        _fed(TrainConfig(target="m.py:f", steps=4, data=str(TEXT), eval_every=2), 1, 0)
    held = _fed(TrainConfig(target="m.py:f", steps=4, data=str(TEXT), eval_every=2,
                            eval_data=str(TEXT)), 1, 0)
    assert torch.equal(held["eval_data"]()[0], held["data"](0)[0])

