"""``partc plan`` and ``partc train`` take a model by its Hugging Face config
(partc/cli/hf_config.py): a local directory or a model type transformers ships, with
overrides; planned on the meta device, trained on its own loss from keyword inputs."""

from __future__ import annotations

import json

import pytest
import torch

from partc.cli import hf_config, launcher
from partc.cli.config import TrainConfig
from partc.cli.main import main
from tests.tolerances import FP32

TINY = ["hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
        "num_key_value_heads=2", "vocab_size=128", "num_hidden_layers=1"]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A model directory as a user has one: config.json only (no weights, no network)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, num_hidden_layers=2,
                max_position_embeddings=16).save_pretrained(path)
    return path


def test_plan_takes_a_model_directory(config_dir, capsys):
    code = main(["plan", str(config_dir), "--hf-config", "num_hidden_layers=1",
                 "--global-batch", "4", "--devices", "1", "--device", "CPU", "-q",
                 "--format", "json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    model = plan["model"]
    assert model["name"] == "LlamaForCausalLM (tiny-llama0)"
    # The example batch is a tokenizer's, by keyword; the target the next tokens.
    assert [(s["name"], s["shape"], s.get("keyword", False)) for s in model["inputs"]] == [
        ("input_ids", [16], True), ("target", [16], False)]   # max_position_embeddings
    assert "own_loss" not in model
    # num_hidden_layers=1 overrode the file's 2: one decoder layer was planned.
    layers = [layer for stage in plan["stages"] for layer in stage["layers"]]
    assert "model.layers.0" in layers and "model.layers.1" not in layers


def test_several_fields_after_one_flag(config_dir, capsys):
    """``--hf-config a=1 b=2`` sets both, as repeating the flag does."""
    code = main(["plan", str(config_dir), "--hf-config", "num_hidden_layers=1",
                 "vocab_size=96", "--hf-config", "max_position_embeddings=8",
                 "--global-batch", "4", "--devices", "1", "--device", "CPU", "-q",
                 "--format", "json"])
    assert code == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert [s["shape"] for s in model["inputs"]][0] == [8]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(config_dir)
    config.update({"num_hidden_layers": 1, "vocab_size": 96})
    with torch.device("meta"):
        expected = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert model["num_params"] == expected


def test_train_makes_a_model_type_with_random_tokens_and_compiles_it():
    workload = hf_config.workload("llama", TINY, batch=4, seq_len=16)
    model = workload["model"]
    assert not any(p.is_meta for p in model.parameters()) and not model.config.use_cache
    first, again = workload["data"](3), workload["data"](3)
    assert torch.equal(first[0]["input_ids"], again[0]["input_ids"])
    assert first[0]["input_ids"].shape == (4, 16) and set(first[0]) == {"input_ids"}
    # The target is each position's next token, the last's drawn with the row.
    assert torch.equal(first[1][:, :-1], first[0]["input_ids"][:, 1:])
    assert first[1].shape == (4, 16) and (first[1] >= 0).all()
    # A resumed run checks it reads the checkpoint's batches: a dict batch is digested.
    assert launcher.data_digest(workload, 3) == launcher.data_digest(workload, 3) \
        != launcher.data_digest(workload, 4)
    config = TrainConfig(target="llama", steps=1, plan={"global_batch": 4})
    program = launcher.compile_workload(config, workload, 1)
    assert program.plan.global_batch_size == 4 and program.plan.model.own_loss is None


@pytest.mark.parametrize("target, says", [
    ("lama", "'lama' is no model type transformers knows (did you mean llama"),
    ("{missing}", "holds no config.json"),
    ("no/such/dir", "no such file or directory: no/such/dir"),
])
def test_a_config_that_is_not_there_is_refused_in_one_line(tmp_path, capsys, target, says):
    code = main(["plan", target.format(missing=tmp_path), "--devices", "1", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_a_config_the_model_cannot_be_built_from_is_refused_in_one_line(capsys):
    """Seen before: a traceback where some model types' bare configs leave a field
    ``None`` that their code then multiplies (Ministral's ``head_dim``, dots.llm1's
    ``n_shared_experts``). A model that cannot be built from the config, or a value the
    config refuses: one line naming the error (and the flag), exit status 2."""
    code = main(["plan", "llama", "--hf-config", *TINY, "hidden_act=no-such-activation",
                 "--devices", "1", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "transformers could not build the model from this config (KeyError" in err
    assert "--hf-config KEY=VALUE" in err
    # A value the config's own checks refuse: one line too.
    code = main(["plan", "llama", "--hf-config", *TINY, "intermediate_size=null",
                 "--devices", "1", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "llama: transformers refused the config" in err


def test_the_fields_a_bare_config_leaves_unset_are_named():
    """A model type's bare config may leave fields None for a checkpoint to give
    (DeepSeek-V2's router reads num_experts_per_tok as topk's k; Hunyuan-MoE's
    head_dim): a model that fails to build, or to trace, names them, and the flag;
    token ids and every config's own fields are not named."""
    from transformers import CONFIG_MAPPING

    from partc.cli.main import _config_hint
    from partc.errors import TraceError

    deepseek = CONFIG_MAPPING["deepseek_v2"]()
    assert hf_config.unset_fields(deepseek) == ("n_group", "topk_group",
                                                "num_experts_per_tok")
    assert hf_config.unset_hint(deepseek) == (
        " (this config leaves n_group, topk_group and num_experts_per_tok unset)")
    assert hf_config.unset_hint(CONFIG_MAPPING["llama"]()) == ""

    class Built(torch.nn.Module):
        config = deepseek

    with pytest.raises(TraceError) as raised:
        with _config_hint("deepseek_v2", Built()):
            raise TraceError("both tracers failed: topk(): argument 'k' must be int")
    assert str(raised.value).startswith("both tracers failed")
    assert "leaves n_group, topk_group and num_experts_per_tok unset" in str(raised.value)
    assert "--hf-config KEY=VALUE" in str(raised.value)
    with pytest.raises(TraceError) as raised:   # a factory's model: the error as it was
        with _config_hint("model.py:factory", Built()):
            raise TraceError("both tracers failed")
    assert str(raised.value) == "both tracers failed"


def test_overrides_read_json_values():
    assert hf_config.overrides(["a=2", "b=true", "c=silu", "d=[1, 2]"]) == {
        "a": 2, "b": True, "c": "silu", "d": [1, 2]}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        hf_config.overrides(["num_hidden_layers"])
    assert hf_config.is_config_target("llama") and hf_config.is_config_target("models/x")
    assert not hf_config.is_config_target("samples/gpt.py:factory")


T5_TINY = ["d_model=32", "d_ff=64", "num_layers=1", "num_decoder_layers=1", "num_heads=2",
           "d_kv=16", "vocab_size=128", "dropout_rate=0"]   # dropout off: one draw


def test_an_encoder_decoder_is_its_sequence_to_sequence_lm(capsys):
    """Seen before: ``partc plan t5`` was refused ("T5Config has no causal LM"). An
    encoder-decoder type is planned as its conditional generation model on the same
    batch (its bare config starts the decoder at the padding token), and trains on its
    own loss as one device computes it."""
    code = main(["plan", "t5", "--hf-config", *T5_TINY, "--seq-len", "8", "--global-batch",
                 "4", "--devices", "1", "--device", "CPU", "-q", "--format", "json"])
    assert code == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["name"] == "T5ForConditionalGeneration (t5)"
    # The data's attention_mask is all ones (unpadded rows): left out, checked per batch.
    assert [s["name"] for s in model["inputs"]] == ["input_ids", "labels", "target"]
    assert model["left_out"] == ["attention_mask"]
    torch.manual_seed(0)
    workload = hf_config.workload("t5", T5_TINY, batch=4, seq_len=8)
    batch, _ = workload["data"](0)
    expected = workload["model"](**batch).loss
    config = TrainConfig(target="t5", steps=1, plan={"global_batch": 4})
    module = launcher.compile_workload(config, workload, 1).build()
    torch.testing.assert_close(module.forward_backward(**batch), expected.detach(),
                               rtol=FP32, atol=0)


GEMMA3_TEXT = ["text_config.num_hidden_layers=1", "text_config.hidden_size=32",
               "text_config.intermediate_size=64", "text_config.num_attention_heads=2",
               "text_config.num_key_value_heads=1", "text_config.head_dim=16",
               "text_config.vocab_size=96", "text_config.max_position_embeddings=12"]


def test_a_composite_config_takes_its_text_models_tokens(capsys):
    """Seen before: ``partc plan gemma3`` (and qwen3_5, llama4, mllama, encoder-decoder:
    13 of the model types transformers ships a causal LM for) ended in a traceback,
    "'Gemma3Config' object has no attribute 'vocab_size'": a composite config keeps its
    text model's figures in ``text_config``. The batch takes the text model's vocabulary
    and longest sequence, dotted keys set its fields, and the model plans."""
    workload = hf_config.workload("gemma3", GEMMA3_TEXT, batch=2, meta=True)
    text = workload["model"].config.text_config
    assert (text.num_hidden_layers, text.vocab_size, text.use_cache) == (1, 96, False)
    assert workload["example_inputs"]["input_ids"].shape == (2, 12)  # its longest sequence
    tokens = workload["data"](0)[0]["input_ids"]
    assert tokens.shape == (2, 12) and int(tokens.max()) < 96
    code = main(["plan", "gemma3", "--hf-config", *GEMMA3_TEXT, "--seq-len", "8",
                 "--global-batch", "2", "--devices", "1", "--device", "CPU", "-q",
                 "--format", "json"])
    assert code == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["name"] == "Gemma3ForConditionalGeneration (gemma3)"
    assert [s["shape"] for s in model["inputs"]][0] == [8]


def test_a_config_without_a_vocabulary_or_a_length_is_handled():
    """A config that names no vocabulary is refused in one line naming the flag; one
    whose longest sequence is -1 (XLNet's, relative positions) takes the default."""
    from types import SimpleNamespace

    from transformers import XLNetConfig

    with pytest.raises(ValueError, match="no vocabulary size .* --hf-config"):
        hf_config.token_figures("x", SimpleNamespace(max_position_embeddings=8))
    assert hf_config.token_figures("xlnet", XLNetConfig()) == (32000, hf_config.MAX_DEFAULT_SEQ)


def test_dotted_keys_set_fields_of_a_nested_config():
    assert hf_config.overrides(["a=1", "text_config.b=2", "text_config.c=x",
                                'text_config={"d": 3}']) == {
        "a": 1, "text_config": {"b": 2, "c": "x", "d": 3}}
    for pairs in (["a=1", "a.b=2"], ["a.b=2", "a=1"], ["text_config.=2"]):
        with pytest.raises(ValueError):
            hf_config.overrides(pairs)


def test_pairs_joined_by_commas_are_refused_with_the_flag_written_apart(capsys):
    with pytest.raises(ValueError, match=r"one KEY=VALUE per word, separated by spaces, got "
                       r"'a=4,b.c=x': --hf-config a=4 b.c=x$"):
        hf_config.overrides(["a=4,b.c=x"])
    assert hf_config.overrides(['a=[1, 2]', "b=x,y"]) == {"a": [1, 2], "b": "x,y"}
    # A field check that names the field on its first line and the reason on the next
    # (transformers' strict configs): both are in the one line.
    assert hf_config._first_line(TypeError("Validation error for field 'n':\n  expected "
                                           "int\n  more")) == (
        "TypeError: Validation error for field 'n': expected int")
    assert main(["plan", "llama", "--devices", "2", "--hf-config", "num_hidden_layers=x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_dtype_is_the_configs_else_bf16_on_a_gpu_and_float32_on_a_cpu(config_dir,
                                                                          tmp_path):
    """Without --dtype or a factory's TrainSpec: a model directory trains in the dtype its
    config names; a bare model type in mixed bf16 on a GPU preset, in float32 on the CPU."""
    from partc.cli.main import _parser, _train

    def dtype(target: str, device: str, *flags: str) -> torch.dtype:
        args = _parser().parse_args(["plan", target, "--devices", "2", *flags])
        return _train(args, hf_config.workload(target, TINY, meta=True), device).dtype

    assert dtype("llama", "cuda") == torch.bfloat16
    assert dtype("llama", "cpu") == torch.float32
    assert dtype("llama", "cuda", "--dtype", "fp32") == torch.float32
    config = json.loads((config_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    assert dtype(str(tmp_path), "cpu") == torch.float16


def test_a_hub_name_reads_its_config_from_the_local_cache(config_dir, tmp_path, monkeypatch,
                                                         capsys):
    """``partc plan owner/model``: the config.json the Hugging Face cache holds (a model
    downloaded before), with no network; a name it does not hold says how to fetch it."""
    from huggingface_hub import constants

    snapshot = tmp_path / "models--tiny--llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((config_dir / "config.json").read_text())
    (tmp_path / "models--tiny--llama" / "refs").mkdir()
    (tmp_path / "models--tiny--llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert hf_config.config_file("tiny/llama") == snapshot / "config.json"
    assert main(["plan", "tiny/llama", "--devices", "2", "--seq-len", "16"]) == 0
    assert "LlamaForCausalLM (llama)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"tiny/other: no such directory, and the Hugging "
                       r"Face cache holds no config.json of it .* 'hf download tiny/other "
                       r"config.json --local-dir DIR'"):
        hf_config.config_file("tiny/other")


def test_a_causal_lm_trains_on_its_next_tokens_which_a_split_sequence_holds(capsys):
    """Seen before: ``partc plan path/to/Llama-3.1-8B --devices 64 --seq-len 65536`` found
    no plan: the model's own loss shifts its labels inside the model, which a sequence
    split over ranks cannot, so context parallelism was refused (and at 64K tokens
    nothing else fits). A causal LM now trains on :func:`next_token_loss` against the
    next tokens, every position's (rows of one token more): the model's own loss given
    them shifted (to fp32's rounding), and a context-parallel plan."""
    workload = hf_config.workload("llama", TINY, batch=2, seq_len=16)
    batch, target = workload["data"](0)
    assert batch["input_ids"].shape == target.shape == (2, 16) and (target >= 0).all()
    output = workload["model"](**batch)
    own = workload["model"](**batch, labels=target, shift_labels=target).loss
    torch.testing.assert_close(hf_config.next_token_loss(output, target), own, rtol=FP32,
                               atol=0)
    assert main(["plan", "llama", "--hf-config", *TINY, "--seq-len", "16", "--global-batch",
                 "2", "--devices", "2", "--cp", "2", "--device", "CPU", "-q", "--format",
                 "json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["cp"] == 2
