"""Context parallelism in the planner: pricing against hand-worked numbers, the search's
cp choices and kinds, pins refused with the reason, plans that validate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import partc

from partc.compiler import plan_problem
from partc.cost.pipeline_config import PipelineConfig, to_ps
from partc.cost.tables import build_cost_table
from partc.errors import PlanInfeasibleError
from partc.names import CpKind
from partc.planner.search import candidate_configs, cp_choices
from partc.planner.validate import validate_plan
from partc.problem import AttentionCost, Pins, TPOption
from tests.planner.instances import devices, layer, problem

ATTENTION = AttentionCost(cores=1, heads=4, kv_heads=2, head_dim=16, tokens=4096, flops=4e8)


def _problem(*, tokens: int = 4096, attention: AttentionCost | None = ATTENTION,
             blocker: str = "", overlap: float = 1.0, num: int = 2, pins: Pins = Pins(),
             batch: int = 1, mask: str = ""):
    attention = attention and replace(attention, tokens=tokens)
    layers = [replace(layer(f"l{i}", flops=1e9, params=1000), attention=attention)
              for i in range(2)]
    prob = problem(layers, [100.0], devices(num, 10**9, overlap=overlap), batch=batch,
                   pins=pins)
    summary = replace(prob.model.summary, tokens_per_sample=tokens,
                      context_parallel_blocker=blocker, context_parallel_mask=mask)
    return replace(prob, model=replace(prob.model, summary=summary))


def _row(prob, **config):
    config = PipelineConfig(**{"pp": 1, "dp": 1, "micro_batch_size": 1,
                               "num_microbatches": 1, "schedule": "1f1b", **config})
    return build_cost_table(prob, config).layers[0]


@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_a_ring_step_charges_what_its_send_adds_beside_the_blocks_attention(overlap):
    prob = _problem(overlap=overlap)
    whole, ring = _row(prob, dp=2), _row(prob, cp=2, cp_kind=CpKind.RING)
    # Half of each sequence: half the layer's FLOPs (1e9 per sample at 1e12 FLOP/s).
    compute = 0.5 * 1e9 / 1e12
    # One step passes keys and values of 2048 tokens: 2 x 2 heads x 16 x 2048 x 4 bytes
    # at 1e9 B/s, beside a quarter of the attention (4e8 / 2 ranks / 2 blocks).
    send, step = 2 * 2 * 16 * 2048 * 4 / 1e9, 4e8 / 4 / 1e12
    exposed = send - overlap * min(send, step)
    assert whole.forward_ps == to_ps(1e9 / 1e12)
    assert ring.forward_ps == to_ps(compute + exposed)
    # Backward also adds the gradients into their buckets (dp x cp = 2 replicas).
    own = whole.backward_ps - to_ps(2e9 / 1e12)
    assert abs(ring.backward_ps - to_ps(2 * compute + 2 * exposed) - own) <= 1
    assert ring.saved_bytes["none"] == whole.saved_bytes["none"] // 2
    # Two key/value blocks in flight, and two of their gradients in backward.
    assert ring.transient_bytes["none"] - whole.transient_bytes["none"] // 2 == 4 * 2 * 2 * 16 * 2048 * 4


def test_all_to_all_charges_four_exchanges_each_way_with_nothing_beside_them():
    prob = _problem()
    ulysses = _row(prob, cp=2, cp_kind=CpKind.ALL_TO_ALL)
    own = _row(prob, dp=2).backward_ps - to_ps(2e9 / 1e12)
    # q, k, v and the output: 2 x (4 + 2) heads x 16 x 2048 tokens x 4 bytes per rank,
    # half of it leaving the rank, at 1e9 B/s.
    moved = 0.5 * 2 * (4 + 2) * 16 * 2048 * 4 / 1e9
    assert ulysses.forward_ps == to_ps(0.5 * 1e9 / 1e12 + moved)
    assert abs(ulysses.backward_ps - to_ps(1e9 / 1e12 + moved) - own) <= 1


def test_gradients_reduce_over_dp_x_cp():
    prob = _problem(num=4)
    assert _row(prob, dp=4).sync_ps == _row(prob, dp=2, cp=2, cp_kind=CpKind.RING).sync_ps > 0
    assert _row(prob, cp=4, cp_kind=CpKind.RING).sync_ps == _row(prob, dp=4).sync_ps


def test_the_search_tries_cp_where_the_sequence_splits_and_attention_runs():
    assert cp_choices(_problem(), 1) == [(1, None), (2, CpKind.RING), (2, CpKind.ALL_TO_ALL)]
    # 2 x cp chunks of at least 1024 tokens when cp is left to the planner.
    assert cp_choices(_problem(tokens=4000), 1) == [(1, None)]
    assert cp_choices(_problem(tokens=2048), 1) == [(1, None)]
    assert cp_choices(_problem(attention=None), 1) == [(1, None)]
    assert cp_choices(_problem(blocker="cumsum (x, in layer l0)"), 1) == [(1, None)]
    assert cp_choices(_problem(mask="its attention mask depends on the batch"), 1) == [
        (1, None)]
    three_heads = replace(ATTENTION, heads=3, kv_heads=1)
    assert cp_choices(_problem(attention=three_heads), 1) == [(1, None), (2, CpKind.RING)]
    pinned = _problem(tokens=16, pins=Pins(cp=2, cp_kind="all-to-all"))
    assert cp_choices(pinned, 1) == [(2, CpKind.ALL_TO_ALL)]
    assert cp_choices(_problem(pins=Pins(cp_kind="ring")), 1) == [(2, CpKind.RING)]
    configs = candidate_configs(_problem(batch=2))
    assert {(c.pp, c.dp, c.cp, c.cp_kind) for c in configs} == {
        (1, 2, 1, None), (2, 1, 1, None), (1, 1, 2, CpKind.RING), (1, 1, 2, CpKind.ALL_TO_ALL)}


@pytest.mark.parametrize("change, says", [
    (dict(blocker="cumsum (cumsum, in layer l0)"),
     "cumsum (cumsum, in layer l0) reads along the sequence outside attention"),
    (dict(attention=None), "no attention core"),
    (dict(mask="context parallelism cannot split the sequence at sdpa: its attention mask "
                "depends on the batch"), "its attention mask depends on the batch"),
    (dict(tokens=4098), "4098 tokens does not split into 2 x cp = 4 equal chunks"),
    (dict(attention=replace(ATTENTION, heads=3, kv_heads=1), pins=Pins(cp=2, cp_kind="all-to-all")),
     "layer l0 has 3 heads and 1 key/value heads, not both divisible by cp=2"),
])
def test_a_pinned_cp_the_model_cannot_run_is_refused_naming_why(change, says):
    prob = _problem(**{"pins": Pins(cp=2), **change})
    with pytest.raises(PlanInfeasibleError, match="cannot hold the pin cp=2") as refused:
        plan_problem(prob)
    assert says in str(refused.value)


@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_a_cp_plan_validates_and_reduces_over_its_replicas(kind):
    prob = _problem(num=4, batch=2, pins=Pins(cp=2, cp_kind=kind))
    plan = plan_problem(prob)
    assert (plan.cp, plan.cp_kind, plan.mesh.size) == (2, kind, 4)
    validate_plan(prob, plan)
    assert plan.meshes and all(m.cp == 2 for m in plan.meshes)
    wrong = replace(plan, mesh=replace(plan.mesh, cp_kind=CpKind.RING if kind != "ring"
                                       else CpKind.ALL_TO_ALL))
    with pytest.raises(Exception, match="cp_kind pinned"):
        validate_plan(prob, wrong)


def _with_tp2(prob):
    """``prob`` with a measured tp=2 variant holding half of each layer's heads (the 2
    key/value heads of ATTENTION leave one per tensor-parallel rank)."""
    halves = tuple(replace(layer, attention=replace(layer.attention, heads=2, kv_heads=1))
                   for layer in prob.model.layers)
    option = TPOption(tp=2, sequence_parallel=False, choices=(), placements=(),
                      model=replace(prob.model, layers=halves))
    return replace(prob, model=replace(prob.model, tensor_parallel=(option,)))


@pytest.mark.parametrize("pins", [Pins(tp=2, cp=2, cp_kind="all-to-all"),
                                  Pins(tp=2, cp_kind="all-to-all")])
def test_all_to_all_beside_tp_is_refused_for_its_kv_heads_and_unpinned_falls_back_to_ring(pins):
    prob = _with_tp2(_problem(num=4, pins=pins))
    with pytest.raises(PlanInfeasibleError) as refused:
        plan_problem(prob)
    says = str(refused.value)
    assert "2 heads and 1 key/value heads per rank at tp=2" in says
    assert "divide by cp x tp = 4" in says and "cp_kind='ring'" in says
    # With the kind left to the planner, the same mesh runs the ring.
    free = replace(prob, pins=replace(pins, cp=2, cp_kind=None))
    assert cp_choices(free, 2) == [(2, CpKind.RING)]
    plan = plan_problem(free)
    assert (plan.tp, plan.cp, plan.cp_kind) == (2, 2, CpKind.RING)


def test_a_mask_crossing_a_cut_is_not_sent_under_cp():
    # Three tensors cross the cut, one with a gradient, one a mask made from shapes.
    prob = _problem(num=4, batch=4, pins=Pins(pp=2, num_microbatches=2))
    prob = replace(prob, model=replace(prob.model, cut_tensors=((3, 1, 1),)))
    sent = {}
    for cp in (1, 2):
        pins = replace(prob.pins, cp=cp, dp=2 // cp, cp_kind="ring" if cp > 1 else None)
        plan = plan_problem(replace(prob, pins=pins))
        sent[cp] = [(s.p2p.sends, s.p2p.recvs) for s in plan.stages]
    assert sent == {1: [(2 * 3, 2 * 1), (2 * 1, 2 * 3)], 2: [(2 * 2, 2 * 1), (2 * 1, 2 * 2)]}


def test_the_plan_and_report_show_gradients_reduced_over_dp_x_cp():
    from partc.report.text import render
    prob = _problem(num=4, batch=4)
    by_mesh = {}
    for dp, cp in ((4, 1), (2, 2), (1, 4)):
        pins = Pins(pp=1, dp=dp, cp=cp, cp_kind="ring" if cp > 1 else None, zero_stage=0)
        by_mesh[dp, cp] = plan_problem(replace(prob, pins=pins))
    sections = {mesh: plan.data_parallel for mesh, plan in by_mesh.items()}
    assert {mesh: (s.dp, s.cp, s.replicas) for mesh, s in sections.items()} == {
        (4, 1): (4, 1, 4), (2, 2): (2, 2, 4), (1, 4): (1, 4, 4)}
    # One all-reduce of the same gradients over four ranks, whatever their split.
    assert sections[2, 2].stages == sections[4, 1].stages == sections[1, 4].stages
    text = render(by_mesh[2, 2])
    assert "dp=2 x cp=2 (the context-parallel ranks hold the same parameters" in text
    assert "over its 4 replicas" in text


@pytest.mark.parametrize("own_loss, pins, says", [
    ("ForCausalLMLoss", Pins(), "computes its own loss (ForCausalLMLoss) from labels"),
    ("shifted", Pins(), "its loss function takes no shift_labels"),
    ("tokens", Pins(), "from labels it reads inside itself"),
    ("samples", Pins(), "as a mean over samples"),
    ("", Pins(ep=2), "expert parallelism is pinned (ep=2)")])
def test_an_own_label_shifting_loss_or_pinned_ep_keeps_cp_1_and_a_cp_pin_is_refused(
        own_loss, pins, says):
    prob = _problem(pins=pins)
    prob = replace(prob, model=replace(prob.model, summary=replace(
        prob.model.summary, own_loss=own_loss)))
    assert cp_choices(prob, 1) == [(1, None)]
    with pytest.raises(PlanInfeasibleError, match="cannot hold the pin cp=2") as refused:
        plan_problem(replace(prob, pins=replace(pins, cp=2)))
    assert says in str(refused.value)


def test_an_own_loss_given_its_labels_shifted_splits_the_sequence():
    """A Hugging Face causal LM called as people call it, ``model(input_ids=...,
    labels=...)``: partc gives its loss the labels already shifted (``shift_labels``,
    made by the runtime from the labels), which it reads position by position, so the
    sequence may be split; the batch's labels make them."""
    import transformers

    from partc.runtime.batch_check import BatchCheck

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 16))
    program = partc.compile(transformers.LlamaForCausalLM(config),
                            {"input_ids": ids, "labels": ids},
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            constraints=partc.Constraints(cp=2, cp_kind="ring"), cache=None)
    model = program.plan.model
    assert program.plan.cp == 2 and model.shift_labels and model.own_loss == "tokens"
    assert [s.name for s in model.inputs] == ["input_ids", "labels", "shift_labels", "target"]
    check = BatchCheck.of(program.plan, dp_rank=0)
    inputs = check.ordered((), {"input_ids": ids, "labels": ids}, None)
    assert torch.equal(inputs[2][:, :-1], ids[:, 1:]) and (inputs[2][:, -1] == -100).all()
    assert torch.equal(check.labels(inputs), inputs[2])   # what the weights count


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _rows_padded(ids: torch.Tensor, lengths: list[int], *, left: bool = False,
                 labelled: bool = False) -> dict[str, torch.Tensor]:
    """A tokenizer's batch of ``ids`` whose rows hold ``lengths`` tokens, padded at their
    end (or start), labels -100 under the pads (or not, ``labelled``)."""
    seq = ids.shape[1]
    where = torch.arange(seq)
    mask = torch.stack([(where >= seq - n) if left else (where < n) for n in lengths]).long()
    labels = ids if labelled else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_a_padding_mask_is_left_out_where_it_changes_no_counted_output():
    """A tokenizer's batch, ``model(input_ids=..., attention_mask=..., labels=...)``, of
    a causal LM: with rows unpadded (a mask of ones) or padded at their end with labels
    -100 under the pads, the model is traced without the mask (``partc.runtime.padding``):
    each real token sees only real tokens before it either way, and the pads count
    nothing. Attention is causal from the shapes, so the sequence may be split; the plan
    says so, and each batch's mask is checked and left out, under any mesh: rows padded
    at their end pass, rows padded at their start or with labels under their pads are
    refused, naming them."""
    from partc.errors import PlanMismatchError
    from partc.plan import Plan
    from partc.runtime.batch_check import BatchCheck

    ids = torch.randint(0, 64, (2, 16))
    budget = partc.DeviceBudget(num_devices=2, device="CPU")
    unpadded = _rows_padded(ids, [16, 16])
    end = _rows_padded(ids, [16, 11])
    for example, cp in ((unpadded, 2), (unpadded, 1), (end, 2)):
        program = partc.compile(_tiny_llama(), example, budget=budget,
                                constraints=partc.Constraints(cp=cp), cache=None)
        plan = program.plan
        assert plan.cp == cp and plan.model.left_out == ("attention_mask",)
        assert plan.model.pads_at_end and "attention_mask" not in [s.name for s in
                                                                    plan.model.inputs]
        again = Plan.from_dict(plan.to_dict()).model
        assert again.left_out == ("attention_mask",) and again.pads_at_end
        assert "attention_mask left out" in program.report()
        check = BatchCheck.of(plan, dp_rank=0)
        for fine in (unpadded, end, _rows_padded(ids, [3, 16])):
            assert len(check.ordered((), fine, None)) == len(plan.model.inputs) - 1
        with pytest.raises(PlanMismatchError, match=r"pads row\(s\) 1 before their last "
                           "token, and the plan was made for rows padded at their end"):
            check.ordered((), _rows_padded(ids, [16, 11], left=True), None)
        with pytest.raises(PlanMismatchError, match=r"the labels of row\(s\) 1 count pad "
                           "positions"):
            check.ordered((), _rows_padded(ids, [16, 11], labelled=True), None)


def test_position_ids_from_0_are_left_out_and_packed_ones_refused():
    """``position_ids`` of 0..S-1 in every row are what the model counts without them;
    given, transformers reads them for documents packed in a row (a mask that depends on
    the batch). They are left out beside the mask (or with none given), and a batch whose
    positions restart is refused."""
    from partc.errors import PlanMismatchError
    from partc.runtime.batch_check import BatchCheck

    ids = torch.randint(0, 64, (2, 16))
    budget = partc.DeviceBudget(num_devices=2, device="CPU")
    plain = torch.arange(16).expand(2, 16)
    packed = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16)
    for example, left_out in ((dict(_rows_padded(ids, [16, 11]), position_ids=plain),
                               ("attention_mask", "position_ids")),
                              ({"input_ids": ids, "labels": ids, "position_ids": plain},
                               ("position_ids",))):
        plan = partc.compile(_tiny_llama(), example, budget=budget,
                             constraints=partc.Constraints(cp=2), cache=None).plan
        assert plan.cp == 2 and plan.model.left_out == left_out
        check = BatchCheck.of(plan, dp_rank=0)
        check.ordered((), example, None)
        with pytest.raises(PlanMismatchError, match=r"position_ids of row\(s\) 0, 1 are not "
                           "0..15"):
            check.ordered((), dict(example, position_ids=packed), None)
    # Positions kept where the mask is: a model may count them from it.
    kept = partc.compile(_tiny_llama(), dict(_rows_padded(ids, [16, 11], left=True),
                                             position_ids=plain), budget=budget,
                         cache=None).plan
    assert kept.model.left_out == ()


def test_a_padding_mask_stays_where_it_would_change_a_counted_output():
    """Rows padded at their start, or whose pads count labels, keep the mask as an input
    (and the sequence whole); so does a model that is not causal throughout (a masked
    LM, whose tokens see the pads after them), which is traced once without the mask to
    see that, and again with it."""
    ids = torch.randint(0, 64, (2, 16))
    budget = partc.DeviceBudget(num_devices=2, device="CPU")
    for example in (_rows_padded(ids, [16, 11], left=True),
                    _rows_padded(ids, [16, 11], labelled=True)):
        plan = partc.compile(_tiny_llama(), example, budget=budget, cache=None).plan
        assert plan.model.left_out == () and not plan.model.pads_at_end
        assert "attention_mask" in [s.name for s in plan.model.inputs]
    from tests import hf_families

    electra = hf_families.FAMILIES["electra"].build()
    plan = partc.compile(electra, _rows_padded(torch.randint(1, 64, (2, 16)), [16, 11]),
                         budget=budget, cache=None).plan
    assert plan.model.left_out == () and not plan.model.pads_at_end
    assert "attention_mask" in [s.name for s in plan.model.inputs]


def test_a_padded_example_batch_keeps_context_parallelism_out_saying_why():
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(PlanInfeasibleError, match="the example batch's attention_mask pads "
                       "its rows in a way the model cannot be traced without: context "
                       "parallelism splits rows padded at their end, whose pads count no "
                       "label, or unpadded ones"):
        partc.compile(_tiny_llama(), _rows_padded(ids, [16, 12], labelled=True),
                      budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                      constraints=partc.Constraints(cp=2, cp_kind="ring"), cache=None)


def test_no_plan_fits_names_the_context_parallel_mesh_it_tried():
    prob = _problem(num=2, pins=Pins(cp=2, cp_kind="ring"))
    tiny = replace(prob, devices=replace(prob.devices, memory_bytes=(1000,) * 2))
    with pytest.raises(PlanInfeasibleError, match=r"tightest split \(pp=1 x cp=2 \(ring\),"):
        plan_problem(tiny)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_over_the_cp_ranks_with_one_dp_replica(zero):
    # dp=1 x cp=2: the pair holds the same parameters, so the pinned ZeRO stage runs over
    # it (the state halved) where it used to be dropped as if nothing held them twice.
    prob = _problem(num=2, pins=Pins(pp=1, dp=1, cp=2, cp_kind="ring"))
    plans = {z: plan_problem(replace(prob, pins=replace(prob.pins, zero_stage=z)))
             for z in (0, zero)}
    sharded = plans[zero]
    assert sharded.zero_stage == sharded.effective_zero_stage == zero
    validate_plan(prob, sharded)   # raises on any violation
    assert sharded.data_parallel.replicas == 2
    held = {z: p.stages[0].memory_bytes.optimizer for z, p in plans.items()}
    assert held[zero] * 2 == pytest.approx(held[0], rel=1e-6)
    assert zero in {c.zero_stage for c in candidate_configs(replace(prob, pins=Pins(
        pp=1, dp=1, cp=2, cp_kind="ring")))}


def test_a_zero_stage_pinned_beside_dp_1_takes_cp_or_says_why_not():
    plan = plan_problem(_problem(num=2, pins=Pins(dp=1, zero_stage=3)))
    assert (plan.dp, plan.cp, plan.effective_zero_stage) == (1, 2, 3)
    with pytest.raises(PlanInfeasibleError, match="no cp > 1 fits this model"):
        plan_problem(_problem(num=2, attention=None, pins=Pins(dp=1, zero_stage=3)))


def test_a_padding_mask_given_with_the_batch_keeps_cp_1_when_planning():
    """Seen before: a model given its attention mask as an input (a tokenizer's batch)
    was planned context-parallel, and building the plan refused it ("its attention mask
    depends on the batch"). The analysis records what lowering would refuse, and the
    planner keeps the sequence whole where the example batch pads it; with a mask of
    ones (unpadded rows, read as ones) or none (causal from the shapes) it splits it."""
    import torch
    import torch.nn.functional as F

    import partc
    from tests import models

    def loss_fn(output, target):
        return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())

    ids = torch.zeros(2, 32, dtype=torch.long)
    padded = torch.ones_like(ids)
    padded[0, 30:] = 0
    budget = partc.DeviceBudget(num_devices=2, device="CPU")
    for inputs, says in (({"input_ids": ids, "attention_mask": padded},
                          "its attention mask depends on the batch"),
                         ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None),
                         ({"input_ids": ids}, None)):
        compile_it = lambda: partc.compile(  # noqa: E731
            models.llama(attention="sdpa"), inputs, loss_fn=loss_fn, example_target=ids,
            budget=budget, train=partc.TrainSpec(global_batch_size=2),
            constraints=partc.Constraints(cp=2))
        if says is None:
            assert compile_it().plan.cp == 2
            continue
        with pytest.raises(PlanInfeasibleError, match="cannot hold the pin cp=2") as refused:
            compile_it()
        assert says in str(refused.value)
