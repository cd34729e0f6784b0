"""Run under torchrun by test_launcher_run.py: train with ``partc train``'s own pieces,
then evaluate, and write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/launcher_worker.py OUT

Two runs of the sample GPT's factory (tiny): pp=2 for 5 steps with telemetry to
``<out>/telemetry`` and an evaluation after the last step, then dp=2 for one step. After
each, ``module.evaluate`` on the held-out batch is compared with the same loss in one
process on the whole model (its weights gathered with ``full_state_dict``), and
parameters and gradients are checked unchanged by it. The dp=2 run shards with
ZeRO-3 (FSDP), whose units gather their parameters for the forward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from partc import launcher  # noqa: E402
from samples import gpt  # noqa: E402

STEPS = 5


def small() -> dict:
    """The factory ``partc train`` loads from this file."""
    return gpt.factory(global_batch=8, seq=16, layers=2, width=32)


def _run(argv: list[str]) -> dict:
    config = launcher.parse_config([f"{Path(__file__).resolve()}:small", *argv])
    module, optimizer, telemetry, workload = launcher.prepare(config)
    losses = launcher.train(module, optimizer, workload, config, telemetry=telemetry)
    inputs, target = launcher._held_out(workload)
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    loss = float(module.evaluate(*inputs, target=target))
    after = module.state_dict()
    unchanged = all(torch.equal(before[name], t.detach()) for name, t in after.items())
    no_grads = all(p.grad is None for p in module.parameters())
    model = small()["model"]
    model.load_state_dict(module.full_state_dict())
    model.eval()
    with torch.no_grad():
        reference = float(gpt.loss_fn(model(*inputs), target))
    module.close()
    return {"losses": losses, "eval_loss": loss, "ref_eval_loss": reference,
            "unchanged": unchanged, "no_grads": no_grads, "stage": module.stage_index,
            "mesh": module.plan.mesh.to_dict()}


def main(out: Path) -> None:
    results = {
        "pp2": _run(["--steps", str(STEPS), "--pp", "2", "--lr", "3e-3", "--warmup-steps",
                     "1", "--log-dir", str(out / "telemetry"), "--eval-every", str(STEPS)]),
        "dp2": _run(["--steps", "1", "--dp", "2", "--zero-stage", "3", "--lr", "3e-3", "-q"]),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
