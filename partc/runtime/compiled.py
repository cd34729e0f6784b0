"""Stages run through ``torch.compile`` (``TrainSpec.compile``: the planner's choice, or
pinned).

Under ZeRO 0/1 what is compiled is the stage's forward as a whole: dynamo traces the
stage's code, and inductor fuses each chain of element-wise ops between the heavy ones
(matmuls, attention) into one kernel, in the forward and in the backward AOTAutograd
derives from it. Under ZeRO-2/3 each FSDP unit (a layer that owns its parameters,
``passes/fsdp_units.py``) is compiled on its own, as torchtitan compiles each transformer
block under FSDP2: FSDP2 gathers a unit's parameters in a forward pre-hook and frees them
after, hooks that run eagerly around the unit's compiled forward, so the compiled graph
always sees the gathered (unsharded) parameters; the stage's own code between the units
runs eagerly. What the runtime must do exactly as written stays outside the compiled
regions, as graph breaks:

- the tensor-parallel collectives (the stage's ``TensorParallelGroup``): gloo and NCCL
  calls as the runtime makes them, with their autograd conjugates and their counts;
- recomputed layers (``checkpoint_layer``): torch's non-reentrant checkpoint compares what
  the rerun saves with what the forward saved, and selective recompute picks what to keep
  op by op (a dispatch mode a compiled kernel does not go through). A recomputed layer
  runs eagerly (its module is excluded from dynamo), as without compile; the cost model
  prices it unfused;
- routed experts (``ExpertParallel``): their all-to-alls.

The regions between the breaks are exactly the runs of layers that need nothing
special, and the module keeps its parameters and names (checkpoints, optimizers and FSDP
see the same module). Dropout draws its masks from torch's own generator (inductor's
``fallback_random``), as in eager mode: a compiled stage trains like one process, mask
for mask.

The first step compiles: a stage's peers wait on it meanwhile, which on a large model
may take longer than the watchdog's limit (``PARTC_WATCHDOG_S``, a minute by default:
raise it for the first run, later ones read inductor's cache). The plan estimates how
long (:mod:`partc.cost.compile_time`).

Refused, with the reason, before anything runs: activation offload (its saved-tensor
hooks are not traced by dynamo here; the planner offers no offload to a compiled
training) and a CPU run where inductor finds no C++ compiler.
"""

from __future__ import annotations

import functools

import torch
from torch import fx, nn
from torch._inductor import cpp_builder

from partc.errors import PartcError
from partc.plan import Plan
from partc.runtime import experts
from partc.runtime.recompute import checkpoint_layer
from partc.runtime.tp import TensorParallelGroup

# What the compiled stage's kernels are asked to keep as eager mode has it: dropout and
# every random op draw from torch's generator, so masks equal one process's.
INDUCTOR_OPTIONS = {"fallback_random": True}
# The group's methods the emitted code calls (collectives, sharded embedding and
# dropout, the regathering linear) and the primitives they are made of: each one runs
# eagerly.
COLLECTIVES = tuple(name for name, value in vars(TensorParallelGroup).items()
                    if callable(value) and not name.startswith("_") and name != "extra_repr")


def refusal(device: torch.device) -> str | None:
    """Why a plan cannot train compiled by inductor on ``device`` (None: it can)."""
    if device.type == "cpu":
        return _no_cpu_compiler()
    return None


def offload_refusal(plan: Plan) -> str | None:
    """Why ``plan`` cannot train compiled whatever the backend (None: it can)."""
    offloaded = [name for stage in plan.stages for name in stage.offloaded]
    if offloaded:
        return (f"compile=True with activation offload ({offloaded[0]}, ...): the "
                "saved-tensor hooks that move a layer's activations are not traced by "
                "dynamo here; recompute those layers instead, or train without compile")
    return None


@functools.cache
def _no_cpu_compiler() -> str | None:
    """Inductor's CPU kernels are C++ built on the fly: why they cannot be (None: they can)."""
    try:
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # noqa: BLE001 - any failure to find one is the reason
        return (f"compile=True on CPUs needs a C++ compiler for inductor's kernels, and "
                f"none was found ({error}); install g++ or clang++, or train without compile")
    return None


def compile_stage(module: fx.GraphModule, plan: Plan, device: torch.device,
                  units: tuple[str, ...] = (), backend: str = "inductor") -> None:
    """Run ``module``'s forward through ``torch.compile`` from now on (its backward too):
    the whole stage, or under ZeRO-2/3 each of its FSDP ``units`` (paths of submodules)
    on its own, before FSDP shards them; a :class:`PartcError` saying why where the plan
    cannot train compiled. ``backend``: dynamo's (``"inductor"``; tests give
    ``"aot_eager"`` to check what is compiled without building kernels)."""
    reason = offload_refusal(plan) or (refusal(device) if backend == "inductor" else None)
    if reason is not None:
        raise PartcError(reason)
    # On the instances: other stages and programs in the process are untouched.
    for group in _groups(module):
        for name in COLLECTIVES:
            if hasattr(group, name):
                setattr(group, name, torch._dynamo.disable(getattr(group, name)))
    for layer in experts.expert_modules(module):
        layer.forward = torch._dynamo.disable(layer.forward)
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    if plan.effective_zero_stage < 2:
        for layer in _recomputed(module):
            layer.forward = torch._dynamo.disable(layer.forward)
        module.forward = torch.compile(module.forward, backend=backend, options=options,
                                       dynamic=False)
        return
    for path in units:
        unit = module.get_submodule(path)
        eager = _recomputed(unit) if isinstance(unit, fx.GraphModule) else []
        for layer in eager:
            layer.forward = torch._dynamo.disable(layer.forward)
        unit.forward = torch.compile(unit.forward, backend=backend, options=options,
                                     dynamic=False)


def compiled_units(module: nn.Module) -> list[str]:
    """The paths of ``module``'s submodules (itself: ``""``) whose forward runs compiled."""
    return [name for name, sub in module.named_modules()
            if _is_compiled(sub.__dict__.get("forward"))]


def _is_compiled(forward: object) -> bool:
    # torch.compile's wrapper keeps the function it wraps as ``_torchdynamo_orig_callable``;
    # dynamo.disable's wrapper does too, and says it disables.
    return (forward is not None and hasattr(forward, "_torchdynamo_orig_callable")
            and not getattr(forward, "_torchdynamo_disable", False))


def _groups(module: fx.GraphModule) -> list[TensorParallelGroup]:
    return [m for m in module.modules() if isinstance(m, TensorParallelGroup)]


def _recomputed(module: fx.GraphModule) -> list[nn.Module]:
    """The layers the stage runs under ``checkpoint_layer`` (its first argument)."""
    return [module.get_submodule(str(node.args[0].target)) for node in module.graph.nodes
            if node.op == "call_function" and node.target is checkpoint_layer
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"]

