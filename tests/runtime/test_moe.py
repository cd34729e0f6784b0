"""Expert parallelism trains like one process (fp32, 1e-5): the sample's Switch-style
layers and Hugging Face mixture-of-experts families, with ep folded over dp and tp, with
pp, dropless and with a capacity factor, under ZeRO-0 to 3; the all-to-alls posted per
step are those the plan's ep and expert layers give. Experts held as a module list train
at ep=1, which the planner keeps for them. The default profile runs one torchrun launch
of 4 processes and one of 2; the
rest of the matrix is ``-m slow`` (``benchmarks/moe_parity.py`` prints it as a table).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_parity import launch as launch_worker
from .test_parity import launched

WORKER = Path(__file__).with_name("moe_worker.py")
RTOL = 1e-5
# ZeRO with expert parallelism: experts sharded over their expert-data-parallel group
# (2 ranks in dp4-ep2), clipped by the global gradient norm.
DEFAULT = ["moe-pp2-dp2-ep2", "moe-dp2-tp2-ep2-clip", "moe-dp4-ep2-zero3"]
SLOW_FOUR = ["moe-dp4-ep4", "moe-dp2-tp2-ep2", "moe-dp4-ep2", "qwen2-moe-dp4-ep4", "qwen3-moe-pp2-dp2-ep2", "mixtral-dp2-tp2-ep2",
             "mixtral-dp2-tp2-ep4-capacity", "moe-dp4-ep2-zero1", "mixtral-dp4-ep2-zero1",
             "moe-dp2-tp2-ep2-zero1", "moe-dp2-tp2-ep2-zero3", "moe-pp2-dp2-ep2-zero2",
             "moe-dp4-ep2-zero2-step"]
SLOW_TWO = ["moe-dp2-ep2", "moe-tp2-ep2", "moe-dp2-ep2-capacity", "mixtral-dp2-ep2", "mixtral-tp2-ep2",
            "deepseek-v3-dp2-ep2", "qwen2-moe-aux-dp2-ep2", "moe-dp2-ep2-zero1",
            "moe-dp2-ep2-zero2", "moe-dp2-ep2-zero3", "qwen3-moe-dp2-ep2-zero3",
            "moe-dp2-ep2-recompute", "moe-dp2-ep2-zero3-recompute"]
# The router's loss over the whole batch, declared per microbatch (TrainSpec.
# loss_per_microbatch): against one process computing the same parts' losses.
AUX = ["mixtral-aux-dp2-ep2"]
# Experts in a module list: not split (ep=1), the MoE layers replicated over dp.
MODULE_LIST = ["list-moe-dp2"]


def launch(nproc: int, cases: list[str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    return launch_worker(nproc, cases, out, worker=WORKER)


def check(ranks: list[dict], name: str, split: bool = True) -> None:
    """Losses, parameters and gradient norms as one process; with ``split`` the experts
    are split over ranks (or the stage holds none), else ep=1 and none are."""
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "error" not in seen, f"rank {rank}: {seen.get('traceback')}"
        for step, (loss, ref) in enumerate(zip(seen["losses"], seen["ref_losses"])):
            assert abs(loss - ref) <= RTOL * abs(ref), f"rank {rank} step {step}: {loss} vs {ref}"
        worst = max(seen["param_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= RTOL, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e}"
        if split:
            assert seen["expert_layers"] > 0 or seen["mesh"]["pp"] > 1
        else:
            assert seen["mesh"]["ep"] == 1 and seen["expert_layers"] == 0
        for norm, ref in zip(seen["grad_norms"], seen["ref_grad_norms"]):
            assert abs(norm - ref) <= RTOL * abs(ref), f"rank {rank}: grad norm {norm} vs {ref}"
        # After the first step (which also runs the schedule's shape inference).
        # The plan's all-to-alls, counted at run time (step 1 also runs the schedule's
        # shape inference).
        assert all(m == seen["expected_messages"] for m in seen["messages"][1:]), seen["messages"]
        assert all(m == seen["expected_exchanges"] for m in seen["exchanges"][1:])


default_four = launched("default_four", 4, DEFAULT, worker="moe_worker")


@pytest.mark.parametrize("name", DEFAULT)
def test_expert_parallel_trains_like_one_process(default_four, name):
    check(default_four, name)


default_two = launched("default_two", 2, AUX + MODULE_LIST, worker="moe_worker")


def test_router_loss_over_the_batch_trains_per_microbatch_like_one_process(default_two):
    for name in AUX:
        check(default_two, name)


@pytest.mark.parametrize("name", MODULE_LIST)
def test_module_list_experts_train_at_ep_1_like_one_process(default_two, name):
    check(default_two, name, split=False)


@pytest.mark.slow
def test_expert_parallel_matrix(tmp_path):
    four = launch(4, SLOW_FOUR, tmp_path / "four")
    two = launch(2, SLOW_TWO, tmp_path / "two")
    for name in SLOW_FOUR:
        check(four, name)
    for name in SLOW_TWO:
        check(two, name)
    # The capacity cases drop slots (and still match one process with the same rule).
    assert sum(r["moe-dp2-ep2-capacity"]["dropped"] for r in two) > 0
    assert sum(r["mixtral-dp2-tp2-ep4-capacity"]["dropped"] for r in four) > 0
