"""Checkpoints (partc/runtime/checkpoint.py): save and load round trips, resume parity
across plans under torchrun, atomic commits, and bad checkpoints refused before any
tensor changes.

One process for the file-level behaviour (the same code path as every rank of a job);
two ``torchrun`` launches of ``ckpt_worker.py`` (2 processes each) for resume parity (the
same plan resumed bit-identically, and a dp=2 ZeRO-3 checkpoint resumed under tp=2 like
one process) and for one rank's failure (a failed write, a missing file) raising on
every rank. ``benchmarks/resume_parity.py`` runs the moves between process counts on
the sample GPT, Hugging Face Llama and GPT-2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import partc
from partc.cli.main import main as cli_main
from partc.runtime import checkpoint
from partc.runtime.watchdog import PhaseMarks
from partc.weights import open_weights
from samples.gpt import gpt_tiny, loss_fn

from .ckpt_worker import SAVE_AT, STEPS

WORKER = Path(__file__).with_name("ckpt_worker.py")
RTOL = 1e-5
B, T = 8, 16
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


def tokens(step: int, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, vocab, (B, T + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def compile_one(model: torch.nn.Module, vocab: int = 128) -> partc.Program:
    x, y = tokens(0, vocab)
    return partc.compile(model, (x,), loss_fn=loss_fn, example_target=y,
                         budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=B),
                         constraints=partc.Constraints(num_microbatches=2))


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    yield compile_one(gpt_tiny())
    if dist.is_initialized():
        dist.destroy_process_group()


def train(module, opt, steps: range, vocab: int = 128) -> list[float]:
    losses = []
    for step in steps:
        x, y = tokens(step, vocab)
        losses.append(module.forward_backward(x, target=y).item())
        opt.step()
        opt.zero_grad()
    return losses


def params(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def fresh(program):
    module = program.build()
    return module, torch.optim.AdamW(module.parameters(), **ADAMW)


def test_a_resumed_run_is_the_uninterrupted_one(program, tmp_path):
    module, opt = fresh(program)
    assert checkpoint.latest(tmp_path) is None
    # Before the first step the optimizer has no state; loading that leaves none.
    module.save_checkpoint(tmp_path, optimizer=opt, step=0)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000000"
    other, other_opt = fresh(program)
    assert other.load_checkpoint(tmp_path, optimizer=other_opt) == (0, {})
    assert not other_opt.state
    losses = train(module, opt, range(2))
    path = module.save_checkpoint(tmp_path, optimizer=opt, step=2, extra={"tokens": 256})
    assert path == tmp_path / "step-00000002"
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["world"]["size"] == 1
    assert manifest["tensors"]["blocks.0.attn.c_attn.weight"]["shape"] == [192, 64]
    assert manifest["optimizer"]["class"] == "AdamW"
    assert (path / "plan.json").is_file()
    rng = torch.get_rng_state()
    losses += train(module, opt, range(2, 4))
    # Loading into a module whose optimizer has no state yet: made, then read, unseen
    # by the optimizer's step hooks.
    resumed, resumed_opt = fresh(program)
    stepped = []
    resumed_opt.register_step_post_hook(lambda *_: stepped.append(1))
    torch.manual_seed(123)
    assert resumed.load_checkpoint(tmp_path, optimizer=resumed_opt) == (2, {"tokens": 256})
    assert torch.equal(torch.get_rng_state(), rng)
    assert not stepped
    assert train(resumed, resumed_opt, range(2, 4)) == losses[2:]
    for name, value in params(module).items():
        assert torch.equal(value, params(resumed)[name]), name
    # The optimizer state too, parameter by parameter.
    assert len(opt.state) == len(resumed_opt.state) == len(list(module.parameters()))
    for p, q in zip(module.parameters(), resumed.parameters()):
        assert opt.state[p].keys() == resumed_opt.state[q].keys()
        assert all(torch.equal(opt.state[p][k], resumed_opt.state[q][k]) for k in opt.state[p])


def test_the_watchdog_hears_a_saves_and_a_loads_file_work_apart(program, tmp_path):
    """A save's and a load's storage work (writing, hashing, reading files) is marked
    apart from the rest, where ranks done with theirs wait: the watchdog judges only
    that work against the save's or load's own limit (partc/runtime/watchdog.py)."""
    module, opt = fresh(program)
    train(module, opt, range(1))
    heard: list[str] = []
    checkpoint.save(module.state, checkpoint.BackgroundSave(), tmp_path, optimizer=opt,
                    step=1, extra=None, async_save=False, keep=None,
                    marks=PhaseMarks(heard.append, "checkpoint save(step=1)"))
    assert [m for m in heard if ":" in m] == ["checkpoint save(step=1): writing",
                                              "checkpoint save(step=1): hashing",
                                              "checkpoint save(step=1): writing"]  # commit
    assert heard[-1] == "checkpoint save(step=1)"
    heard.clear()
    checkpoint.load(module.state, checkpoint.BackgroundSave(), tmp_path, optimizer=opt,
                    marks=PhaseMarks(heard.append, "checkpoint load"))
    assert [m for m in heard if ":" in m] == ["checkpoint load: reading"] * 2  # check, read
    assert heard[-1] == "checkpoint load"


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(program, tmp_path,
                                                                        monkeypatch):
    module, opt = fresh(program)
    train(module, opt, range(1))
    module.save_checkpoint(tmp_path, optimizer=opt, step=1)
    saved = params(module)
    train(module, opt, range(1, 2))

    def killed(*args, **kwargs):  # the process dies after DCP wrote, before the commit
        raise SystemExit("killed")

    monkeypatch.setattr(checkpoint, "_commit", killed)
    with pytest.raises(SystemExit):
        module.save_checkpoint(tmp_path, optimizer=opt, step=2)
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers and (leftovers[0] / ".metadata").is_file()  # written, not committed
    # A step directory whose manifest never came (copied by hand, or a rename without
    # it) is refused by name, and `latest` still names step 1.
    partial = tmp_path / "step-00000002"
    shutil.copytree(leftovers[0], partial)
    resumed, resumed_opt = fresh(program)
    with pytest.raises(partc.CheckpointError, match="manifest.json is missing") as caught:
        resumed.load_checkpoint(partial, optimizer=resumed_opt)
    assert caught.value.path == str(partial / "manifest.json")
    assert resumed.load_checkpoint(tmp_path, optimizer=resumed_opt)[0] == 1
    assert all(torch.equal(v, params(resumed)[k]) for k, v in saved.items())
    # The next save clears what the killed one left.
    module.save_checkpoint(tmp_path, optimizer=opt, step=3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert checkpoint.resolve(tmp_path).name == "step-00000003"


def test_a_failing_save_raises_and_keeps_the_previous_checkpoint(program, tmp_path,
                                                                 monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    module, opt = fresh(program)
    train(module, opt, range(1))
    module.save_checkpoint(tmp_path, optimizer=opt, step=1)

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(partc.CheckpointError, match="No space left on device"):
        module.save_checkpoint(tmp_path, optimizer=opt, step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    assert module.load_checkpoint(tmp_path, optimizer=opt)[0] == 1
    with pytest.raises(partc.CheckpointError, match="extra must be JSON"):
        module.save_checkpoint(tmp_path, step=3, extra={"model": module})
    # keep=N: the newest N stay.
    for step in (4, 5, 6):
        module.save_checkpoint(tmp_path, step=step, keep=2)
    assert [p.name for p in checkpoint.listed(tmp_path)] == ["step-00000005", "step-00000006"]


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path):
    """A run that goes non-finite with the check off (on_nonfinite="ignore": AdamW steps
    with NaN gradients) saves checkpoints whose manifest says so; keep=1 then keeps the
    last finite one besides the newest, until a finite one follows."""
    torch.manual_seed(0)
    x, y = tokens(0)
    module = partc.compile(
        gpt_tiny(), (x,), loss_fn=loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=1, device="CPU"),
        train=partc.TrainSpec(global_batch_size=B, on_nonfinite="ignore"),
        constraints=partc.Constraints(num_microbatches=2)).build()
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    train(module, opt, range(2))
    module.save_checkpoint(tmp_path, optimizer=opt, step=2, keep=1)
    finite = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())["finite"]
    assert finite == {"state": True, "loss": True, "grad_norm": None, "skipped": False}
    with torch.no_grad():
        dict(module.named_parameters())["ln_f.weight"][0] = float("inf")
    assert math.isnan(train(module, opt, range(2, 3))[0])
    for step in (3, 4):
        module.save_checkpoint(tmp_path, optimizer=opt, step=step, keep=1)
        manifest = json.loads((tmp_path / checkpoint.step_name(step) / "manifest.json")
                              .read_text())
        assert manifest["finite"]["state"] is False and not checkpoint.holds_finite(manifest)
        assert [p.name for p in checkpoint.listed(tmp_path)] == [
            "step-00000002", checkpoint.step_name(step)]
    # Back to the finite state: the next save is finite, and keep=1 means one again.
    module.load_checkpoint(tmp_path / "step-00000002", optimizer=opt)
    train(module, opt, range(2, 3))
    module.save_checkpoint(tmp_path, optimizer=opt, step=5, keep=1)
    assert [p.name for p in checkpoint.listed(tmp_path)] == ["step-00000005"]
    assert checkpoint.holds_finite({"step": 1})   # a manifest from before the record


def test_checkpoints_of_other_models_or_partial_ones_are_refused_before_any_change(
        program, tmp_path):
    module, opt = fresh(program)
    train(module, opt, range(1))
    module.save_checkpoint(tmp_path / "ours", optimizer=opt, step=1)
    before = params(module)

    torch.manual_seed(0)
    shallow = compile_one(gpt_tiny(n_layer=1)).build()
    shallow.save_checkpoint(tmp_path / "shallow", step=1)
    with pytest.raises(partc.CheckpointError, match=r"another model: it lacks \d+ of this "
                       r"model's tensors \(blocks\.1\.") as caught:
        module.load_checkpoint(tmp_path / "shallow")
    assert caught.value.path.endswith("manifest.json") and caught.value.tensor

    narrow = compile_one(gpt_tiny(vocab_size=64), vocab=64).build()
    narrow.save_checkpoint(tmp_path / "narrow", step=1)
    # (lm_head.weight is tok_emb.weight: tied, one tensor.)
    with pytest.raises(partc.CheckpointError, match=r"1 tensor of other shapes: "
                       r"tok_emb.weight has shape \[64, 64\] in the checkpoint, \[128, 64\] "
                       r"in this model") as caught:
        module.load_checkpoint(tmp_path / "narrow")
    assert caught.value.tensor == "tok_emb.weight"

    with pytest.raises(partc.CheckpointError, match="SGD"):
        module.load_checkpoint(tmp_path / "ours",
                               optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    step_dir = checkpoint.resolve(tmp_path / "ours")
    data = next(step_dir.glob("*.distcp"))
    content = data.read_bytes()
    data.write_bytes(content[:len(content) // 2])
    with pytest.raises(partc.CheckpointError, match=f"{data}.* truncated"):
        module.load_checkpoint(tmp_path / "ours", optimizer=opt)
    data.unlink()
    with pytest.raises(partc.CheckpointError, match=f"{data} is missing: .* partial"):
        module.load_checkpoint(tmp_path / "ours", optimizer=opt)
    with pytest.raises(partc.CheckpointError, match="no checkpoint at"):
        module.load_checkpoint(tmp_path / "nowhere")
    assert all(torch.equal(v, params(module)[k]) for k, v in before.items())


def test_an_asynchronous_save_writes_what_the_step_had(program, tmp_path):
    module, opt = fresh(program)
    train(module, opt, range(1))
    saved = params(module)
    module.save_checkpoint(tmp_path, optimizer=opt, step=1, async_save=True)
    train(module, opt, range(1, 3))  # training goes on while it writes
    assert module.wait_checkpoint() == tmp_path / "step-00000001"
    resumed, resumed_opt = fresh(program)
    assert resumed.load_checkpoint(tmp_path, optimizer=resumed_opt)[0] == 1
    assert all(torch.equal(v, params(resumed)[k]) for k, v in saved.items())


# -- checkpoints are data: digests, metadata, ``latest`` ------------------------------------


def _saved(program, root: Path):
    module, opt = fresh(program)
    train(module, opt, range(1))
    module.save_checkpoint(root, optimizer=opt, step=1)
    return module, opt, checkpoint.resolve(root)


def _verify(directory: Path, capsys) -> tuple[int, list[str]]:
    status = cli_main(["checkpoint", "verify", str(directory)])
    return status, capsys.readouterr().out.splitlines()


def test_a_flipped_byte_is_refused_before_any_parameter_changes(program, tmp_path, capsys):
    module, opt, step_dir = _saved(program, tmp_path)
    assert _verify(tmp_path, capsys) == (0, [])
    train(module, opt, range(1, 2))
    before = params(module)
    data = next(step_dir.glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01   # one bit, in a tensor's bytes
    data.write_bytes(bytes(content))
    with pytest.raises(partc.CheckpointError, match=f"{data} does not match its sha256 "
                       "in the manifest.*restore it from a copy") as caught:
        module.load_checkpoint(tmp_path, optimizer=opt)
    assert caught.value.path == str(data)
    assert all(torch.equal(v, params(module)[k]) for k, v in before.items())
    status, lines = _verify(tmp_path, capsys)
    assert status == 1 and len(lines) == 1 and lines[0].startswith(str(data))
    # Truncated: refused by its size, named by the command too.
    data.write_bytes(bytes(content[:100]))
    with pytest.raises(partc.CheckpointError, match="has 100 bytes, the manifest says"):
        module.load_checkpoint(tmp_path, optimizer=opt)
    assert _verify(step_dir, capsys)[0] == 1


PLANTED = """
import pickle, sys

class Payload:
    def __reduce__(self):
        return (exec, ("open({marker!r}, 'w').write('ran')",))

data = pickle.dumps(Payload(), protocol=4)
size = int(sys.argv[1])
sys.stdout.buffer.write(data + b" " * max(0, size - len(data)))
"""


def _plant(step_dir: Path, marker: Path, *, rewrite_manifest: bool) -> None:
    """Replace .metadata with a pickle that would write ``marker``, padded to the size
    the manifest records (and, where asked, the manifest's digest made to match)."""
    metadata = step_dir / ".metadata"
    script = PLANTED.format(marker=str(marker))
    made = subprocess.run([sys.executable, "-c", script, str(metadata.stat().st_size)],
                          capture_output=True, check=True).stdout
    metadata.write_bytes(made)
    if rewrite_manifest:
        manifest_file = step_dir / "manifest.json"
        manifest = json.loads(manifest_file.read_text())
        manifest["files"][".metadata"] = {"bytes": len(made),
                                          "sha256": hashlib.sha256(made).hexdigest()}
        manifest_file.write_text(json.dumps(manifest))


def test_a_planted_metadata_pickle_is_refused_and_runs_nothing(program, tmp_path, capsys):
    module, opt, step_dir = _saved(program, tmp_path)
    marker = tmp_path / "marker"
    _plant(step_dir, marker, rewrite_manifest=False)
    with pytest.raises(partc.CheckpointError, match=r"\.metadata does not match its sha256"):
        module.load_checkpoint(tmp_path, optimizer=opt)
    # With the manifest's digest made to match, the unpickler refuses the global itself.
    _plant(step_dir, marker, rewrite_manifest=True)
    with pytest.raises(partc.CheckpointError, match=r"references builtins\.exec, which "
                       r"DCP's metadata never holds.*no code in it ran") as caught:
        module.load_checkpoint(tmp_path, optimizer=opt)
    assert caught.value.path == str(step_dir / ".metadata")
    status, lines = _verify(tmp_path, capsys)
    assert status == 1 and "builtins.exec" in lines[0]
    # build(state_dict=<the directory>) reads .metadata through the same unpickler.
    with pytest.raises(partc.CheckpointError, match="builtins.exec"):
        open_weights(step_dir)
    (step_dir / "manifest.json").unlink()   # a plain DCP directory: no digests to check
    with pytest.raises(partc.CheckpointError, match="builtins.exec"):
        open_weights(step_dir)
    assert not marker.exists()


def test_weights_from_a_checkpoint_check_the_files_they_read(program, tmp_path):
    _, _, step_dir = _saved(program, tmp_path)
    weights = open_weights(tmp_path)
    assert weights["tok_emb.weight"].shape == (128, 64)
    data = next(step_dir.glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[-10] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(partc.CheckpointError, match="does not match its sha256"):
        open_weights(tmp_path)["tok_emb.weight"]


def test_without_latest_the_newest_complete_step_resumes(program, tmp_path, caplog):
    module, opt = fresh(program)
    for step in (1, 2, 3):
        train(module, opt, range(step - 1, step))
        module.save_checkpoint(tmp_path, optimizer=opt, step=step)
    (tmp_path / "latest").unlink()
    with caplog.at_level("WARNING", logger="partc.runtime"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-00000003"
    assert "resuming from step-00000003" in caplog.text
    # The newest is damaged: the one before it, naming why.
    data = next((tmp_path / "step-00000003").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-1])
    caplog.clear()
    with caplog.at_level("WARNING", logger="partc.runtime"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-00000002"
    assert "newer, incomplete" in caplog.text and str(data) in caplog.text
    resumed, resumed_opt = fresh(program)
    assert resumed.load_checkpoint(tmp_path, optimizer=resumed_opt)[0] == 2
    # None complete: refused, never a fresh start over them.
    for step in (1, 2):
        (tmp_path / checkpoint.step_name(step) / "manifest.json").unlink()
    with pytest.raises(partc.CheckpointError, match="none of the 3 step directories .* is "
                       "complete.*refusing to start afresh"):
        checkpoint.latest(tmp_path)


def test_a_save_leaves_another_live_jobs_temporary_directory(program, tmp_path):
    module, opt = fresh(program)
    host = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "pass"])
    try:
        theirs = tmp_path / f".tmp-step-00000009+{host}+{alive.pid}+0badc0de"
        died = tmp_path / f".tmp-step-00000009+{host}+{2 ** 22 + 17}+0badc0de"
        theirs.mkdir(parents=True)
        died.mkdir()
        module.save_checkpoint(tmp_path, optimizer=opt, step=1)
        assert theirs.is_dir() and not died.exists()
        # A directory a live job has locked is refused to a save from elsewhere.
        (tmp_path / ".lock").write_text(json.dumps({"host": host, "pid": alive.pid}))
        with pytest.raises(partc.CheckpointError, match=f"in use by another job .* pid "
                           f"{alive.pid}"):
            module.save_checkpoint(tmp_path, optimizer=opt, step=2)
    finally:
        alive.kill()
        alive.wait()
    assert dead.returncode == 0


# -- resume parity under torchrun ---------------------------------------------------------

SAME, RESHARD = "gpt:pp2>pp2", "gpt:dp2-zero3>tp2"
# bf16 under ZeRO-1: the fp32 master shards are what is saved and read back.
SAME_BF16 = "gpt:dp2-zero1-bf16>dp2-zero1-bf16"
# Experts cut over 2 expert-parallel ranks, resumed whole on a pipeline.
EXPERTS = "moe:dp2-ep2>pp2"
# Experts under ZeRO: FSDP units of each rank's own experts, resumed as ZeRO-1's
# buckets and optimizer shards.
EXPERTS_ZERO = "moe:dp2-ep2-zero3>dp2-ep2-zero1"
# Parameters the forward never reads, held by the first stage alone under pp=2, resumed
# where every rank holds them.
UNREAD = "gpt-vision:pp2>dp2-zero1"
# Experts sharded over 2 ranks holding the same ones (expert-dp 2) under ZeRO-1 and 3,
# resumed on other meshes (4 -> 2 and 2 -> 4 processes, -m slow).
EXPERTS_ZERO_FOUR = ["moe:dp4-ep2-zero1>pp2", "mixtral:dp4-ep2-zero3>dp2-ep2-zero1"]
EXPERTS_ZERO_TWO = ["moe:dp2-ep2>dp4-ep2-zero3", "mixtral:dp2-ep2-zero3>dp4-ep2-zero1"]


def launch(out: Path, phase: str, moves: list[str], nproc: int = 2) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(WORKER), str(out), phase, *moves]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "120"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    files = [out / f"{phase}-rank{r}.json" for r in range(nproc)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"torchrun exited with {done.returncode}; stderr tail:\n"
                    f"{done.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    out = tmp_path_factory.mktemp("resume")
    return (launch(out, "first", [SAME, RESHARD, EXPERTS, EXPERTS_ZERO, SAME_BF16, UNREAD]),
            launch(out, "resume", [SAME, RESHARD, EXPERTS, EXPERTS_ZERO, SAME_BF16, UNREAD,
                                   "faults"]))


def _ran(ranks: list[dict], move: str) -> list[dict]:
    for rank, results in enumerate(ranks):
        assert "error" not in results[move], f"rank {rank}: {results[move].get('traceback')}"
    return [results[move] for results in ranks]


def test_the_same_plan_resumes_bit_identically(resumed):
    first, after = (_ran(ranks, SAME) for ranks in resumed)
    for before, now in zip(first, after):
        assert before["stopped_at"] == SAVE_AT   # one rank's SIGTERM, seen by every rank
        assert now["loaded"] == [SAVE_AT, {"plan": "pp2", "losses": before["losses"][:SAVE_AT]}]
        assert now["losses"] == before["losses"][SAVE_AT:]
        assert now["max_abs_diff_to_first"] == 0.0


def test_a_bf16_zero1_run_resumes_bit_identically_from_its_fp32_masters(resumed):
    # Saving the bf16 weights instead of the fp32 masters would lose the masters' low
    # bits, and the resumed losses would drift from the uninterrupted run's.
    first, after = (_ran(ranks, SAME_BF16) for ranks in resumed)
    for before, now in zip(first, after):
        assert before["stopped_at"] == SAVE_AT and before["zero_stage"] == 1
        assert now["loaded"][0] == SAVE_AT
        assert now["losses"] == before["losses"][SAVE_AT:]
        assert now["max_abs_diff_to_first"] == 0.0


def test_a_zero3_checkpoint_resumes_under_tensor_parallelism_like_one_process(resumed):
    first, after = (_ran(ranks, RESHARD) for ranks in resumed)
    for before, now in zip(first, after):
        assert (before["zero_stage"], now["mesh"]) == (3, {"pp": 1, "dp": 1, "tp": 2})
        losses = before["losses"][:now["start"]] + now["losses"]
        assert len(losses) == STEPS
        assert losses == pytest.approx(now["ref_losses"], rel=RTOL)
        assert now["param_error"] < RTOL, now["param_error_at"]


def test_an_expert_parallel_checkpoint_resumes_without_it_like_one_process(resumed):
    first, after = (_ran(ranks, EXPERTS) for ranks in resumed)
    for before, now in zip(first, after):
        assert before["mesh"]["ep"] == 2 and now["mesh"] == {"pp": 2, "dp": 1, "tp": 1}
        assert now["loaded"][0] == SAVE_AT
        losses = before["losses"][:now["start"]] + now["losses"]
        assert losses == pytest.approx(now["ref_losses"], rel=RTOL)
        assert now["param_error"] < RTOL, now["param_error_at"]
        # The whole state dicts agree: the first run's gathered its experts over ep.
        assert now["max_abs_diff_to_first"] < 1e-6


def _resumes_like_one_process(first: list[dict], after: list[dict]) -> None:
    for before, now in zip(first, after):
        assert before["stopped_at"] == SAVE_AT and now["loaded"][0] == SAVE_AT
        losses = before["losses"][:now["start"]] + now["losses"]
        assert len(losses) == STEPS
        assert losses == pytest.approx(now["ref_losses"], rel=RTOL)
        assert now["param_error"] < RTOL, now["param_error_at"]
        assert now["max_abs_diff_to_first"] < 1e-6   # the uninterrupted run's


def test_a_zero3_expert_parallel_checkpoint_resumes_under_zero1_like_one_process(resumed):
    first, after = (_ran(ranks, EXPERTS_ZERO) for ranks in resumed)
    assert [(r["zero_stage"], r["mesh"]["ep"]) for r in first] == [(3, 2)] * 2
    assert [(r["zero_stage"], r["mesh"]["ep"]) for r in after] == [(1, 2)] * 2
    _resumes_like_one_process(first, after)


def test_parameters_the_forward_never_reads_survive_a_resume_on_another_plan(resumed):
    """The tower the forward never reads is in the whole state dict of both runs, as it
    was (the one-process reference's, untrained), through a checkpoint written by the
    first stage's rank under pp=2 and read by both ranks under dp=2."""
    first, after = (_ran(ranks, UNREAD) for ranks in resumed)
    assert [r["mesh"]["pp"] for r in first] == [2, 2]
    _resumes_like_one_process(first, after)


# Context parallelism shards no parameter: a checkpoint of a cp=2 run resumes under
# ZeRO-3 on dp=2 (cp=1), and one of ZeRO-1 under cp=2 of the other kind.
CONTEXT_PARALLEL = ["hf-llama:cp2-ring>dp2-zero3", "hf-gpt2:dp2-zero1>cp2-a2a"]


@pytest.mark.slow
def test_context_parallel_checkpoints_resume_under_another_cp(tmp_path):
    first = _by_move(launch(tmp_path, "first", CONTEXT_PARALLEL), CONTEXT_PARALLEL)
    after = _by_move(launch(tmp_path, "resume", CONTEXT_PARALLEL), CONTEXT_PARALLEL)
    for move in CONTEXT_PARALLEL:
        _resumes_like_one_process(first[move], after[move])
    assert first[CONTEXT_PARALLEL[0]][0]["mesh"]["cp"] == 2
    assert after[CONTEXT_PARALLEL[1]][0]["mesh"]["cp"] == 2


@pytest.mark.slow
def test_expert_dp_sharded_checkpoints_resume_on_other_meshes(tmp_path):
    """Expert weights and their optimizer state cut over expert-dp (2 ranks) by ZeRO-1
    or FSDP, saved and read at their offsets whatever the other plan."""
    first = {**_by_move(launch(tmp_path, "first", EXPERTS_ZERO_FOUR, 4), EXPERTS_ZERO_FOUR),
             **_by_move(launch(tmp_path, "first", EXPERTS_ZERO_TWO), EXPERTS_ZERO_TWO)}
    after = {**_by_move(launch(tmp_path, "resume", EXPERTS_ZERO_FOUR), EXPERTS_ZERO_FOUR),
             **_by_move(launch(tmp_path, "resume", EXPERTS_ZERO_TWO, 4), EXPERTS_ZERO_TWO)}
    for move in EXPERTS_ZERO_FOUR + EXPERTS_ZERO_TWO:
        _resumes_like_one_process(first[move], after[move])
    assert {r["zero_stage"] for r in first["moe:dp4-ep2-zero1>pp2"]} == {1}
    assert {r["zero_stage"] for r in after["moe:dp2-ep2>dp4-ep2-zero3"]} == {3}


# Optimizer offload: ZeRO-1's host shards resumed bit-identically on the same plan; the
# parameters offloaded too (FSDP2's host shards) resumed under ZeRO-1's offload; a
# pipeline's host tier resumed without offload under tp, and ZeRO-2 without offload
# resumed with the parameters offloaded. (One process, both ways between a plan with
# offload and one without, in the default profile: tests/runtime/test_offload.py.)
OFFLOAD_SAME = "gpt:dp2-zero1-offload>dp2-zero1-offload"
OFFLOAD_MOVES = ["gpt:dp2-zero3-offload-params>dp2-zero1-offload", "gpt:pp2-offload>tp2",
                 "gpt:dp2-zero2>dp2-zero3-offload-params"]


@pytest.mark.slow
def test_offloaded_checkpoints_resume_bit_identically_and_on_other_plans(tmp_path):
    moves = [OFFLOAD_SAME, *OFFLOAD_MOVES]
    first = _by_move(launch(tmp_path, "first", moves), moves)
    after = _by_move(launch(tmp_path, "resume", moves), moves)
    for before, now in zip(first[OFFLOAD_SAME], after[OFFLOAD_SAME]):
        assert before["stopped_at"] == SAVE_AT and now["loaded"][0] == SAVE_AT
        assert now["losses"] == before["losses"][SAVE_AT:]
        assert now["max_abs_diff_to_first"] == 0.0
    for move in OFFLOAD_MOVES:
        _resumes_like_one_process(first[move], after[move])
    assert [r["zero_stage"] for r in after[OFFLOAD_MOVES[2]]] == [3, 3]


def _by_move(ranks: list[dict], moves: list[str]) -> dict[str, list[dict]]:
    return {move: _ran(ranks, move) for move in moves}


def test_one_rank_failing_is_an_error_on_every_rank(resumed):
    for rank, seen in enumerate(_ran(resumed[1], "faults")):
        assert "DCP on rank 1: OSError: [Errno 28] No space left on device" in \
            seen["failed_save"], rank
        assert seen["latest_after_failed_save"] == "step-00000001"
        assert re.search(r"__1_0\.distcp is missing: .* partial checkpoint",
                         seen["partial_load"]), (rank, seen["partial_load"])
        assert seen["unchanged"]
