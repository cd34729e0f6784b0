"""A Hugging Face model as people call it, on one process: compiled from a dict of
keyword inputs with no loss_fn, trained on its own loss through the runtime over
microbatches that count different numbers of labels (padding), and the weights that
make the step's loss the whole batch's mean (partc/runtime/label_weights.py). Parity
under torchrun (pp=2, tp=2): ``hf-llama-own-loss-*`` in tests/runtime/test_hf_families.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import partc
from partc.runtime import label_weights
from tests import hf_families
from tests.tolerances import FP32

B, T, MICROBATCHES = 8, 16, 4


def padded(step: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return hf_families.padded_batch(model, B, T, torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def llama_program():
    torch.manual_seed(0)
    model = hf_families.FAMILIES["llama"].build()
    reference = copy.deepcopy(model)
    program = partc.compile(model, example_inputs=padded(0, model),
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B),
                            constraints=partc.Constraints(num_microbatches=MICROBATCHES))
    module = program.build()
    yield program, module, reference
    module.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_plan_records_keyword_inputs_and_the_models_own_loss(llama_program):
    program, _, _ = llama_program
    model = program.plan.model
    assert [(s.name, s.keyword) for s in model.inputs] == [
        ("input_ids", True), ("labels", True), ("shift_labels", True), ("target", False)]
    # Rows padded at their end, labels -100 under the pads, positions 0..S-1: the model
    # (causal throughout) is traced without mask and positions (partc.runtime.padding).
    assert model.left_out == ("attention_mask", "position_ids") and model.pads_at_end
    # LlamaForCausalLM's loss is given its next-token labels, made by the runtime from
    # the labels, and counts them as they are.
    assert model.shift_labels and model.own_loss == "tokens"


def test_a_saved_own_loss_plan_loads_without_a_loss_fn(llama_program, tmp_path):
    program, _, reference = llama_program
    program.save(tmp_path, code=False)
    loaded = partc.load(tmp_path, reference)   # measured again from keyword inputs
    assert loaded.plan.hash == program.plan.hash and loaded.plan.model == program.plan.model


def test_forward_backward_by_keyword_and_by_mapping_equals_one_process(llama_program):
    _, module, reference = llama_program
    for step in range(2):
        batch = padded(step, reference)
        module.zero_grad()
        loss = module.forward_backward(**batch) if step else module.forward_backward(batch)
        reference.zero_grad()
        expected = reference(**batch).loss
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=FP32)
        # The mean of the microbatches' means is another number: the weights matter.
        with torch.no_grad():
            means = [reference(**{k: v.chunk(MICROBATCHES)[i] for k, v in batch.items()})
                     .loss.item() for i in range(MICROBATCHES)]
        assert abs(sum(means) / MICROBATCHES - expected.item()) > 10 * FP32 * expected.item()
        grads = dict(reference.named_parameters())
        for name, param in module.named_parameters():
            want = grads[name].grad
            assert (param.grad - want).norm() <= FP32 * max(want.norm(), 1e-3), name


def test_a_batch_unlike_the_compiled_one_is_refused_by_name(llama_program):
    _, module, reference = llama_program
    batch = padded(0, reference)
    with pytest.raises(partc.PlanMismatchError, match="missing labels"):
        module.forward_backward(**{k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(partc.PlanMismatchError, match="token_type_ids not among"):
        module.forward_backward(**batch, token_type_ids=batch["input_ids"])
    with pytest.raises(partc.PlanMismatchError, match="own loss: give its labels"):
        module.forward_backward(**batch, target=batch["labels"])


def test_counts_follow_the_models_loss():
    labels = torch.tensor([[5, 6, -100, -100], [-100, 1, 2, 3]])
    assert label_weights.label_counts(labels, "shifted").tolist() == [1, 3]
    assert label_weights.label_counts(labels, "tokens").tolist() == [2, 3]
    assert label_weights.label_counts(labels, "samples").tolist() == [1, 1]


def test_weights_make_the_microbatch_losses_average_to_the_batch_mean():
    counts = torch.tensor([4.0, 0.0, 1.0, 1.0, 2.0, 2.0])   # 3 microbatches of 2
    weights = label_weights.sample_weights(counts, microbatches=3, dp=1, replicas=1)
    per_microbatch = weights.reshape(3, 2).sum(1)
    # w_m = n_m * M * dp / N: the runtime's mean over microbatches of w_m * S_m / n_m.
    assert per_microbatch.tolist() == pytest.approx([4 * 3 / 10, 2 * 3 / 10, 4 * 3 / 10])


def test_a_replicas_rows_are_weighed_by_the_whole_batchs_count(monkeypatch):
    # This replica's rows only: the batch's total comes from the other replica (an
    # all-reduce over dp, here the other replica's numbers added).
    other = torch.tensor([6.0, 0.0], dtype=torch.float64)
    monkeypatch.setattr(label_weights.dist, "all_reduce",
                        lambda numbers, group=None: numbers.add_(other))
    mine = torch.tensor([1.0, 3.0])
    weights = label_weights.sample_weights(mine, microbatches=2, dp=2, replicas=1)
    assert weights.tolist() == pytest.approx([1 * 4 / 10, 3 * 4 / 10])


def test_a_microbatch_without_labels_is_refused():
    counts = torch.tensor([3.0, 2.0, 0.0, 0.0])
    with pytest.raises(partc.PartcError, match="1 of the step's 2 microbatches count no label"):
        label_weights.sample_weights(counts, microbatches=2, dp=1, replicas=1)


def test_each_context_parallel_ranks_mean_is_weighed_by_its_tokens_labels():
    """Under cp=2 each rank returns the mean over the labels of its own tokens (the
    load-balanced layout: rank 0 holds chunks 0 and 3 of 4): weighed by its count over
    the batch's, times M * dp * cp, the average over microbatches and ranks is the
    batch's mean."""
    from partc.runtime import cp_layout

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (4, 8), generator=generator)
    labels[:, :3] = -100   # prompts: rank 0's first chunk counts fewer labels
    losses = torch.rand(4, 8, generator=generator, dtype=torch.float64)
    counted = label_weights.label_counts(labels, "tokens")
    shards = [label_weights.label_counts(cp_layout.shard(labels, 1, 2, r), "tokens")
              for r in range(2)]
    average = 0.0
    for rank in range(2):
        weights = label_weights.sample_weights(counted, microbatches=2, dp=1, replicas=1,
                                               shards=shards, cp_rank=rank)
        mine = cp_layout.shard(losses, 1, 2, rank)
        mask = cp_layout.shard(labels, 1, 2, rank) != -100
        for rows in (slice(0, 2), slice(2, 4)):   # the rank's mean, microbatch by microbatch
            mean = mine[rows][mask[rows]].mean()
            average += float(mean * weights[rows].sum()) / (2 * 2)
    # The weights are float32: the batch mean within fp32's rounding.
    assert average == pytest.approx(float(losses[labels != -100].mean()), rel=FP32)
    labels[:2, :2], labels[:2, 6:] = -100, -100   # rank 0's tokens of microbatch 0: none
    shards = [label_weights.label_counts(cp_layout.shard(labels, 1, 2, r), "tokens")
              for r in range(2)]
    with pytest.raises(partc.PartcError, match="on one context-parallel rank's tokens"):
        label_weights.sample_weights(label_weights.label_counts(labels, "tokens"),
                                     microbatches=2, dp=1, replicas=1, shards=shards)


def test_the_next_labels_are_the_shift_a_causal_lms_loss_makes():
    labels = torch.tensor([[5, 6, -100, 7], [1, 2, 3, 4]])
    assert label_weights.next_labels(labels).tolist() == [[6, -100, 7, -100],
                                                          [2, 3, 4, -100]]
    view = torch.arange(12).reshape(2, 6)[:, :4]   # a non-contiguous view: a fresh row
    assert label_weights.next_labels(view).is_contiguous()


def assert_own_loss_like_one_device(model: torch.nn.Module, batch: dict, counted: str) -> None:
    """``model`` compiled on ``batch`` (keyword inputs, labels among them, no loss_fn)
    counts ``counted`` labels, and its microbatches' step loss is one device's."""
    expected = model(**batch).loss.item()
    program = partc.compile(model, example_inputs=batch,
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B),
                            constraints=partc.Constraints(num_microbatches=MICROBATCHES))
    assert program.plan.model.own_loss == counted
    module = program.build()
    try:
        assert module.forward_backward(**batch).item() == pytest.approx(expected, rel=FP32)
    finally:
        module.close()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_decoders_own_loss_counts_its_labels_as_given(family):
    """Seen before: a T5 or BART plan on its own loss weighed microbatches by their
    samples ("ForConditionalGeneration" was no loss type partc knew), so labels padded
    with -100 gave another loss than one device's. Their cross-entropy averages every
    label not -100 (the decoder reads them shifted right, the loss does not)."""
    torch.manual_seed(0)
    model = hf_families.FAMILIES[family].build().model   # the model itself, by keyword
    batch = padded(0, model)
    del batch["position_ids"]
    batch["decoder_attention_mask"] = batch["attention_mask"]
    assert_own_loss_like_one_device(model, batch, counted="tokens")


def test_a_causal_lm_that_reads_its_labels_unshifted_counts_every_label():
    """Seen before: ``BartForCausalLM`` is named a causal LM, so its labels were counted
    shifted (``labels[:, 1:]``), but its cross-entropy reads them as given: a plan over
    padded microbatches trained on another loss than one device's. Which labels count
    is now read from the trace (partc/passes/helpers/loss_labels.py)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(
        d_model=32, encoder_attention_heads=2, decoder_attention_heads=2, encoder_layers=1,
        decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=hf_families.VOCAB,
        max_position_embeddings=64, use_cache=False, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0)
    model = transformers.BartForCausalLM(config)
    assert model.loss_type == "ForCausalLM"
    batch = padded(0, model)
    del batch["position_ids"]
    assert_own_loss_like_one_device(model, batch, counted="tokens")


def test_a_loss_over_another_input_than_labels_is_said_not_guessed(caplog):
    """BERT's pre-training loss adds a mean over masked tokens (``labels``) and one over
    samples (``next_sentence_label``): no weight per microbatch makes that one device's
    loss, and the log says so rather than weighing by one of them in silence."""
    import transformers

    from partc import meta
    from partc.passes.trace import trace

    config = transformers.BertConfig(hidden_size=32, num_attention_heads=2,
                                     num_hidden_layers=1, intermediate_size=64,
                                     vocab_size=hf_families.VOCAB)
    ids = torch.randint(1, hf_families.VOCAB, (2, 8))
    with caplog.at_level("WARNING", logger="partc"):
        gm, _ = trace(transformers.BertForPreTraining(config), (),
                      kwargs=dict(input_ids=ids, labels=ids,
                                  next_sentence_label=torch.tensor([0, 1])))
    assert "made from next_sentence_label, not from labels" in caplog.text
    assert meta.trace_info(gm).own_loss == "samples"   # the name's guess, said
    caplog.clear()
    with caplog.at_level("WARNING", logger="partc"):
        gm, _ = trace(transformers.BertForSequenceClassification(config), (),
                      kwargs=dict(input_ids=ids, labels=torch.tensor([0, 1])))
    assert "cannot tell" not in caplog.text and meta.trace_info(gm).own_loss == "tokens"
    # One label per sample, -100 not counted.
    assert label_weights.label_counts(torch.tensor([3, -100]), "tokens").tolist() == [1, 0]


def test_uneven_ignored_targets_are_found_per_microbatch_and_cp_rank():
    target = torch.randint(0, 5, (4, 8))
    assert label_weights.uneven_ignored(target, microbatches=2, replicas=1) is None
    even = target.clone()
    even[:, -1] = -100   # each row's last: every microbatch counts as many
    assert label_weights.uneven_ignored(even, microbatches=2, replicas=1) is None
    # ... but the cp rank holding the last chunk counts fewer than the other.
    said = label_weights.uneven_ignored(even, microbatches=2, replicas=1, cp=2)
    assert "per microbatch and context-parallel rank (counting 6 to 8" in said
    padded = target.clone()
    padded[3, 4:] = -100
    said = label_weights.uneven_ignored(padded, microbatches=2, replicas=1)
    assert said.startswith("loss_fn's target holds -100s in different numbers per "
                           "microbatch (counting 12 to 16")
    assert label_weights.uneven_ignored(torch.rand(4, 8), microbatches=2, replicas=1) is None


def test_a_loss_fn_averaging_its_counted_targets_is_weighed_like_one_device(caplog):
    """A loss_fn's mean over the targets it counts (cross-entropy ignores -100), taken
    per microbatch and averaged, is not one device's mean over the batch where the
    microbatches count different numbers. partc asks loss_fn what it averages over
    (on small inputs) and weighs each microbatch by its count: the step's loss and
    gradients are one device's. A loss_fn it cannot ask (its sequence length written
    in) is averaged as it is, and the first batch that counts unevenly says so, once."""
    from samples.gpt import gpt_tiny, loss_fn

    def fixed_shapes(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16, 128).flatten(0, 1),
                                                 targets.reshape(-1, 16).flatten())

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))
    padded = ids.clone()
    padded[3, 8:] = -100
    padded[2, :5] = -100
    for loss, counted in ((loss_fn, True), (fixed_shapes, None)):
        model = gpt_tiny()
        reference = copy.deepcopy(model)
        program = partc.compile(model, ids, loss_fn=loss, example_target=ids,
                                budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                                train=partc.TrainSpec(global_batch_size=4),
                                constraints=partc.Constraints(num_microbatches=2), cache=None)
        assert program.plan.model.counted_target is counted
        module = program.build()
        caplog.clear()
        try:
            with caplog.at_level("WARNING", logger="partc"):
                module.forward_backward(ids, target=ids)
                assert "target holds -100s" not in caplog.text
                got = module.forward_backward(ids, target=padded).item()
                module.forward_backward(ids, target=padded)
        finally:
            module.close()
        expected = loss(reference(ids), padded).item()
        if counted:
            assert got == pytest.approx(expected, rel=FP32) and not caplog.text
        else:
            assert abs(got - expected) > 10 * FP32 * expected   # the mean of the halves'
            assert caplog.text.count("target holds -100s in different numbers per "
                                     "microbatch") == 1


def test_compile_gives_the_shifted_labels_a_plans_own_inputs_are_traced_as_they_are():
    """partc.compile traces a causal LM with ``shift_labels`` (trace's ``shift_labels``);
    a plan is traced again (to load or lower it) from its own inputs alone, so a plan
    written before partc gave them still loads as it was made."""
    from partc import meta
    from partc.passes.trace import trace

    torch.manual_seed(0)
    model = hf_families.FAMILIES["llama"].build()
    ids = torch.randint(1, hf_families.VOCAB, (2, 8))
    gm, _ = trace(model, (), kwargs=dict(input_ids=ids, labels=ids), shift_labels=True)
    info = meta.trace_info(gm)
    assert info.keywords == ("input_ids", "labels", "shift_labels") and info.shift_labels
    assert info.own_loss == "tokens"
    gm, _ = trace(model, (), kwargs=dict(input_ids=ids, labels=ids))
    info = meta.trace_info(gm)
    assert info.keywords == ("input_ids", "labels") and not info.shift_labels
    assert info.own_loss == "shifted"


@pytest.mark.parametrize("reduction, counted", [
    ("mean", True), ("smoothed", True), ("sum", False), ("every entry", False),
    ("fixed length", None)])
def test_a_loss_fn_is_asked_what_it_averages_over(reduction, counted):
    """loss_labels.counts_its_target: cross-entropy's mean over the targets not -100
    (with label smoothing too) is such a mean; a sum or a mean over every entry is not;
    a loss with the sequence length written in cannot be asked on small inputs."""
    import torch.nn.functional as F

    from partc.passes import analyze
    from partc.passes.helpers.loss_labels import counts_its_target
    from samples.gpt import gpt_tiny

    def loss(logits, targets):
        if reduction == "fixed length":
            logits, targets = logits.reshape(-1, 16, 128), targets.reshape(-1, 16)
        flat, wanted = logits.reshape(-1, 128), targets.reshape(-1)
        if reduction == "sum":
            return F.cross_entropy(flat, wanted, reduction="sum")
        if reduction == "every entry":
            return F.cross_entropy(flat, wanted, reduction="sum") / wanted.numel()
        return F.cross_entropy(flat, wanted, label_smoothing=0.1 if reduction == "smoothed"
                               else 0.0)

    ids = torch.randint(0, 128, (4, 16))
    gm, _ = analyze(gpt_tiny(), (ids,), loss_fn=loss, example_target=ids)
    assert counts_its_target(gm) is counted
