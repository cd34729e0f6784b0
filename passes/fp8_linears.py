"""FP8 linears: each linear the plan's ``fp8`` section names becomes
:func:`partc.runtime.fp8.linear`, torchao's float8 training of the same linear.

A linear is a call of ``F.linear`` (or ``aten.linear``) whose weight is a parameter
(:func:`~partc.passes.helpers.graph.linear_weight`), named by that weight's FQN, as the
analysis named it for the planner (``HeavyOp.linear_names``). The call keeps its
arguments, the stage's own input, weight and bias, so that ZeRO, checkpoints, recompute
and the optimizer see the same parameters; only its matmuls run FP8. The pass runs in
the lowering list after ``layers`` and before the cut (:mod:`.pipeline`), once the plan
has FP8 linears; the planner keeps them off under tensor parallelism.
"""

from __future__ import annotations

from torch import fx

from partc.errors import PlanMismatchError
from partc.passes.context import Context
from partc.passes.helpers.graph import linear_weight
from partc.runtime import fp8


def fp8_linears(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite each linear of ``ctx.lowering.fp8_linears`` as ``fp8.linear(input, weight,
    bias, recipe=...)``.

    Reads: ``ctx.lowering.fp8_linears``, ``fp8_recipe``; each linear's weight's fake
    value. Writes: the target and keyword arguments of each rewritten node.
    Requires: ``propagate`` (weight shapes). Ensures: every named linear runs FP8, and a
    name the graph has no linear for is an error (the plan is of another model).
    """
    wanted = set(ctx.lowering.fp8_linears)
    found = set()
    for node in gm.graph.nodes:
        features, name = linear_weight(node)
        if features is not None and name in wanted:
            node.target = fp8.linear
            node.kwargs = {**node.kwargs, "recipe": ctx.lowering.fp8_recipe}
            found.add(name)
    missing = sorted(wanted - found)
    if missing:
        raise PlanMismatchError(f"the plan runs FP8 linears the model has no linear for: "
                                f"{missing[:5]}; compile the model again")
    gm.recompile()
    return gm
