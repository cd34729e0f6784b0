"""Context-parallel attention, priced per layer and microbatch on one rank.

Under context parallelism (``PipelineConfig.cp`` > 1) each sequence is split over the
``cp`` ranks of a cp group (``partc.rank_grid``): rank ``i`` holds chunks ``i`` and
``2cp - 1 - i`` of ``2cp`` (the load-balanced causal split of Megatron-Core and
torchtitan), so every rank does ``1 / cp`` of the layer's work, attention included: its
per-token work, its activations and the bytes it moves are the whole microbatch's over
cp (:attr:`PipelineConfig.tokens_share`, applied by :mod:`partc.cost.tables`). What cp
adds is the exchange around each attention core (:class:`partc.problem.AttentionCost`):

- ``ring``: ``cp - 1`` steps, each passing the key/value block the rank holds to the next
  rank of the group (one send of ``2 x kv_heads x tokens / cp x head_dim`` elements per
  core and sample) while the rank runs attention on the block it received; a step costs
  what its send adds beside that block's attention (:func:`exposed_seconds`, the
  device's ``comm_overlap``), forward and backward (backward passes the blocks and
  their gradients: twice the bytes, beside twice the work). Two blocks are in flight
  (the one computed on, the one arriving), and backward's gradients two more: the
  transient bytes the layer adds while it runs;
- ``all-to-all`` (DeepSpeed-Ulysses, where heads and key/value heads divide by cp):
  queries, keys and values are re-sharded from the sequence to the heads before the
  core and the output back after it: four all-to-alls forward and four backward, each
  rank sending ``(cp - 1) / cp`` of its share (``2 x (heads + kv_heads) x tokens / cp x
  head_dim`` elements per core and sample), exposed (nothing runs beside them). The
  re-sharded tensors are as large as the rank's own: a copy of them is transient.

Attention FLOPs are those measured (:attr:`AttentionCost.flops`: a causal kernel that
skips masked blocks counts half the (seq x seq) products), split evenly by the
load-balanced chunks. Bytes are in the training's compute dtype.
"""

from __future__ import annotations

from partc.cost.collectives import Group, collective_seconds
from partc.cost.pipeline_config import PipelineConfig, exposed_seconds
from partc.names import CpKind
from partc.problem import AttentionCost, DeviceNumbers, LayerCost, PlanningProblem
from partc.runtime.label_weights import own_loss_refusal, splits_over_sequence


def sequence_tokens(problem: PlanningProblem) -> int:
    """Positions per sample the attention cores read (the sequence cp splits): theirs,
    else the model's tokens per sample."""
    return next((layer.attention.tokens for layer in problem.layers
                 if layer.attention is not None), problem.model.summary.tokens_per_sample)


def cp_group(devices: DeviceNumbers, config: PipelineConfig) -> Group:
    """A cp group: ``cp`` ranks, every tp-th of ``cp x tp`` consecutive ones."""
    return Group.over(devices, config.cp, config.cp * config.tp)


def all_to_all_fits(attention: AttentionCost, cp: int) -> bool:
    """Whether the all-to-all kind can split this layer's heads over ``cp`` ranks (the
    heads a tensor-parallel rank holds, query and key/value alike)."""
    return attention.heads % cp == 0 and attention.kv_heads % cp == 0


def all_to_all_refusal(layers: "tuple[LayerCost, ...] | list[LayerCost]", cp: int,
                       tp: int = 1) -> str | None:
    """Why the all-to-all kind cannot split these layers' heads over ``cp`` ranks beside
    tensor parallelism ``tp`` (``layers`` as one tensor-parallel rank sees them: its share
    of the heads), or None. Ulysses re-shards each rank's heads over the cp group, so
    under tp the heads and key/value heads must divide by cp x tp."""
    unfit = next((layer for layer in layers if layer.attention is not None
                  and not all_to_all_fits(layer.attention, cp)), None)
    if unfit is None:
        return None
    heads, kv_heads = unfit.attention.heads, unfit.attention.kv_heads
    if tp == 1:
        return (f"all-to-all splits heads over cp: layer {unfit.name} has {heads} heads "
                f"and {kv_heads} key/value heads, not both divisible by cp={cp} "
                f"(use cp_kind='ring')")
    return (f"all-to-all splits each tensor-parallel rank's heads over cp: layer "
            f"{unfit.name} has {heads} heads and {kv_heads} key/value heads per rank at "
            f"tp={tp}, not both divisible by cp={cp} (its heads and key/value heads must "
            f"divide by cp x tp = {cp * tp}; use cp_kind='ring', or a smaller tp or cp)")


def cp_seconds(problem: PlanningProblem, config: PipelineConfig,
               layer: LayerCost) -> dict[str, float]:
    """What context parallelism adds to a layer's forward and backward per microbatch on
    one rank, in seconds (0 without cp or attention)."""
    attention = layer.attention
    if config.cp == 1 or attention is None:
        return {"forward": 0.0, "backward": 0.0}
    devices, cp = problem.devices, config.cp
    element = problem.train.precision.compute_bytes
    group = cp_group(devices, config)
    samples = config.micro_batch_size
    if config.cp_kind == CpKind.ALL_TO_ALL:
        share = samples * attention.qkvo_elements(cp) * element
        # An all-to-all of a rank's L bytes sends (cp - 1) / cp of them in cp - 1 steps:
        # what an all-gather of L whole bytes moves. Four of them (q, k, v, out), each
        # way; their bandwidth terms add up to the share's.
        seconds = 4 * collective_seconds("all_gather", share / 4, group)
        return {"forward": seconds, "backward": seconds}
    block = samples * attention.kv_elements(cp) * element
    send = collective_seconds("send", block, group)
    rate = devices.peak_flops * (devices.attention_efficiency or devices.flops_efficiency)
    step = samples * attention.flops / cp / cp / rate   # one block of the rank's attention
    forward = (cp - 1) * exposed_seconds(send, step, devices.comm_overlap)
    backward = (cp - 1) * exposed_seconds(2 * send, 2 * step, devices.comm_overlap)
    return {"forward": forward, "backward": backward}


def cp_transient_bytes(problem: PlanningProblem, config: PipelineConfig,
                       layer: LayerCost) -> int:
    """Bytes context parallelism holds while the layer's attention runs on one rank:
    the ring's key/value blocks in flight (two, and two of their gradients in backward),
    or the all-to-all's re-sharded copy of queries, keys, values and output."""
    attention = layer.attention
    if config.cp == 1 or attention is None:
        return 0
    element = problem.train.precision.compute_bytes
    samples = config.micro_batch_size
    if config.cp_kind == CpKind.ALL_TO_ALL:
        return int(samples * attention.qkvo_elements(config.cp) * element)
    return int(4 * samples * attention.kv_elements(config.cp) * element)


def context_parallel_refusal(problem: PlanningProblem, cp: int) -> str | None:
    """Why the model's sequence cannot be split over ``cp`` ranks, or None."""
    if cp == 1:
        return None
    summary = problem.model.summary
    if summary.context_parallel_blocker:
        return (f"{summary.context_parallel_blocker} reads along the sequence outside "
                f"attention: a sequence shard would see only its own positions")
    if not any(layer.attention is not None for layer in problem.layers):
        return ("the model has no attention core to run context-parallel: no "
                "scaled_dot_product_attention call (or written-out attention) over "
                "(batch, heads, tokens, head_dim) queries whose keys and values are the "
                "same tokens (attention written out is one such call under "
                "TrainSpec(attention=\"fused\"); attention with sinks holds one more key)")
    if summary.context_parallel_mask:
        return summary.context_parallel_mask
    if not splits_over_sequence(summary.own_loss, summary.keywords):
        return own_loss_refusal(summary.own_loss)
    if problem.pins.ep is not None and problem.pins.ep > 1:
        return (f"expert parallelism is pinned (ep={problem.pins.ep}), and the runtime "
                f"does not run context parallelism beside it: pin ep=1 to split the "
                f"sequence")
    tokens = sequence_tokens(problem)
    if tokens % (2 * cp):
        return (f"the sequence of {tokens} tokens does not split into 2 x cp = {2 * cp} "
                f"equal chunks (the load-balanced causal split)")
    return None
