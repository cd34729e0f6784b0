"""Repeated blocks traced once: the expanded analysis equals a full trace's, exactly."""

import dataclasses
import functools
import logging

import pytest
import torch
from torch import nn

import partc
from partc import meta
from partc.cost.collectives import Group
from partc.passes.helpers import dedupe
from partc.passes.pipeline import analyze, tensor_parallel_options
from partc.passes.tp.chooser import Link
from samples import gpt
from tests import models

LINK = Link(group=Group(ranks=2, bandwidth=100e9, latency_s=1e-6), flops=1e14,
            hbm_bandwidth=1e12)
IDS = torch.zeros(2, 8, dtype=torch.long)

# name: (build, example input, loss_fn, objectives measured)
MODELS = {
    "samples.gpt": (lambda: gpt.gpt_tiny(n_layer=4), IDS, gpt.loss_fn, ("time", "memory")),
    "hf-llama": (lambda: models.llama(n_layer=4), IDS, models.causal_lm_loss, ("time",)),
    "hf-gpt2": (lambda: models.gpt2(n_layer=4), IDS, models.causal_lm_loss, ("time",)),
    "hf-bert": (lambda: models.bert(n_layer=4), IDS, None, ("time",)),
    "hf-qwen3_5": (lambda: qwen3_5(8), IDS, models.causal_lm_loss, ("time",)),
}


def qwen3_5(layers: int) -> nn.Module:
    """Qwen 3.5's hybrid stack (linear attention, then full attention, repeated) of
    ``layers`` layers, from the coverage families' tiny config."""
    from tests.hf_families import FAMILIES

    family = FAMILIES["qwen3_5"]
    types = family.fields["layer_types"]
    torch.manual_seed(0)
    return dataclasses.replace(family, fields=dict(
        family.fields, num_hidden_layers=layers,
        layer_types=(types * layers)[:layers])).build()


def assert_same_analysis(got, want):
    assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers]
    for mine, theirs in zip(got.layers, want.layers):
        assert mine == theirs, mine.name
    assert got.cut_bytes == want.cut_bytes
    assert got.cut_tensors == want.cut_tensors
    assert got.shared == want.shared
    assert got.summary == want.summary
    assert got == want


def assert_same_options(got, want):
    assert [(o.tp, o.sequence_parallel, o.objective) for o in got] == \
        [(o.tp, o.sequence_parallel, o.objective) for o in want]
    for mine, theirs in zip(got, want):
        assert_same_analysis(mine.model, theirs.model)
        assert mine.choices == theirs.choices
        assert mine.placements == theirs.placements
        assert mine.partial_grad_params == theirs.partial_grad_params
        assert mine.notes == theirs.notes
        assert mine == theirs


def traced_both_ways(build, example, **kwargs):
    full_gm, full = analyze(build(), (example,), full_trace=True, **kwargs)
    gm, analysis = analyze(build(), (example,), **kwargs)
    return (full_gm, full), (gm, analysis)


# A Hugging Face decoder and the sample GPT by default; GPT-2, BERT and Qwen 3.5 -m slow.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in ("hf-gpt2", "hf-bert", "hf-qwen3_5") else name
                                  for name in sorted(MODELS)])
def test_expanded_analysis_and_options_equal_a_full_trace(name):
    build, example, loss_fn, objectives = MODELS[name]
    (full_gm, full), (gm, analysis) = traced_both_ways(build, example, loss_fn=loss_fn)
    skipped = sum(r.size - len(r.kept) for r in dedupe.find_repeats(build(), ((example,), {})))
    assert skipped >= 1   # one block of 4 not traced (of Qwen 3.5's 8, two)
    assert len(meta.layers(gm)) == len(full.layers) - skipped
    assert len(meta.layers(full_gm)) == len(full.layers)
    assert_same_analysis(analysis, full)
    assert_same_options(tensor_parallel_options(gm, [LINK], (False, True), objectives),
                        tensor_parallel_options(full_gm, [LINK], (False, True), objectives))


class Mlp(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Gated(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.up = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(self.gate(x)) * self.up(x)


class Stack(nn.Module):
    """Blocks between a stem and a head; ``skip`` adds the stem's output to the head's
    input (a value made before the blocks that crosses all of them)."""

    def __init__(self, blocks: list[nn.Module], width_in: int, width_out: int,
                 skip: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(width_in, width_in)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width_out, 4)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = start = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h + start if self.skip else h)


class Cross(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.memory = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x) + self.memory(memory))


class TwoStacks(nn.Module):
    """An encoder stack, then a decoder stack whose every block reads the encoder's
    output: a value made between two repeated containers that reaches all of the second."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.encoder = nn.ModuleList(Mlp(width, width) for _ in range(5))
        self.bridge = nn.Linear(width, width)
        self.decoder = nn.ModuleList(Cross(width) for _ in range(6))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.encoder:
            h = block(h)
        memory = self.bridge(h)
        for block in self.decoder:
            h = block(h, memory)
        return self.head(h)


STACKS = {
    "two-stacks": TwoStacks,
    # Two block classes, alternating: traced with their phase kept (2 periods + 1).
    "alternating": lambda: Stack([Mlp(8, 8) if i % 2 else Gated(8) for i in range(8)], 8, 8),
    # Different widths: 8 → 8 three times, 8 → 16 once, 16 → 16 four times.
    "widths": lambda: Stack([Mlp(8, 8) for _ in range(3)] + [Mlp(8, 16)]
                            + [Mlp(16, 16) for _ in range(4)], 8, 16),
    # Odd widths: no linear splits over 2 ranks, so every block has a note naming a node.
    "odd": lambda: Stack([Gated(7) for _ in range(5)], 7, 7),
    "skip": lambda: Stack([Mlp(8, 8) for _ in range(6)], 8, 8, skip=True),
}


@pytest.mark.parametrize("name", sorted(STACKS))
def test_blocks_that_differ_expand_exactly(name):
    width = STACKS[name]().stem.in_features
    (full_gm, full), (gm, analysis) = traced_both_ways(STACKS[name], torch.randn(2, width))
    assert len(meta.layers(gm)) < len(full.layers)
    assert_same_analysis(analysis, full)
    options = tensor_parallel_options(gm, [LINK], (False,), ("time",))
    assert_same_options(options, tensor_parallel_options(full_gm, [LINK], (False,), ("time",)))
    if name == "odd":
        blocks = [note for layer, note in options[0].notes if layer.startswith("blocks.")]
        assert len(blocks) == 5 and len(set(blocks)) == 5  # each names its own node


def test_representatives_keep_the_phase_and_the_last_block():
    assert dedupe._representatives([0] * 6) == ([0, 1, 5], [0, 1, 1, 1, 1, 2])
    # Period 2: the first period and the last (the tail): block 6 stands for the even
    # blocks between (block 0 reads the stack's input), block 1 for the odd ones.
    kept, stands = dedupe._representatives([0, 1] * 4)
    assert kept == [0, 1, 6, 7] and stands == [0, 1, 2, 1, 2, 1, 2, 3]
    # 13 blocks of period 3: the tail from the last whole period's start, block 9.
    assert dedupe._representatives([0, 0, 1] * 4 + [0]) == (
        [0, 1, 2, 9, 10, 11, 12], [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 6])
    # Qwen 3.5's three linear-attention layers to one full: 8 of 32 blocks.
    kept, stands = dedupe._representatives([0, 0, 0, 1] * 8)
    assert kept == [0, 1, 2, 3, 28, 29, 30, 31] \
        and stands == [0, 1, 2, 3] + [4, 1, 2, 3] * 6 + [4, 5, 6, 7]
    for n in range(9, 40):   # every phase as it was: a period, the tail, no more
        for period in (1, 2, 3, 4, 6):
            if n >= 3 * period:
                kinds = [b % period for b in range(n)]
                kept, stands = dedupe._representatives(kinds)
                assert len(kept) == max(2, period) + n - (n - period) // period * period
                assert kept[-1] == n - 1
                assert all(kinds[b] == position % period for position, b in enumerate(kept))
                assert all(kinds[kept[stands[b]]] == kinds[b] for b in range(n))
    kept, stands = dedupe._representatives([0, 0, 0, 1, 2, 2, 2, 2])
    assert kept == [0, 1, 3, 4, 5, 7] and stands == [0, 1, 1, 2, 3, 4, 4, 5]


def test_kinds_ignore_block_indices_and_see_other_attributes():
    (repeat,) = dedupe.find_repeats(models.llama(n_layer=4))  # layer_idx differs per block
    assert (repeat.container, repeat.size, repeat.kept) == ("model.layers", 4, (0, 1, 3))
    blocks = [models.MLP() for _ in range(5)]
    blocks[3].fc1.extra_scale = 2.0  # a plain attribute the block's code could read
    assert dedupe._kinds(blocks) == [0, 0, 0, 1, 0]
    # Callables made per block (as Hugging Face's activations are) count by what they call.
    for block in blocks:
        block.act = functools.partial(torch.nn.functional.gelu, approximate="tanh")
        block.norm = block.fc2.forward
    blocks[1].act = functools.partial(torch.nn.functional.gelu, approximate="none")
    assert dedupe._kinds(blocks) == [0, 1, 0, 2, 0]


def test_blocks_sharing_a_module_or_a_tensor_are_traced_in_full():
    shared = Mlp(8, 8)
    assert dedupe.find_repeats(Stack([shared] * 5, 8, 8)) == ()
    tied = Stack([Mlp(8, 8) for _ in range(5)], 8, 8)
    tied.blocks[4].fc.weight = tied.blocks[0].fc.weight
    assert dedupe.find_repeats(tied) == ()
    assert dedupe.find_repeats(Stack([Mlp(8, 8) for _ in range(3)], 8, 8)) == ()  # too short


class Collects(Stack):
    """Every block's output reaches the head: the blocks are not a chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, outputs = self.stem(x), []
        for block in self.blocks:
            h = block(h)
            outputs.append(h)
        return self.head(torch.stack(outputs).sum(0))


def test_a_mismatch_traces_the_whole_model_and_says_why(caplog):
    build = lambda: Collects([Mlp(8, 8) for _ in range(5)], 8, 8)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="partc"):
        (_, full), (gm, analysis) = traced_both_ways(build, torch.randn(2, 8))
    assert "block blocks.4 and the code around it run differently" in caplog.text
    assert len(meta.layers(gm)) == len(analysis.layers)
    assert meta.layers(gm)[0].name == "stem"
    assert_same_analysis(analysis, full)


def test_a_stack_the_forward_never_enters_leaves_the_others_deduplicated(caplog):
    """Seen before: Gemma 3's vision tower under text-only batches (a stack of layers
    never run) failed the proof ("the blocks do not run once each"), and the whole
    language model was traced. The stack never entered is left whole (it costs the
    trace nothing); the stack that runs is still deduplicated, to the same analysis."""
    def build():
        model = gpt.gpt_tiny(n_layer=4)
        model.vision = nn.ModuleList(Mlp(8, 8) for _ in range(4))
        return model

    repeats = dedupe.find_repeats(build(), ((IDS,), {}))
    assert [(r.container, r.size, len(r.kept)) for r in repeats] == [("blocks", 4, 3)]
    with caplog.at_level(logging.WARNING, logger="partc"):
        (_, full), (gm, analysis) = traced_both_ways(build, IDS, loss_fn=gpt.loss_fn)
    assert "tracing the whole model" not in caplog.text
    assert len(meta.layers(gm)) == len(full.layers) - 1   # one block of 4 not traced
    assert_same_analysis(analysis, full)


def test_a_hybrid_stack_whose_mixers_carry_their_own_index_repeats():
    """Seen before: Qwen 3.5's linear-attention mixers carry ``layer_idx`` (as its
    attention layers do), in only the blocks that hold one: every block was its own
    kind, and its 32 layers were traced, measured and sharded whole (7.5 minutes to
    plan the default config on 8 H100). An index in every block that has it, offset by
    a constant, is a label; the stack repeats and the recording proves it (the whole
    analysis and options equal a full trace's: ``hf-qwen3_5`` above, -m slow)."""
    model = qwen3_5(8)
    repeats = dedupe.find_repeats(model, ((IDS,), {}))
    assert [(r.container, r.size, r.kept) for r in repeats] == [
        ("model.layers", 8, (0, 1, 6, 7))]
    dedupe.prove(model, repeats, ((IDS,), {}))
    # An index only one block carries is no label: it may be what sets that block apart.
    assert dedupe._labels([{("a", "i"): ("int", "3")}, {}]) == set()
    assert dedupe._labels([{("a", "i"): ("int", "3")}, {}, {("a", "i"): ("int", "5")}]) == {
        ("a", "i")}


class Counted(Stack):
    """Refuses to run with fewer blocks than it was built with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.blocks) != 5:
            raise ValueError("five blocks expected")
        return super().forward(x)


def test_a_failed_shorter_trace_restores_the_blocks_and_traces_them_all(caplog):
    model = Counted([Mlp(8, 8) for _ in range(5)], 8, 8)
    blocks = list(model.blocks)
    with caplog.at_level(logging.WARNING, logger="partc"):
        gm, analysis = analyze(model, (torch.randn(2, 8),))
    assert "the forward fails with fewer blocks (ValueError: five blocks expected)" in caplog.text
    assert list(model.blocks) == blocks
    assert [layer.name for layer in analysis.layers][1:-1] == [f"blocks.{i}" for i in range(5)]
    with pytest.raises(RuntimeError), dedupe.shrunk(model, dedupe.find_repeats(model)):
        assert len(model.blocks) == 3
        raise RuntimeError("interrupted")
    assert list(model.blocks) == blocks


def test_full_trace_from_the_environment(monkeypatch):
    monkeypatch.setenv("PARTC_FULL_TRACE", "1")
    gm, analysis = analyze(Stack([Mlp(8, 8) for _ in range(5)], 8, 8), (torch.randn(2, 8),))
    assert len(meta.layers(gm)) == len(analysis.layers) == 7


def test_an_option_that_cannot_expand_is_measured_on_the_whole_model(monkeypatch, caplog):
    (full_gm, _), (gm, _) = traced_both_ways(STACKS["skip"], torch.randn(2, 8))

    def refuse(*args):
        raise dedupe.Mismatch("a note names a node the whole model calls otherwise")

    monkeypatch.setattr(dedupe, "expand_option", refuse)
    with caplog.at_level(logging.WARNING, logger="partc"):
        options = tensor_parallel_options(gm, [LINK], (False,), ("time",))
    assert "measuring tensor parallelism on the whole model" in caplog.text
    assert_same_options(options, tensor_parallel_options(full_gm, [LINK], (False,), ("time",)))


def test_tensor_parallel_heavy_ops_read_each_ranks_weights():
    """Every block's matmuls shard their weights over tp = 2: a rank's heavy ops read about
    half the weight bytes (a row-parallel bias moves out of the matmul, to after its
    all-reduce), their FLOPs half."""
    gm, analysis = analyze(gpt.gpt_tiny(), (IDS,), loss_fn=gpt.loss_fn)
    # Slow devices and a fast link: splitting every matmul pays.
    link = Link(group=Group(ranks=2, bandwidth=1e15, latency_s=0.0), flops=1e9,
                hbm_bandwidth=1e9)
    (option,) = tensor_parallel_options(gm, [link], (False,), ("time",))

    def weights(layer):
        return sum(op.weight_bytes * op.count for op in layer.heavy_ops)

    for whole, rank in zip(analysis.layers, option.model.layers):
        if whole.name.startswith("blocks."):
            assert weights(rank) == pytest.approx(weights(whole) / 2, rel=0.05)
            assert rank.fwd_flops == pytest.approx(whole.fwd_flops / 2)


class Flagged(Stack):
    """The model's loop adds the stem's output after each block marked ``rejoin``: an
    attribute of the block, so the blocks that rejoin are told apart and traced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = start = self.stem(x)
        for block in self.blocks:
            h = block(h)
            if getattr(block, "rejoin", False):
                h = h + start
        return self.head(h)


class Scheduled(nn.Module):
    """Reads a schedule shared by every block at its own index (as Hugging Face blocks
    read ``config.layer_types[self.layer_idx]``): the index is a label to the structure,
    yet the blocks run different code."""

    def __init__(self, width: int, schedule: list[str], index: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.schedule, self.index = schedule, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return torch.tanh(y) * 2 if self.schedule[self.index] == "scaled" else torch.relu(y)


def flagged():
    model = Flagged([Mlp(8, 8) for _ in range(8)], 8, 8)
    model.blocks[3].rejoin = True
    return model


def scheduled():
    schedule = ["plain", "plain", "plain", "scaled", "plain", "plain", "scaled", "plain"]
    return Stack([Scheduled(8, schedule, i) for i in range(8)], 8, 8)


@pytest.mark.parametrize("build", [models.SkipAfterFifth, flagged, scheduled])
def test_blocks_in_different_code_are_never_merged(build):
    """Blocks alike in structure but not in the code they run or sit in: traced apart
    (or the whole model traced), the analysis and every option equal a full trace's."""
    (full_gm, full), (gm, analysis) = traced_both_ways(build, torch.randn(2, 8))
    assert_same_analysis(analysis, full)
    assert_same_options(tensor_parallel_options(gm, [LINK], (False,), ("time",)),
                        tensor_parallel_options(full_gm, [LINK], (False,), ("time",)))


def test_the_skip_after_the_fifth_block_is_seen():
    model = models.SkipAfterFifth()
    example = ((torch.randn(2, 8),), {})
    (repeat,) = dedupe.find_repeats(model, example)
    # The fifth block's segment is a kind of its own, and so is the sixth's: it reads
    # the add, not the previous block's own output.
    assert repeat.kept == (0, 1, 4, 5, 7)
    with pytest.raises(dedupe.Mismatch, match="block blocks.4 and the code around it"):
        dedupe.prove(model, (repeat,), example)  # fewer blocks: the loop never adds skip
    # Marked by an attribute instead, the block is kept and the copies are proven.
    (repeat,) = dedupe.find_repeats(flagged(), example)
    assert repeat.kept == (0, 1, 3, 4, 7)
    dedupe.prove(flagged(), (repeat,), example)
    (repeat,) = dedupe.find_repeats(scheduled(), example)
    assert repeat.kept == (0, 1, 3, 4, 6, 7)  # block 6 copies block 3
    dedupe.prove(scheduled(), (repeat,), example)


class Frozen(Stack):
    """Detaches the third block's output when gradients are on, as a fine-tuning loop
    freezing the bottom of a stack does: the blocks are alike, and so is the code
    around them unless autograd runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for index, block in enumerate(self.blocks):
            h = block(h)
            if index == 2 and torch.is_grad_enabled():
                h = h.detach()
        return self.head(h)


def test_the_forward_is_recorded_as_export_runs_it_with_gradients_on():
    """The recording runs with autograd, as torch.export does: recorded without it, the
    third block would look like the second and stand for it, detach and all."""
    build = lambda: Frozen([Mlp(8, 8) for _ in range(8)], 8, 8)  # noqa: E731
    example = ((torch.randn(2, 8),), {})
    (repeat,) = dedupe.find_repeats(build(), example)
    # The third block detaches, the fourth reads a value that needs no gradient.
    assert repeat.kept == (0, 1, 2, 3, 7)
    assert repeat.stands_for == (0, 1, 2, 3, 1, 1, 1, 4)
    dedupe.prove(build(), (repeat,), example)
    (_, full), (gm, analysis) = traced_both_ways(build, torch.randn(2, 8))
    assert len(meta.layers(gm)) < len(full.layers)
    assert_same_analysis(analysis, full)


def test_the_skip_after_the_fifth_block_builds_under_tensor_parallelism():
    """The issue's report: the plan's sharding had 11 node choices for the fifth block,
    the traced layer 12, and the tp=2 stage failed to build."""
    torch.manual_seed(0)
    program = partc.compile(
        models.SkipAfterFifth(width=16), torch.randn(8, 16),
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
        example_target=torch.randn(8, 16),
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=8, optimizer="sgd"),
        constraints=partc.Constraints(pp=1, dp=1, tp=2))
    assert program.plan.tensor_parallel is not None
    assert "blocks.4" in program.code()["stage_0.py"]


def test_gemma3_hands_each_layer_its_mask_by_index():
    """Gemma-3 picks each layer's mask and rotary table by the loop's index
    (``layer_types[i]``): five sliding-window layers and a global one, whose class and
    parameters are alike. A shorter model hands the last kept layer a sliding mask, so the
    copies would miss the global mask and table crossing into it (the plan predicted 4
    sends per microbatch under pp=2, the program made 7): the whole model is traced."""
    from tests.hf_families import _DECODER, Family

    family = Family("Gemma3TextConfig", "Gemma3ForCausalLM", "tokens",
                    dict(_DECODER, head_dim=16, sliding_window=8, num_hidden_layers=6))
    ids = torch.randint(1, 128, (2, 16))
    example = ((ids,), {})
    repeats = dedupe.find_repeats(family.build(), example)
    with pytest.raises(dedupe.Mismatch, match="model.layers.5"):
        dedupe.prove(family.build(), repeats, example)
    (_, full), (_, analysis) = traced_both_ways(family.build, ids, loss_fn=models.causal_lm_loss)
    assert_same_analysis(analysis, full)


# Every third position global, 14 blocks: no whole number of periods.
PERIODIC = ["local", "local", "global"] * 4 + ["local", "local"]


class Periodic(Stack):
    """Hands each block a value by its position in the loop, from a schedule of period
    three (as Gemma 3's model reads ``config.layer_types[i]``: five sliding-window layers
    to one global, 62 of them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        scales = {"local": h.new_ones(()), "global": h.new_full((), 2.0)}
        for index, block in enumerate(self.blocks):
            h = block(h) * scales[PERIODIC[index]]
        return self.head(h)


def test_a_stack_of_no_whole_number_of_periods_keeps_its_phase():
    """The kept tail starts at a whole period, as it does in the shorter model: block
    ``i`` of the shorter model gets ``PERIODIC[i]`` and runs what the block it stands
    for runs (a tail of the last three blocks would put a local block where the shorter
    model's loop multiplies: the whole model traced)."""
    build = lambda: Periodic([Mlp(8, 8) for _ in range(len(PERIODIC))], 8, 8)  # noqa: E731
    example = ((torch.randn(2, 8),), {})
    (repeat,) = dedupe.find_repeats(build(), example)
    assert repeat.kept == (0, 1, 2, 9, 10, 11, 12, 13)
    dedupe.prove(build(), (repeat,), example)
    (full_gm, full), (gm, analysis) = traced_both_ways(build, torch.randn(2, 8))
    assert len(meta.layers(gm)) == len(full.layers) - 6   # six blocks copied
    assert_same_analysis(analysis, full)


def test_the_first_block_takes_the_phase_that_repeats():
    """A block after the odd one out of each period reads its input from another call
    than one after a block like itself, so its segment differs: the first block (which
    reads the stack's input) is like the first of each later period, not the second."""
    kinds = [0, 0, 0, 1] * 4
    code = [("after", kinds[b - 1]) if b else ("input",) for b in range(16)]
    assert dedupe._refined(kinds, code) == [2, 0, 0, 1] * 4
    assert dedupe._representatives([2, 0, 0, 1] * 4) == (
        [0, 1, 2, 3, 12, 13, 14, 15], [0, 1, 2, 3] + [4, 1, 2, 3] * 2 + [4, 5, 6, 7])


def test_exaone4_three_sliding_window_layers_to_one_global_repeat():
    """Seen before: Exaone 4 (its global layers skip the rotary embedding) traced its
    whole model ("block model.layers.3 and the code around it run differently")."""
    from tests.hf_families import FAMILIES

    family = FAMILIES["exaone4"]
    family = dataclasses.replace(family, fields=dict(family.fields, num_hidden_layers=16))
    assert family.build().config.layer_types[:4] == ["sliding_attention"] * 3 + [
        "full_attention"]
    build = family.build
    ids = torch.randint(1, 128, (2, 16))
    example = ((ids,), {})
    (repeat,) = dedupe.find_repeats(build(), example)
    assert repeat.kept == (0, 1, 2, 3, 12, 13, 14, 15)
    dedupe.prove(build(), (repeat,), example)
    (_, full), (_, analysis) = traced_both_ways(build, ids, loss_fn=models.causal_lm_loss)
    assert_same_analysis(analysis, full)


def test_llama4_rotary_table_skips_the_layers_without_rotary_embeddings():
    """Seen before: Llama 4 (every fourth layer without rotary embeddings) traced its
    whole model. Each rotary layer's ``freqs_cis.to(...)`` returns the tensor it was
    given, so the trace hands the table from one rotary layer to the next, over the
    layer between: a value read two layers on, and the stack's last rotary layer hands
    it to none."""
    from tests.hf_families import FAMILIES

    family = FAMILIES["llama4"]
    family = dataclasses.replace(family, fields=dict(family.fields, num_hidden_layers=16))
    assert family.build().config.no_rope_layers[:4] == [1, 1, 1, 0]
    ids = torch.randint(1, 128, (2, 16))
    (full_gm, full), (gm, analysis) = traced_both_ways(family.build, ids,
                                                       loss_fn=models.causal_lm_loss)
    assert len(meta.layers(gm)) == len(full.layers) - 8   # blocks 4-11 copied
    assert_same_analysis(analysis, full)
    options = tensor_parallel_options(gm, [LINK], (False,), ("time",))
    assert_same_options(options, tensor_parallel_options(full_gm, [LINK], (False,), ("time",)))


def test_phimoe_router_graphs_named_by_their_count_still_repeat():
    """Seen before: PhiMoE traced its whole model ("submod_1 is used outside its
    block"), measuring each block apart. Its router runs part of itself without
    gradients, which export captures as a nested graph named by its count in the whole
    trace (``submod_1``, ``submod_3`` …): the blocks are told apart by what those graphs
    compute, not by their names."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                          num_experts_per_tok=2, vocab_size=128, use_cache=False)
    build = lambda: PhimoeForCausalLM(config)  # noqa: E731
    ids = torch.randint(1, 128, (2, 16))
    (_, full), (gm, analysis) = traced_both_ways(build, ids, loss_fn=models.causal_lm_loss)
    assert len(meta.layers(gm)) == len(full.layers) - 2
    assert len({layer.signature for layer in full.layers if ".layers." in layer.name}) == 1
    assert_same_analysis(analysis, full)


def test_mixed_precision_cuts_expand_in_the_dtypes_the_runtime_sends():
    """Seen before: under bf16 autocast on the meta device, the expanded first cuts
    counted the embedding's bf16 output at its traced float32 bytes (Llama-3-70B's
    first two cuts 1.8x the whole model's trace: a Falcon-40B plan 1% slower)."""
    def build():
        with torch.device("meta"):
            return models.llama(n_layer=5)

    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    _, full = analyze(build(), (ids,), loss_fn=models.causal_lm_loss, example_target=ids,
                      full_trace=True, autocast=torch.bfloat16)
    gm, analysis = analyze(build(), (ids,), loss_fn=models.causal_lm_loss,
                           example_target=ids, autocast=torch.bfloat16)
    assert len(meta.layers(gm)) < len(full.layers)
    assert analysis.cut_bytes[0] < full.cut_bytes[-2]   # bf16 in, float32 residual later
    assert_same_analysis(analysis, full)


def test_a_constant_each_block_makes_stays_in_its_block():
    """export lifts each block's constant (the 0 of ``y[:, 0] = 0``) and puts it before
    every op; inlined where it is first read, it lies in its block's layer, so the
    blocks repeat (they had been traced whole: each read a value made four layers
    before) and a pipeline does not send it."""
    build = lambda: models.SliceZero(width=16, depth=5, d_out=16)  # noqa: E731
    (full_gm, full), (gm, analysis) = traced_both_ways(build, torch.randn(4, 16))
    assert len(meta.layers(gm)) < len(full.layers)
    assert [count for count, _, _ in full.cut_tensors] == [1] * len(full.cut_tensors)
    assert_same_analysis(analysis, full)


def _gemma3():
    from tests.hf_families import _DECODER, Family

    return Family("Gemma3TextConfig", "Gemma3ForCausalLM", "tokens",
                  dict(_DECODER, head_dim=16, sliding_window=8, num_hidden_layers=6)).build()


@pytest.mark.parametrize("build, example", [
    (lambda: gpt.gpt_tiny(n_layer=4), torch.zeros(2, 8, dtype=torch.long)),
    (lambda: models.llama(n_layer=4, attention="sdpa"), torch.zeros(2, 8, dtype=torch.long)),
    (_gemma3, torch.zeros(2, 16, dtype=torch.long)),
    (lambda: Frozen([Mlp(8, 8) for _ in range(8)], 8, 8), torch.zeros(2, 8)),
    (lambda: Periodic([Mlp(8, 8) for _ in range(len(PERIODIC))], 8, 8), torch.zeros(2, 8)),
    (models.SkipAfterFifth, torch.zeros(2, 8)),
], ids=["samples.gpt", "hf-llama", "hf-gemma3", "frozen", "periodic", "skip-after-fifth"])
def test_a_model_on_meta_records_on_meta_tensors_what_fakes_record(build, example,
                                                                  monkeypatch):
    """A model all on the meta device is recorded on meta tensors (a third of the fake
    tensors' time on Llama-3-70B), and records exactly what fakes of it record: every
    segment's calls, the blocks' order, the parameters' owners."""
    from partc.passes.helpers import segments

    with torch.device("meta"):
        model = build()
    example = ((example.to("meta"),), {})
    containers = tuple(r.container for r in dedupe.find_repeats(model, None)) or ("blocks",)
    modes = []
    record = segments._record
    monkeypatch.setattr(segments, "_record",
                        lambda *args: modes.append(type(args[-2]).__name__) or record(*args))
    on_meta = segments.record(model, containers, *example)
    assert modes == ["nullcontext"]   # not on fakes: nothing failed on meta
    on_fakes = record(model, containers, *example, dict(model.named_parameters(
        remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False)),
        segments.FakeTensorMode(allow_non_fake_inputs=True), None)
    assert on_meta.entered == on_fakes.entered
    assert on_meta.params == on_fakes.params
    assert on_meta.calls == on_fakes.calls
    assert on_meta == on_fakes


class Scan(nn.Module):
    """A recurrent block run as a reference implementation runs it: a loop in Python over
    the sequence (dim 1), a few torch calls per step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.decay = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decay, state, out = torch.sigmoid(self.decay(x)), torch.zeros_like(x[:, 0]), []
        for step in range(x.shape[1]):
            state = decay[:, step] * state + x[:, step]
            out.append(state)
        return torch.stack(out, dim=1)


@pytest.mark.parametrize("last", [False, True])
def test_a_block_that_loops_over_the_sequence_is_named_as_soon_as_it_has_run(
        monkeypatch, caplog, last):
    """Recording the forward tells the caller of each block it enters, with the calls
    recorded so far; a block of more than LONG_BLOCK_CALLS calls (here 40: a 16-step
    scan) is named in the log once, when the next block is entered, or after the
    recording where it is the last; a stack of blocks under the limit is not."""
    monkeypatch.setattr(dedupe, "LONG_BLOCK_CALLS", 40)
    blocks = [Mlp(8, 8) for _ in range(4)] + [Scan(8)] if last else \
        [Scan(8) for _ in range(4)]
    model, seen = Stack(blocks, 8, 8), []
    with caplog.at_level(logging.WARNING, logger="partc"):
        dedupe.find_repeats(model, ((torch.randn(2, 16, 8),), {}),
                            lambda *told: seen.append(told))
    assert [(c, p, n) for c, p, n, _ in seen] == [("blocks", p, 5 if last else 4)
                                                 for p in range(5 if last else 4)]
    calls = [k for *_, k in seen]
    assert calls == sorted(calls) and calls[0] > 0
    warnings = [r.getMessage() for r in caplog.records if "torch calls" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"blocks.{4 if last else 0} runs ")
    assert "--seq-len" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="partc"):
        dedupe.find_repeats(Stack([Mlp(8, 8) for _ in range(5)], 8, 8),
                            ((torch.randn(2, 16, 8),), {}))
    assert "torch calls" not in caplog.text
