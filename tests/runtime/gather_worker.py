"""Run under torchrun by test_param_gather_overlap.py: ZeRO-1 with its parameter
all-gather overlapped with the next forward (``TrainSpec.overlap_param_gather``, the
default) against the same plan finishing the all-gathers inside ``optimizer.step()``,
and a checkpoint saved while the all-gathers are in flight. Each rank writes what it saw
to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/gather_worker.py OUT CASE ...

A case is ``<model>[-pp<p>[-v<v>]]-<dtype>[-ckpt]``: model ``gpt`` (the sample GPT) or
``llama`` (Hugging Face Llama from a config, ``tests/hf_families.py``), pp stages
(1F1B; with v virtual stages per rank, interleaved 1F1B), dp the other ranks, ZeRO-1,
Adam, STEPS steps. Without ``-ckpt`` the program
trains twice, overlapped and not, from the same weights and batches; with it, the
overlapped run saves a checkpoint right after step SAVE_AT's ``optimizer.step()`` (its
all-gathers still in flight) and a second build of the same plan loads it and trains the
remaining steps.

Recorded per overlapped step: the buckets whose all-gather ``step()`` left in flight,
and each wait the forward pre-hooks made (the buckets they finished); after the last
step, how many parameters changed when the all-gathers still in flight were finished
(none would if ``step()`` had finished them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from samples import gpt  # noqa: E402
from tests import hf_families, models  # noqa: E402
from tests.runtime.optimizer_worker import BUCKET_ELEMENTS, run_cases  # noqa: E402
from tests.runtime.worker import BATCH, Case, batch  # noqa: E402

STEPS, SAVE_AT, MICROBATCHES = 4, 1, 4
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3)
MODELS = {"gpt": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn),
          "llama": Case(hf_families.FAMILIES["llama"].build, "tokens",
                        models.causal_lm_loss)}


def _parse(name: str) -> tuple[Case, int, int, torch.dtype, bool]:
    parts = name.split("-")
    pp = int(parts.pop(1).removeprefix("pp")) if parts[1].startswith("pp") else 1
    v = int(parts.pop(1).removeprefix("v")) if parts[1].startswith("v") else 1
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parts[1]]
    return MODELS[parts[0]], pp, v, dtype, parts[-1] == "ckpt"


def _build(case: Case, pp: int, v: int, dtype: torch.dtype, overlap: bool):
    torch.manual_seed(0)
    model = case.build()
    x, y = batch(case, model, 0)
    world = dist.get_world_size()
    program = partc.compile(
        model, x, loss_fn=case.loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=world, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH, optimizer="adam", dtype=dtype,
                              overlap_param_gather=overlap, bucket_elements=BUCKET_ELEMENTS),
        constraints=partc.Constraints(
            pp=pp, dp=world // pp, zero_stage=1, recompute="none",
            schedule=("interleaved-1f1b" if v > 1 else "1f1b") if pp > 1 else None,
            virtual_stages=v if v > 1 else None,
            num_microbatches=MICROBATCHES // (world // pp)))
    module = program.build()
    return model, module, module.optimizer(torch.optim.Adam, **ADAM)


def _record_waits(module: Any) -> list:
    """The bucket indices of every wait made while all-gathers were in flight (None: all
    of them, a wait outside forward's hooks)."""
    buckets, seen = module.parts.buckets, []
    wait = buckets.wait_gathers

    def recorded(indices=None):
        if buckets.pending_gathers:
            seen.append(None if indices is None else list(indices))
        wait(indices)

    buckets.wait_gathers = recorded
    return seen


def _step(module: Any, opt: Any, case: Case, model: Any, step: int) -> float:
    x, y = batch(case, model, step)
    loss = module.forward_backward(*x, target=y).item()
    opt.step()
    opt.zero_grad()
    return loss


def _train(case: Case, pp: int, v: int, dtype: torch.dtype, overlap: bool) -> dict[str, Any]:
    model, module, opt = _build(case, pp, v, dtype, overlap)
    waits = _record_waits(module)
    losses, pending, hooked = [], [], []
    for step in range(STEPS):
        waits.clear()
        losses.append(_step(module, opt, case, model, step))
        hooked.append(list(waits))
        pending.append(list(module.parts.buckets.pending_gathers))
    # Read without waiting (the stage's own parameters), then finish the all-gathers.
    stale = {n: p.detach().clone() for n, p in module.module.named_parameters()}
    waits.clear()
    fresh = dict(module.named_parameters())
    changed = sum(not torch.equal(stale[n], fresh[n].detach()) for n in stale)
    full = module.full_state_dict()
    return {"losses": losses, "full": full, "pending": pending, "hook_waits": hooked,
            "buckets": len(module.parts.buckets.buckets), "changed_by_wait": changed,
            "waits_outside": waits.count(None), "virtual_stages": len(module.virtual_stages)}


def _resumed(case: Case, pp: int, v: int, dtype: torch.dtype, out: Path) -> dict[str, Any]:
    """Overlapped: save right after step SAVE_AT's optimizer step, keep training; a second
    build loads that checkpoint and trains the remaining steps."""
    model, module, opt = _build(case, pp, v, dtype, True)
    losses, pending_at_save = [], []
    for step in range(STEPS):
        losses.append(_step(module, opt, case, model, step))
        if step == SAVE_AT:
            pending_at_save = list(module.parts.buckets.pending_gathers)
            module.save_checkpoint(out, optimizer=opt, step=step + 1)
    full = module.full_state_dict()
    model, again, opt = _build(case, pp, v, dtype, True)
    start, _ = again.load_checkpoint(out, optimizer=opt)
    resumed = [_step(again, opt, case, model, step) for step in range(start, STEPS)]
    return {"losses": losses[start:], "resumed_losses": resumed, "full": full,
            "resumed_full": again.full_state_dict(), "pending_at_save": pending_at_save}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


def run_case(name: str, out: Path) -> dict[str, Any]:
    case, pp, v, dtype, ckpt = _parse(name)
    if ckpt:
        seen = _resumed(case, pp, v, dtype, out / name)
        return {"losses": seen["losses"], "resumed_losses": seen["resumed_losses"],
                "differ": _same(seen["full"], seen["resumed_full"]),
                "pending_at_save": seen["pending_at_save"]}
    on = _train(case, pp, v, dtype, True)
    off = _train(case, pp, v, dtype, False)
    return {"losses": on["losses"], "off_losses": off["losses"],
            "differ": _same(on["full"], off["full"]),
            **{key: on[key] for key in ("pending", "hook_waits", "buckets", "changed_by_wait",
                                        "waits_outside", "virtual_stages")},
            "off_pending": off["pending"], "off_changed_by_wait": off["changed_by_wait"]}


def run_named(name: str) -> dict[str, Any]:
    """Case ``name`` in a launch of worker.py (its checkpoints under ``PARTC_WORKER_OUT``)."""
    return run_case(name, Path(os.environ["PARTC_WORKER_OUT"]))


def main() -> None:
    out = Path(sys.argv[1])
    run_cases(lambda name: run_case(name, out))


if __name__ == "__main__":
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
