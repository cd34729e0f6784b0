"""Mixed precision (``TrainSpec(dtype=torch.bfloat16)``) against fp32 in one process.

bf16 compute with fp32 master weights and fp32 gradient reduction: under ZeRO 0/1 the
stage computes with bf16 copies of its fp32 parameters (the master), cast once per step,
and accumulates and reduces gradients in fp32 buckets; under ZeRO-2/3 FSDP gathers bf16
copies of the fp32 shards and reduce-scatters gradients in fp32. The
reference trains the same model in fp32, so the tolerances are bf16's, not 1e-5: losses
within 1e-3 relative, gradient norms within 1e-3, parameters within 2e-2 after 3 SGD
steps (seen: losses 3e-5, parameters 1e-3 to 9e-3, norms 6e-4). The parameters must
differ from fp32 training by more than fp32 rounding (1e-5), which shows that the
compute ran in bf16, and must themselves stay fp32 (under ZeRO-1 the module's weights
are bf16 and the fp32 masters each rank's dp shard: the masters are compared).
"""

from __future__ import annotations

import pytest

from tests import tolerances

from .test_parity import assert_vocab_parallel_loss, launched, matrix

TWO = ["gpt-dp2-bf16", "gpt2-dp2-zero1-bf16", "gpt-dp2-zero3-bf16", "llama-pp2-bf16",
       "llama-tp2-sp-vocab-bf16"]
FOUR = ["llama-pp2-dp2-zero2-bf16", "llama-dp2-tp2-sp-zero1-vocab-bf16"]
LOSS_RTOL, PARAM_RTOL = tolerances.BF16, 2e-2

bf16_two = launched("bf16_two", 2, TWO)
bf16_four = launched("bf16_four", 4, FOUR)
# ZeRO-2 accumulating whole fp32 gradients (FSDP upcasts each microbatch's bf16 gradient)
# and reduce-scattering them once per step, under GPipe.
SLOW_FOUR = ["llama-pp2-dp2-zero2-step-bf16"]
bf16_slow_four = launched("bf16_slow_four", 4, SLOW_FOUR)


def _check(ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(ranks):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
        for ours, ref in zip(result["losses"], result["ref_losses"]):
            assert ours == pytest.approx(ref, rel=LOSS_RTOL)
        for ours, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
            assert ours == pytest.approx(ref, rel=LOSS_RTOL)
        worst = max(result["param_errors"].values())
        assert 1e-5 < worst < PARAM_RTOL, f"rank {rank}: parameter error {worst}"
        assert result["param_dtypes"] == ["torch.float32"]
        # ZeRO-1 is Megatron's distributed optimizer: bf16 weights, fp32 master shards.
        held = ["torch.bfloat16"] if result["zero_stage"] == 1 else ["torch.float32"]
        assert result["compute_param_dtypes"] == held


# The default profile's cases, all on 2 processes: ZeRO-1's fp32 master shards, ZeRO-3,
# pp, and tp with sequence parallelism and the vocab-parallel loss; the rest (the
# 4-process launch among them) -m slow.
DEFAULT = {"gpt2-dp2-zero1-bf16", "gpt-dp2-zero3-bf16", "llama-pp2-bf16",
           "llama-tp2-sp-vocab-bf16"}


def _check_bf16(ranks: list[dict], name: str) -> None:
    _check(ranks, name)
    if "vocab" in name:
        for results in ranks:
            assert_vocab_parallel_loss(results[name])


@pytest.mark.parametrize("name", matrix(TWO, DEFAULT & set(TWO)))
def test_bf16_trains_like_fp32(bf16_two, name):
    _check_bf16(bf16_two, name)


@pytest.mark.parametrize("name", matrix(FOUR, DEFAULT & set(FOUR)))
def test_bf16_on_four_processes_trains_like_fp32(bf16_four, name):
    _check_bf16(bf16_four, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_FOUR)
def test_bf16_zero2_once_per_step_trains_like_fp32(bf16_slow_four, name):
    _check(bf16_slow_four, name)
    assert all(results[name]["reduces_once"] for results in bf16_slow_four)
