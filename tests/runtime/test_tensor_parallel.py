"""Tensor (and sequence) parallelism against one process, under torchrun with gloo.

Each case trains 3 SGD steps with partc's tp=2 program (2 processes) or pp=2 x tp=2
(4 processes) and on one process, on Hugging Face GPT-2, Llama (grouped-query
attention), BERT and the sample GPT, with sequence parallelism on and off; under
sequence parallelism with the collectives next to the linears run as rings (the
default) and blocking ("-blocking", ``TrainSpec.tp_overlap=False``); without sequence
parallelism, the fastest sharding planned for a link fast enough that norms on sequence
shards would be faster ("-fast-link": still all-reduces, norms whole). Checks:
losses and every rank's parameter shards within 1e-5 relative; parameters held per rank
equal the plan's count; the collectives run (all-reduces, all-gathers, reduce-scatters)
equal the plan's (per layer per microbatch, times microbatches, plus the partial-gradient
sum per step).
"""

from __future__ import annotations

import pytest

from .test_parity import (assert_trains_like_one_process, assert_vocab_parallel_loss,
                          launched, matrix)

MODELS = ["gpt", "gpt2", "llama", "bert"]
# "-recompute": one block fully recomputed, one selectively; its forward collectives run
# again in backward, as the plan charges.
RECOMPUTE_TWO = ["gpt-tp2-recompute", "gpt-tp2-sp-recompute", "llama-tp2-sp-recompute"]
RECOMPUTE_FOUR = ["gpt2-pp2-tp2-recompute"]
# "-dropout": dropout 0.1, against one process running the microbatches in order from
# the same random state: sharded dropouts keep their part of the whole tensor's mask.
DROPOUT_TWO = ["gpt-tp2-dropout", "gpt-tp2-sp-dropout", "gpt2-tp2-dropout",
               "gpt2-tp2-sp-dropout", "gpt2-tp2-dropout-recompute"]
# Sequence parallelism with blocking collectives, against the rings of the "-sp" cases:
# one case in the default profile, the others slow.
BLOCKING_TWO = ["gpt-tp2-sp-blocking"]
SLOW_BLOCKING = {2: ["llama-tp2-sp-blocking"],
                 4: ["gpt-pp2-tp2-sp-blocking", "llama-pp2-tp2-sp-blocking"]}
# "-vocab": 2048 classes, the loss a vocab-parallel cross entropy on the head's shards
# (recomputed in backward too: its all-reduces run again, as the plan counts).
VOCAB_TWO = ["gpt-tp2-sp-vocab", "gpt-tp2-sp-vocab-recompute", "llama-tp2-vocab"]
VOCAB_FOUR = ["gpt2-pp2-tp2-sp-vocab"]
# Sequence parallelism off on a link fast enough that the fastest pick would otherwise
# shard norms and residuals over the sequence: Megatron's plain tensor parallelism.
PLAIN_TWO = ["llama-tp2-fast-link"]
TWO = ([f"{m}-tp2{s}" for m in MODELS for s in ("", "-sp")] + RECOMPUTE_TWO + DROPOUT_TWO
       + BLOCKING_TWO + VOCAB_TWO + PLAIN_TWO)
FOUR = [f"{m}-pp2-tp2{s}" for m in MODELS for s in ("", "-sp")] + RECOMPUTE_FOUR + VOCAB_FOUR
# The default profile's cases, all on 2 processes: plain tp (all-reduces, on a fast link)
# and sequence parallelism on each model family's own path (GPT-2's Conv1D, Llama's
# grouped-query attention, BERT's last block), recompute with rings, blocking
# collectives, the vocab-parallel loss; the rest -m slow (pp x tp runs by default in
# test_schedules' DualPipeV case, sharded dropout masks in test_lean_activations).
DEFAULT = {"gpt2-tp2-sp", "llama-tp2-fast-link", "bert-tp2-sp", "llama-tp2-sp-recompute",
           "gpt-tp2-sp-blocking", "gpt-tp2-sp-vocab-recompute"}


def cases(names: list[str]) -> list:
    return matrix(names, DEFAULT & set(names))


tp_two = launched("tp_two", 2, TWO)
tp_four = launched("tp_four", 4, FOUR)
blocking_two = launched("blocking_two", 2, SLOW_BLOCKING[2])
blocking_four = launched("blocking_four", 4, SLOW_BLOCKING[4])


def _check(ranks: list[dict], name: str, tp: int, pp: int) -> None:
    for rank, results in enumerate(ranks):
        result = results[name]
        assert_trains_like_one_process(rank, result)
        assert result["mesh"] == {"pp": pp, "dp": 1, "tp": tp}
        assert result["own_params"] == result["planned_params"]
        # full_state_dict: the whole model from every stage and shard, as one process has it.
        assert result["full_state_keys"] == []
        assert result["full_state_error"] < 1e-5
        assert result["reloaded_unchanged"]
        assert result["collectives"] == result["planned_collectives"], (rank, result)


@pytest.mark.parametrize("name", cases(TWO))
def test_tp2_matches_one_process(tp_two, name):
    _check(tp_two, name, tp=2, pp=1)


@pytest.mark.parametrize("name", cases(FOUR))
def test_pp2_tp2_matches_one_process(tp_four, name):
    _check(tp_four, name, tp=2, pp=2)


@pytest.mark.parametrize("name", cases(VOCAB_TWO + VOCAB_FOUR))
def test_the_loss_reads_the_heads_shards_by_class_with_two_all_reduces(tp_two, tp_four,
                                                                       name):
    ranks = tp_two if name in VOCAB_TWO else tp_four
    for results in ranks:
        assert_vocab_parallel_loss(results[name])
        layers = results[name]["layer_collectives"]
        # The head gathers its input's sequence shards under sequence parallelism only.
        gathers = [phase for kind, phase in layers["lm_head"] if kind == "all_gather"]
        assert gathers.count("forward") == (1 if "-sp" in name else 0), layers["lm_head"]


@pytest.mark.parametrize("name", cases([f"{m}-tp2" for m in MODELS] + PLAIN_TWO))
def test_all_reduces_equal_the_plan_without_sequence_parallelism(tp_two, name):
    # Megatron's count: two all-reduces forward and two backward per block, plus one
    # all-reduce of partial gradients (row-parallel biases) per step. BERT's pooler gets
    # none backward: the loss reads only the last hidden state.
    for results in tp_two:
        result = results[name]
        assert result["collectives"].get("all_reduce", 0) == \
            result["planned_collectives"].get("all_reduce", 0)
        blocks = _blocks(result)
        assert blocks
        for layer in blocks:
            moves = sorted(map(tuple, result["layer_collectives"][layer]))
            assert moves == [("all_reduce", "backward")] * 2 + [("all_reduce", "forward")] * 2


def _blocks(result: dict) -> list[str]:
    return [layer for layer in result["layer_collectives"]
            if ".h." in layer or ".layers." in layer or ".layer." in layer
            or layer.startswith("blocks.")]


@pytest.mark.parametrize("name", cases([f"{m}-tp2-sp" for m in MODELS]))
def test_sequence_parallel_blocks_use_gathers_and_reduce_scatters(tp_two, name):
    # Megatron-SP per block: before each of attention and MLP an all-gather of the
    # sequence shards (reduce-scatter backward), after each a reduce-scatter (all-gather
    # backward). HF GPT-2 flattens [batch, seq, hidden] to [batch*seq, hidden] for its
    # Conv1D: a sequence shard is not a contiguous block of that, so the gather happens
    # before the flatten and the gradient comes back by all-reduce, not reduce-scatter.
    # A linear reading the gathered input, and GPT-2's Conv1D reading a flattened view
    # of it, keep the shard and gather it again in backward (one more backward
    # all-gather each for attention and MLP, as Megatron does).
    megatron = sorted([("all_gather", "forward"), ("reduce_scatter", "backward"),
                       ("reduce_scatter", "forward"), ("all_gather", "backward")] * 2
                      + [("all_gather", "backward")] * 2)
    for results in tp_two:
        result = results[name]
        assert result["collectives"] == result["planned_collectives"]
        blocks = _blocks(result)
        assert blocks
        for layer in blocks:
            moves = sorted(map(tuple, result["layer_collectives"][layer]))
            if name.startswith("gpt2"):
                moves = [("reduce_scatter", "backward") if m == ("all_reduce", "backward")
                         else m for m in moves]
                moves.sort()
            if layer == blocks[-1] and name.startswith("bert"):
                # BERT's last block ends the model: its output is gathered whole.
                moves.remove(("all_gather", "forward"))
            assert moves == megatron, (layer, moves)


@pytest.mark.parametrize("name", cases(["gpt-tp2-sp", "llama-tp2-sp", "gpt-tp2-sp-recompute",
                                        "llama-tp2-sp-recompute"] + BLOCKING_TWO))
def test_sequence_parallel_linears_run_their_collectives_as_rings(tp_two, name):
    # Per block, the gathers before attention and MLP and the reduce-scatters after them
    # run as rings (one exchange per step, tp - 1 steps): forward the gathered linears'
    # ring and the row-parallel linear's, backward the regather and input gradient's
    # rings advancing together and the output gradient's. Blocking: none.
    for results in tp_two:
        result = results[name]
        if name.endswith("-blocking"):
            assert result["ring_steps"] == 0
            continue
        blocks = _blocks(result)
        per_microbatch = 2 * (1 + 1 + 2 + 1)   # attention and MLP, tp - 1 = 1 step each
        assert result["ring_steps"] >= per_microbatch * len(blocks) * 4 * 2, result


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_BLOCKING[2])
def test_tp2_blocking_matches_one_process(blocking_two, name):
    _check(blocking_two, name, tp=2, pp=1)
    assert all(results[name]["ring_steps"] == 0 for results in blocking_two)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_BLOCKING[4])
def test_pp2_tp2_blocking_matches_one_process(blocking_four, name):
    _check(blocking_four, name, tp=2, pp=2)
    assert all(results[name]["ring_steps"] == 0 for results in blocking_four)
