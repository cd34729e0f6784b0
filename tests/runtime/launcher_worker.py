"""Run under torchrun by test_launcher_run.py: train with ``partc train``'s own pieces,
then evaluate, and write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/launcher_worker.py OUT

Checkpoints: ``_checkpoint_and_resume`` saves, resumes on another plan and refuses a
resume with another seed (test_launcher_run.py's last test).

Two runs of the sample GPT's factory (tiny): pp=2 for 5 steps with telemetry to
``<out>/telemetry`` and an evaluation after the last step, then dp=2 for one step. Before
the pp=2 run and after each, ``module.evaluate`` on the held-out batch is compared with the same loss in one
process on the whole model (its weights gathered with ``full_state_dict``), and
parameters and gradients are checked unchanged by it; the training losses are compared
with the same AdamW, learning rates and data in one process. The dp=2 run shards with
ZeRO-3 (FSDP), whose units gather their parameters for the forward. Then dp=2 for 5
steps on the sample text as a token file (``--data``; the text itself held out,
``--eval-data``): each rank trains on its replica's rows, with the losses of one process
on the whole batches; and so a Hugging Face causal LM named by its config, whose batches
are its own (``input_ids``, ``attention_mask``, ``labels``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from partc.codec import to_data  # noqa: E402
from partc.cli import hf_config, launcher, config as train_config  # noqa: E402
from partc.corpus import ByteTokenizer, write_token_file  # noqa: E402
from partc.runtime import topology  # noqa: E402
from samples import gpt  # noqa: E402

STEPS = 5


def small() -> dict:
    """The factory ``partc train`` loads from this file."""
    return gpt.factory(global_batch=8, seq=16, layers=2, width=32)


def _evaluate(module, inputs: tuple, target) -> dict:
    """``module.evaluate`` and one process's loss on the same weights; whether it left
    parameters and gradients as they were."""
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    loss = float(module.evaluate(*inputs, target=target))
    after = module.state_dict()
    model = small()["model"]
    model.load_state_dict(module.full_state_dict())
    model.eval()
    with torch.no_grad():
        reference = float(gpt.loss_fn(model(*inputs), target))
    return {"loss": loss, "reference": reference,
            "unchanged": all(torch.equal(before[name], t.detach()) for name, t in after.items()),
            "no_grads": all(p.grad is None for p in module.parameters())}


def _one_process_losses(model: torch.nn.Module, workload: dict, config,
                        loss_of=lambda model, inputs, target: gpt.loss_fn(model(inputs),
                                                                          target)
                        ) -> list[float]:
    """The launcher's training (AdamW, its learning rates, its data) of ``model`` in one
    process, ``loss_of(model, inputs, target)`` its loss (the sample GPT's by default)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    losses = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = train_config.learning_rate(step, config)
        inputs, target = workload["data"](step)
        loss = loss_of(model, inputs, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _run(argv: list[str], *, evaluate_first: bool = False) -> dict:
    config = train_config.parse_config([f"{Path(__file__).resolve()}:small", *argv])
    module, optimizer, telemetry, workload = launcher.prepare(config)
    held_out = launcher._held_out(workload)
    # Before any step: the pipeline then learns its shapes forward only, and training
    # after it must still send gradients back.
    first = _evaluate(module, *held_out) if evaluate_first else None
    model = small()["model"]
    model.load_state_dict(module.full_state_dict())
    reference = _one_process_losses(model, workload, config)
    losses = launcher.train(module, optimizer, workload, config, telemetry=telemetry)
    results = {"losses": losses, "ref_losses": reference, "evaluations": [
        e for e in (first, _evaluate(module, *held_out)) if e is not None],
        "stage": module.stage_index, "mesh": to_data(module.plan.mesh)}
    if "rank_data" in workload:   # --data: the rows this rank trained on, and the step's
        results["rows"] = [len(workload["rank_data"](0)[0]), len(workload["data"](0)[0])]
    module.close()
    return results


# A Hugging Face model named by its config, as ``partc train qwen2 --hf-config ...`` takes it.
HF_MODEL = ["qwen2", "--hf-config", "num_hidden_layers=2", "hidden_size=32",
            "intermediate_size=64", "num_attention_heads=4", "num_key_value_heads=2",
            "vocab_size=256", "--seq-len", "16", "--global-batch", "8"]


def _run_hf(data: Path) -> dict:
    """``partc train`` of a Hugging Face causal LM on a token file (dp=2): its batches are
    a tokenizer's, ``model(**batch)``, with the next tokens as the target, and the losses
    one process's on the whole batches with the same AdamW."""
    config = train_config.parse_config([*HF_MODEL, "--steps", str(STEPS), "--dp", "2",
                                        "--data", str(data), "--lr", "3e-3", "-q"])
    module, optimizer, telemetry, workload = launcher.prepare(config)
    model = hf_config.workload(HF_MODEL[0], [pair for pair in HF_MODEL if "=" in pair])["model"]
    model.load_state_dict(module.full_state_dict())
    ref_losses = _one_process_losses(model, workload, config, lambda model, batch, target:
                                     hf_config.next_token_loss(model(**batch), target))
    losses = launcher.train(module, optimizer, workload, config, telemetry=telemetry)
    batch, target = workload["rank_data"](0)
    module.close()
    return {"losses": losses, "ref_losses": ref_losses, "mesh": to_data(module.plan.mesh),
            "keys": sorted(batch), "rows": len(batch["input_ids"]),
            "target": list(target.shape)}


def _execute(argv: list[str]) -> dict:
    """One launch of ``partc train`` (``launcher.execute``: all but leaving the process
    group, which the next launch in this process reuses)."""
    config = train_config.parse_config([f"{Path(__file__).resolve()}:small", *argv])
    try:
        outcome = launcher.execute(config)
    except ValueError as error:
        return {"refused": str(error)}
    return {"status": outcome.status, "start": outcome.start_step, "losses": outcome.losses}


def _checkpoint_and_resume(out: Path) -> dict:
    """4 steps on pp=2 saving every 2 (keeping 1), then ``--resume --steps 6`` on dp=2,
    against 6 uninterrupted steps on pp=2; then a resume with another seed. A constant
    learning rate: the schedule does not depend on --steps."""
    common = ["--lr", "3e-3", "--min-lr", "3e-3", "-q"]
    ckpt = ["--checkpoint-dir", str(out / "ckpt")]
    first = _execute(["--steps", "4", "--pp", "2", *ckpt, "--checkpoint-every", "2",
                      "--keep", "1", "--resume", *common])
    # (rank 0 may not have released the directory's .lock yet, and a rank already in
    # the next launch may be probing that the directory is writable)
    kept = sorted(p.name for p in (out / "ckpt").iterdir()
                  if p.name != ".lock" and not p.name.startswith(".tmp-probe+"))
    resumed = _execute(["--steps", "6", "--dp", "2", *ckpt, "--resume", "--log-dir",
                        str(out / "resumed"), *common])
    whole = _execute(["--steps", "6", "--pp", "2", *common])
    other_seed = _execute(["--steps", "6", "--tp", "2", *ckpt, "--resume", "--seed", "1",
                           *common])
    return {"first": first, "kept": kept, "resumed": resumed, "whole": whole,
            "other_seed": other_seed}


def _token_file(out: Path) -> Path:
    """The sample text as a token file of byte ids (each rank writes its own copy)."""
    text = (ROOT / "samples" / "declaration.txt").read_text()
    return write_token_file(ByteTokenizer().encode(text),
                            out / f"declaration-{os.environ['RANK']}.bin")


def main(out: Path) -> None:
    results = {
        "pp2": _run(["--steps", str(STEPS), "--pp", "2", "--lr", "3e-3", "--warmup-steps",
                     "1", "--log-dir", str(out / "telemetry"), "--eval-every", str(STEPS)],
                    evaluate_first=True),
        "dp2": _run(["--steps", "1", "--dp", "2", "--zero", "3", "--lr", "3e-3", "-q"]),
        "resume": _checkpoint_and_resume(out),
        "data": _run(["--steps", str(STEPS), "--dp", "2", "--data", str(_token_file(out)),
                      "--eval-data", str(ROOT / "samples" / "declaration.txt"), "--lr",
                      "3e-3", "-q"]),
        "hf-data": _run_hf(_token_file(out)),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    topology.leave()   # as partc train leaves: no gloo thread left running into shutdown


if __name__ == "__main__":
    main(Path(sys.argv[1]))
