"""Planning mixture-of-experts models with expert parallelism: a DeepSeek-V3-shaped model on
2,048 H100-80GB and a Qwen3-235B-A22B-shaped one on 256 H100-80GB, everything decided
jointly (pp, dp, tp, ep, ZeRO, recompute, microbatches, schedule); then Qwen3 pinned to
its published Megatron-Core mesh, against the published throughput.

    python benchmarks/moe_plan.py [--workloads deepseek-v3 qwen3-235b] [--work-limit 8]

For each workload it prints the time of each phase (trace + analyse, tensor-parallel
options, the search), the chosen degrees, the predicted step time and TFLOP/s per GPU
(model FLOPs: the active parameters' forward and backward, no recompute), the all-to-all
per step and the memory at twice the assumed routing imbalance.

How the models are built (on the meta device, no weights): Hugging Face LlamaForCausalLM
with the model's attention shape and, in every block, a dense FFN as wide as the
FFN work one token does at balanced routing (its ``top_k`` routed experts and any shared
expert: ``top_k x expert FFN + shared FFN``), traced and measured by partc as any model
(its tensor-parallel variants too). At balanced routing that FFN does the experts' FLOPs
and saves their activations per token; each mixture-of-experts block then gets the
parameters of its other ``E - top_k`` experts and its router, and ``LayerCost.moe`` (the
routed experts' figures, :class:`partc.problem.MoECost`) computed from the shape. The
planner prices expert parallelism from those figures only, as it does for a model whose
MoE layers partc recognises in the graph.

- ``deepseek-v3``: 61 layers, hidden 7168, vocab 129280; the first 3 blocks dense (FFN
  18432), the other 58 with 256 routed experts of FFN 2048 (8 active) and 1 shared expert
  of FFN 2048; sequences of 4096, 15360 per step (DeepSeek-V3's final batch). Multi-head
  latent attention is approximated by standard multi-head attention of 128 heads of 56
  (4 x 7168^2 = 205M parameters per block against MLA's ~187M; MLA's 192-wide query-key
  heads do more attention FLOPs than these), the multi-token-prediction module is left
  out.
- ``qwen3-235b``: 94 layers, hidden 4096, 64 query / 4 key-value heads of 128, vocab
  151936, every block 128 experts of FFN 1536 (8 active), no shared expert; sequences of
  4096, 2048 per step (the published run's batch is not stated with its throughput; this
  is an assumption). Qwen3's query/key norms are left out.

Both in bf16 with AdamW, 8 H100-80GB per node (NVLink 450 GB/s, 50 GB/s per GPU between
nodes as in benchmarks/plan_time.py), the routing imbalance at its default (2x).

The published reference (Megatron-Core MoE): Qwen3-235B-A22B in bf16 on 256 H100, TP2
EP32 PP8 with 4 virtual stages per rank, 276 TFLOP/s per GPU with the all-to-all
overlapped with compute, 245 without.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from partc.compiler import autocast_dtype, build_problem, plan_problem  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
from partc.plan import BudgetInfo  # noqa: E402
from partc.planner import PlannerOptions  # noqa: E402
from partc.problem import LayerCost, ModelAnalysis, MoECost, PlanningProblem  # noqa: E402
from partc.report.text import sections  # noqa: E402
from partc.units import format_bytes, format_seconds  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int          # 0: no shared expert
    dense_layers: int        # the first blocks, dense
    dense_ffn: int
    seq: int
    global_batch: int
    devices: int


DEEPSEEK_V3 = MoEShape("deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128,
                       head_dim=56, vocab=129280, experts=256, top_k=8, expert_ffn=2048,
                       shared_ffn=2048, dense_layers=3, dense_ffn=18432, seq=4096,
                       global_batch=15360, devices=2048)
QWEN3_235B = MoEShape("qwen3-235b", layers=94, hidden=4096, heads=64, kv_heads=4,
                      head_dim=128, vocab=151936, experts=128, top_k=8, expert_ffn=1536,
                      shared_ffn=0, dense_layers=0, dense_ffn=0, seq=4096, global_batch=2048,
                      devices=256)
WORKLOADS = {shape.name: shape for shape in (DEEPSEEK_V3, QWEN3_235B)}
PUBLISHED = dict(tp=2, ep=32, pp=8, virtual=4, overlapped=276.0, exposed=245.0)


def active_ffn(shape: MoEShape) -> int:
    """The FFN width one token uses in a mixture-of-experts block at balanced routing."""
    return shape.top_k * shape.expert_ffn + shape.shared_ffn


def build(shape: MoEShape) -> torch.nn.Module:
    """The traced stand-in (module docstring): Llama blocks with the active FFN width; the
    dense blocks' FFN replaced by their own width."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=active_ffn(shape),
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         vocab_size=shape.vocab, max_position_embeddings=shape.seq,
                         use_cache=False, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        if shape.dense_layers and shape.dense_ffn != active_ffn(shape):
            dense = LlamaConfig(**{**config.to_dict(), "intermediate_size": shape.dense_ffn})
            for block in model.model.layers[:shape.dense_layers]:
                block.mlp = LlamaMLP(dense)
    return model


def causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def moe_blocks(analysis: ModelAnalysis, shape: MoEShape) -> list[int]:
    """The indices of the analysis's layers that are mixture-of-experts blocks."""
    blocks = [i for i, layer in enumerate(analysis.layers) if ".layers." in layer.name
              or layer.name.startswith("layers")]
    if len(blocks) != shape.layers:
        raise RuntimeError(f"expected {shape.layers} blocks, found {len(blocks)}: "
                           f"{[analysis.layers[i].name for i in blocks][:5]} ...")
    return blocks[shape.dense_layers:]


def expert_cost(shape: MoEShape, dtype_bytes: int, modes: tuple[str, ...]) -> MoECost:
    """The routed experts of one block, per sample, at balanced routing (gated FFNs:
    gate, up and down projections, SiLU)."""
    h, f, k, e, s = shape.hidden, shape.expert_ffn, shape.top_k, shape.experts, shape.seq
    params = e * 3 * h * f
    # Per token and active expert: its input copy (h), gate and up outputs, the SiLU
    # output and the product fed to the down projection (4 f); selective keeps the
    # matmuls' outputs and inputs, recomputing SiLU and the product (2 f fewer).
    saved = {"none": s * k * (h + 4 * f) * dtype_bytes,
             "selective": s * k * (h + 2 * f) * dtype_bytes, "full": 0.0}
    return MoECost(num_experts=e, top_k=k, hidden=h, tokens_per_sample=s,
                   expert_param_count=params, expert_param_bytes=params * dtype_bytes,
                   expert_fwd_flops=2.0 * 3 * s * k * h * f,
                   expert_saved_bytes={m: v for m, v in saved.items() if m in modes},
                   dispatch_bytes=s * k * h * dtype_bytes)


def with_experts(layer: LayerCost, moe: MoECost, shape: MoEShape, tp: int) -> LayerCost:
    """``layer`` (the traced block, its FFN as wide as the active experts) with the other
    experts' and the router's parameters added (split over tp in a variant, as its FFN
    is) and its routed experts described."""
    h, f, k, e = shape.hidden, shape.expert_ffn, shape.top_k, shape.experts
    idle = (e - k) * 3 * h * f // tp + h * e
    bytes_per = layer.param_bytes / max(layer.param_count, 1)
    local = moe if tp == 1 else dataclasses.replace(
        moe, tokens_per_sample=moe.tokens_per_sample // tp,
        expert_param_count=moe.expert_param_count // tp,
        expert_param_bytes=moe.expert_param_bytes // tp,
        expert_fwd_flops=moe.expert_fwd_flops / tp,
        expert_saved_bytes={m: v / tp for m, v in moe.expert_saved_bytes.items()},
        dispatch_bytes=moe.dispatch_bytes / tp)
    return dataclasses.replace(layer, param_count=layer.param_count + idle,
                               param_bytes=int(layer.param_bytes + idle * bytes_per),
                               moe=local)


def add_experts(problem: PlanningProblem, shape: MoEShape) -> PlanningProblem:
    """The measured problem with every mixture-of-experts block's routed experts (the
    whole model and each tensor-parallel variant)."""
    model = problem.model
    blocks = set(moe_blocks(model, shape))
    dtype_bytes = 2 if model.summary.autocast else model.summary.traced_dtype_bytes

    def patched(analysis: ModelAnalysis, tp: int) -> ModelAnalysis:
        layers = tuple(
            with_experts(layer, expert_cost(shape, dtype_bytes, model.layers[i].modes),
                         shape, tp) if i in blocks else layer
            for i, layer in enumerate(analysis.layers))
        return dataclasses.replace(analysis, layers=layers)

    variants = tuple(dataclasses.replace(option, model=patched(option.model, option.tp))
                     for option in model.tensor_parallel)
    whole = patched(model, 1)
    extra = sum(l.param_count for l in whole.layers) - sum(l.param_count for l in model.layers)
    summary = dataclasses.replace(model.summary, num_params=model.summary.num_params + extra)
    return dataclasses.replace(problem, model=dataclasses.replace(
        whole, summary=summary, tensor_parallel=variants))


def budget(shape: MoEShape) -> partc.DeviceBudget:
    return partc.DeviceBudget(num_devices=shape.devices, device="H100-80GB",
                              devices_per_node=8, inter_node_bandwidth="50GB/s")


def train(shape: MoEShape) -> partc.TrainSpec:
    return partc.TrainSpec(global_batch_size=shape.global_batch, dtype=torch.bfloat16,
                           optimizer="adamw")


def measured(shape: MoEShape, constraints: partc.Constraints) -> tuple[dict, PlanningProblem]:
    times = {}
    start = time.perf_counter()
    model = build(shape)
    ids = torch.zeros(1, shape.seq, dtype=torch.long, device="meta")
    times["build on meta"] = time.perf_counter() - start
    start = time.perf_counter()
    graph, analysis = analyze(model, (ids,), loss_fn=causal_lm_loss, example_target=ids,
                              name=shape.name, autocast=autocast_dtype(train(shape)),
                              autocast_device=budget(shape).device_type)
    times["trace + analyse"] = time.perf_counter() - start
    start = time.perf_counter()
    problem = build_problem(analysis, budget(shape), train(shape), constraints, graph)
    times["tensor-parallel options"] = time.perf_counter() - start
    return times, add_experts(problem, shape)


def planned(shape: MoEShape, problem: PlanningProblem, options: PlannerOptions,
            pins: dict | None = None) -> tuple[float, partc.Plan]:
    if pins:
        problem = dataclasses.replace(problem, pins=dataclasses.replace(problem.pins, **pins))
    recorded = BudgetInfo.from_dict(budget(shape).to_dict(torch.bfloat16))
    start = time.perf_counter()
    plan = plan_problem(problem, budget=recorded, train=train(shape), options=options)
    return time.perf_counter() - start, plan


def tflops_per_gpu(plan: partc.Plan) -> float:
    return plan.predicted.mfu * plan.budget.figures.peak_flops / 1e12


def describe(plan: partc.Plan) -> list[str]:
    sp = " SP" if plan.sequence_parallel else ""
    recompute: dict[str, int] = {}
    for mode in plan.recompute.values():
        recompute[mode] = recompute.get(mode, 0) + 1
    lines = [f"mesh: pp={plan.pp} dp={plan.dp} tp={plan.tp}{sp} ep={plan.mesh.ep}"
             + (f" (expert-data-parallel {plan.mesh.expert_dp})" if plan.mesh.ep > 1 else "")
             + f", ZeRO-{plan.zero_stage}, "
             f"{plan.schedule} x{plan.chunks}, b={plan.micro_batch_size} x "
             f"m={plan.num_microbatches}, recompute {recompute}",
             f"predicted: step {plan.predicted.step_time_s:.2f} s, "
             f"{tflops_per_gpu(plan):.0f} TFLOP/s per GPU (MFU "
             f"{100 * plan.predicted.mfu:.1f}%), bubble "
             f"{100 * plan.predicted.bubble_fraction:.1f}%, peak "
             f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB; solver "
             f"{plan.solver.status}, {plan.solver.configs_total} configurations, "
             f"{plan.solver.configs_solved} solved"]
    section = plan.expert_parallel
    if section is not None:
        busiest = max(range(plan.pp), key=lambda s: section.stage_all_to_all_s[s])
        compute = sum(getattr(plan.stages[busiest].time_s, k)
                      for k in ("forward", "backward", "recompute"))
        lines.append(f"all-to-all per step, busiest stage {busiest}: "
                     f"{format_bytes(section.stage_all_to_all_bytes[busiest])} in "
                     f"{format_seconds(section.stage_all_to_all_s[busiest])} "
                     f"({100 * section.stage_all_to_all_s[busiest] / compute:.0f}% of "
                     f"its forward, backward and recompute time), "
                     + ("over the network" if section.crosses_nodes else "inside a node"))
        overflow = next(s for s in sections(plan) if s.key == "expert_parallel").after
        # The stage that runs out first (the least routing it survives) speaks for all.
        worst = min(overflow, key=lambda line: float(line.rsplit("above ", 1)[-1].split("x")[0])
                    if "runs out" in line else float("inf"))
        lines.append(worst)
    return lines


def all_to_all_share(plan: partc.Plan) -> float:
    """The share of the busiest stage's time per step that is all-to-all."""
    section = plan.expert_parallel
    if section is None:
        return 0.0
    busiest = max(range(plan.pp), key=lambda s: section.stage_all_to_all_s[s])
    return section.stage_all_to_all_s[busiest] / plan.predicted.step_time_s


def run(shape: MoEShape, args) -> None:
    options = PlannerOptions(work_limit=args.work_limit)
    print(f"\n{shape.name}: {shape.devices} x H100-80GB (8 per node, 50 GB/s per GPU "
          f"between nodes), {shape.global_batch} sequences of {shape.seq} per step")
    times, problem = measured(shape, partc.Constraints())
    print(f"  {problem.model.summary.num_params / 1e9:.0f}B parameters, "
          f"{sum(1 for l in problem.layers if l.moe)} mixture-of-experts layers")
    seconds, plan = planned(shape, problem, options)
    times["plan (joint search)"] = seconds
    for phase, value in times.items():
        print(f"  {phase:<26} {value:7.2f} s")
    for line in describe(plan):
        print("  " + line)
    if shape is not QWEN3_235B:
        return
    print(f"\n  pinned to the published mesh: TP{PUBLISHED['tp']} EP{PUBLISHED['ep']} "
          f"PP{PUBLISHED['pp']}, sequence parallelism (Megatron's rule for TP with EP)")
    pins = dict(tp=PUBLISHED["tp"], pp=PUBLISHED["pp"], ep=PUBLISHED["ep"],
                sequence_parallel=True)
    virtual = dict(schedule="interleaved-1f1b")
    if "virtual_stages" in {f.name for f in dataclasses.fields(problem.pins)}:
        virtual["virtual_stages"] = PUBLISHED["virtual"]
    else:
        print("  (the virtual-stage count cannot be pinned in this build: interleaved 1F1B "
              "is pinned and the planner chooses its virtual stages per rank)")
    seconds, pinned = planned(shape, problem, options, {**pins, **virtual})
    print(f"  plan time {seconds:.2f} s")
    for line in describe(pinned):
        print("  " + line)
    predicted = tflops_per_gpu(pinned)
    share = all_to_all_share(pinned)
    print(f"  partc predicts {predicted:.0f} TFLOP/s per GPU with the all-to-all exposed; "
          f"published {PUBLISHED['exposed']:.0f} (exposed) and "
          f"{PUBLISHED['overlapped']:.0f} (overlapped): ratio "
          f"{predicted / PUBLISHED['exposed']:.2f} and {predicted / PUBLISHED['overlapped']:.2f}")
    hidden = predicted / (1 - share) if share < 1 else float("nan")
    print(f"  the all-to-all is {100 * share:.1f}% of the step on the busiest stage; "
          f"hidden entirely it would give {hidden:.0f} TFLOP/s per GPU (published gain "
          f"from overlap: {PUBLISHED['overlapped'] / PUBLISHED['exposed']:.2f}x)")
    plain, deduplicated = remote_copies(shape, pinned.mesh.ep)
    print(f"  why it differs: (1) partc prices a plain all_to_all_single, every token sent "
          f"once per expert it is routed to ({plain:.1f} copies per token leave the node "
          f"here); Megatron's DeepEP dispatcher sends a token once per node it reaches and "
          f"fans it out over NVLink ({deduplicated:.1f} copies at uniform routing, "
          f"{plain / deduplicated:.1f}x fewer network bytes); (2) the published run "
          f"interleaves {PUBLISHED['virtual']} virtual stages per rank, this plan "
          f"{pinned.chunks} (pipeline bubble "
          f"{100 * pinned.predicted.bubble_fraction:.1f}% here); (3) "
          f"partc's H100 matmul efficiency is a preset guess "
          f"({pinned.budget.figures.flops_efficiency}), not fitted to grouped-GEMM experts; (4) the "
          f"stand-in model leaves out Qwen3's query/key norms and the router's softmax and "
          f"permutation work, and the published run's batch is not known.")


def remote_copies(shape: MoEShape, ep: int, per_node: int = 8) -> tuple[float, float]:
    """Copies of a token that leave its node per dispatch, at uniform routing over an
    expert-parallel group of ``ep`` ranks: one per routed expert on another node (a plain
    all-to-all), or one per other node holding any of its experts (per-node
    deduplication)."""
    from math import comb

    nodes = max(1, ep // per_node)
    if nodes == 1:
        return 0.0, 0.0
    experts_per_node = shape.experts // nodes
    plain = shape.top_k * (nodes - 1) / nodes
    missed = comb(shape.experts - experts_per_node, shape.top_k) / comb(shape.experts,
                                                                         shape.top_k)
    return plain, (nodes - 1) * (1 - missed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS),
                        choices=sorted(WORKLOADS))
    parser.add_argument("--work-limit", type=float, default=2 * PlannerOptions().work_limit,
                        help="the planner's work limit per search, deterministic seconds of "
                             "CP-SAT work (default twice the planner's)")
    args = parser.parse_args()
    for name in args.workloads:
        run(WORKLOADS[name], args)


if __name__ == "__main__":
    main()
