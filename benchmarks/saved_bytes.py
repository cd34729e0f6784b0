"""What one transformer block keeps for backward under tensor parallelism, measured and
estimated.

For the sample GPT with dropout at tp=2 and tp=4 with sequence parallelism: the
stage partc emits runs one microbatch forward in one process (the rewrite's stand-in
group: the shapes and the code of one rank, no data moved) under
``torch.autograd.graph.saved_tensors_hooks``, counting each saved storage once (bytes of
the whole storage, parameters left out) and charging it to the layer of the node that
saved it. Printed per block: the measured bytes, the plan's estimate for the same layer
(``LayerCost.saved_bytes["none"]`` times the microbatch size) and their ratio.

    PYTHONPATH=. python benchmarks/saved_bytes.py [--embd 256] [--seq 128] [--batch 4]
    PYTHONPATH=. python benchmarks/saved_bytes.py --estimate-only --embd 6144 --heads 48 \
        --seq 2048 --batch 1 --tp 8     # a 22B GPT's layer: the plan's figure only

Run with another checkout on ``PYTHONPATH`` to compare two versions of the runtime.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partc  # noqa: E402
from partc import meta  # noqa: E402
from samples.gpt import GPT, GPTConfig, example_inputs, loss_fn  # noqa: E402


def compile_gpt(config: GPTConfig, batch: int, seq: int, tp: int, sp: bool,
                device: str = "cpu") -> partc.Program:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    ids, targets = example_inputs(model, batch=batch, seq=seq)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=targets,
                         budget=partc.DeviceBudget(num_devices=tp, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=batch),
                         constraints=partc.Constraints(
                             pp=1, dp=1, tp=tp, sequence_parallel=sp, tp_objective="memory",
                             recompute="none", num_microbatches=1))


def saved_storages(program: partc.Program, seed: int = 0
                   ) -> list[tuple[str, int, torch.dtype, tuple[int, ...]]]:
    """What autograd keeps after one microbatch forward of the emitted stage (one rank's
    code over the stand-in group): per storage, once, (layer, bytes, dtype, shape of the
    first tensor saved on it); parameters left out."""
    stage = program.lower().stages[0]
    gm = stage.module
    gm.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    frozen = {StorageWeakRef(t.untyped_storage()) for t in (*gm.parameters(), *gm.buffers())}
    plan = program.plan
    [spec] = [s for s in plan.model.inputs if s.name != "target"]
    ids = torch.randint(0, program.model.config.vocab_size,
                        (plan.micro_batch_size, *spec.shape), generator=gen)
    saved: dict[StorageWeakRef, tuple[str, int, torch.dtype, tuple[int, ...]]] = {}
    current: list[str] = [""]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage not in frozen and storage not in saved:
            saved[storage] = (current[0], tensor.untyped_storage().nbytes(), tensor.dtype,
                              tuple(tensor.shape))
        return tensor

    class Tracking(fx.Interpreter):
        def run_node(self, node: fx.Node):
            if meta.LAYER in node.meta:
                current[0] = meta.layer(node).name
            return super().run_node(node)

    gm.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = Tracking(gm).run(ids)
    records = list(saved.values())
    del outputs
    return records


def runtime_saved_bytes(program: partc.Program, inputs: tuple[torch.Tensor, ...],
                        target: torch.Tensor) -> dict[torch.dtype, int]:
    """What rank 0 of the built module keeps for backward over one step (its second: the
    first runs the pipeline's shape inference too), by dtype: each storage once,
    parameters and buffers left out. Unlike :func:`saved_storages` this runs the
    runtime's own path (mixed precision's compute-dtype parameters and autocast policy,
    the loss in fp32), in this process under a fake process group of the plan's world
    (collectives move nothing; every tensor has its real shape)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = program.plan
    dist.init_process_group("fake", store=FakeStore(), rank=0,
                            world_size=plan.pp * plan.dp * plan.tp)
    try:
        module = program.build()
        module.forward_backward(*inputs, target=target)
        kept: dict[StorageWeakRef, tuple[int, torch.dtype]] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            state = {StorageWeakRef(t.untyped_storage())
                     for t in (*module.module.parameters(), *module.module.buffers())}
            storage = StorageWeakRef(tensor.untyped_storage())
            if storage not in state:
                kept.setdefault(storage, (tensor.untyped_storage().nbytes(), tensor.dtype))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module.forward_backward(*inputs, target=target)
        module.close()
    finally:
        dist.destroy_process_group()
    by_dtype: dict[torch.dtype, int] = {}
    for size, dtype in kept.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    return by_dtype


def measured_saved_bytes(program: partc.Program, seed: int = 0) -> dict[str, int]:
    """Per layer: the bytes of the storages autograd keeps (:func:`saved_storages`)."""
    per_layer: dict[str, int] = {}
    for layer, size, _, _ in saved_storages(program, seed):
        per_layer[layer] = per_layer.get(layer, 0) + size
    return per_layer


def estimated_saved_bytes(program: partc.Program) -> dict[str, float]:
    """Per layer: the plan's saved bytes (no recompute) for one microbatch."""
    plan = program.plan
    [option] = [o for o in program.problem.model.tensor_parallel
                if o.tp == plan.tp and o.sequence_parallel == plan.sequence_parallel
                and o.objective == "memory"] or [None]
    return {layer.name: layer.saved_bytes["none"] * plan.micro_batch_size
            for layer in option.model.layers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--estimate-only", action="store_true",
                        help="the model on the meta device, the plan's figure only (for "
                             "layers too big to run here)")
    args = parser.parse_args(argv)
    config = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=2, n_head=args.heads,
                       n_embd=args.embd, dropout=args.dropout)
    print(f"GPT block: embd {args.embd}, {args.heads} heads, seq {args.seq}, "
          f"microbatch {args.batch}, dropout {args.dropout}, fp32, sequence parallel; "
          f"bytes saved per block")
    print(f"{'tp':>3} {'measured':>15} {'estimated':>15} {'est/meas':>9}")
    for tp in args.tp:
        program = compile_gpt(config, args.batch, args.seq, tp, True,
                              "meta" if args.estimate_only else "cpu")
        want = estimated_saved_bytes(program)["blocks.0"]
        if args.estimate_only:
            print(f"{tp:>3} {'-':>15} {want:>15,.0f} {'-':>9}")
            continue
        got = measured_saved_bytes(program)["blocks.0"]
        print(f"{tp:>3} {got:>15,} {want:>15,.0f} {want / got:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
