"""The emitted program trains exactly like one process: losses and parameters after
several SGD steps, for real models, under torchrun with gloo on CPU.

A session runs one torchrun of 2 processes and one of 4 for every module's cases
(:func:`launched`, :func:`pooled`); every case runs on every rank (``worker.py``, which
hands another worker's cases to it) and each rank reports what it saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import filelock
import pytest

from .worker import CASES, STEPS

WORKER = Path(__file__).with_name("worker.py")
# Context parallelism: the attention itself (ring and all-to-all against plain attention),
# then training, each family under both kinds; four processes put cp=2 beside pp=2,
# tp=2 and dp=2 with ZeRO-3.
CP_FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]
CP_TWO = [f"hf-{family}-cp2-{kind}" for family in CP_FAMILIES
          for kind in ("ring", "a2a")] + ["hf-llama-cp2-ring-recompute",
                                          "hf-llama-cp2-ring-zero3",
                                          "hf-llama-own-loss-cp2-ring",
                                          "hf-llama-own-loss-cp2-a2a",
                                          "hf-llama-own-loss-unpadded-cp2-ring",
                                          "hf-llama-own-loss-padded-cp2-ring",
                                          "hf-llama-masked-cp2-ring"]
# (All-to-all beside tp=2 only for GPT-2: the others' 2 key/value heads leave one per tp
# rank, which the planner will not split over cp.)
CP_FOUR = [f"hf-{family}-cp2-{kind}-{mesh}" for family in CP_FAMILIES
           for kind in ("ring", "a2a") for mesh in ("pp2", "tp2", "dp2-zero3")
           if (kind, mesh) != ("a2a", "tp2") or family == "gpt2"] + [
    "hf-llama-own-loss-cp2-ring-pp2", "hf-llama-own-loss-cp2-ring-dp2-zero3"]
# (The own loss on rows padded at their end, the attention_mask left out: also the own
# loss without a mask, or with one of ones.)
DEFAULT_CP_TWO = ["hf-llama-cp2-ring-zero3", "hf-qwen2-cp2-a2a",
                  "hf-llama-own-loss-padded-cp2-ring", "hf-llama-masked-cp2-ring"]
# The cases test_two/four_processes_match_one check alone.
PLAIN_TWO = ["gpt-pp2-1f1b", "gpt-pp2-gpipe-recompute", "gpt2-pp2-1f1b-recompute",
             "gpt2-pp2-gpipe", "llama-pp2-gpipe-recompute", "llama-pp2-1f1b",
             "llama-pp2-1f1b-loaded", "skip-pp2-1f1b", "handoff-pp2", "gpt-dp2", "bert-dp2",
             "gpt-pp2-fp8", "gpt-dp2-fp8", "gpt-dp2-zero3-fp8", "hf-llama-masked-dp2",
             "hf-llama-masked-pp2", "hf-llama-masked-tp2"]
PLAIN_FOUR = ["gpt-pp4-1f1b-recompute", "gpt-pp4-gpipe", "gpt2-pp4-gpipe-recompute",
              "llama-pp4-1f1b", "skip-pp4-gpipe", "gpt-pp2-dp2"]
# Activation offload under pp=2, dp=2 with ZeRO-1 and ZeRO-3, tp=2 (and pp=2 x tp=2).
OFFLOAD_TWO = ["llama-pp2-1f1b-offload", "gpt-dp2-zero1-act-offload",
               "gpt-dp2-zero3-act-offload", "gpt-tp2-act-offload"]
OFFLOAD_FOUR = ["llama-pp2-tp2-offload"]
TWO = [*PLAIN_TWO, *CP_TWO, "cp-attention", "mismatch", "gpt-pp2-loss-alone", *OFFLOAD_TWO]
FOUR = [*PLAIN_FOUR, *CP_FOUR, *OFFLOAD_FOUR]
# The default profile's cases: each schedule, recompute, the three Hugging Face models,
# loaded weights, skips across stages, a hand-off layer, FP8 linears, dp and pp x dp, a
# loss_fn over targets with -100s weighed by their counts; the rest -m slow.
DEFAULT_TWO = ["gpt2-pp2-1f1b-recompute", "llama-pp2-1f1b-loaded", "skip-pp2-1f1b",
               "handoff-pp2", "bert-dp2", "gpt-pp2-fp8", "hf-llama-masked-dp2"]
DEFAULT_FOUR = ["gpt-pp4-gpipe", "gpt-pp2-dp2"]
# Optimizer offload under each mesh (2 processes); the default profile runs ZeRO-1's.
OFFLOAD = ["gpt-pp2-offload", "gpt-dp2-offload", "gpt-dp2-zero1-offload",
           "gpt-dp2-zero2-offload", "gpt-dp2-zero3-offload-params", "gpt-tp2-offload"]
DEFAULT_OFFLOAD = ["gpt-dp2-zero1-offload"]
RTOL = 1e-5


def launch(nproc: int, cases: list[str], out: Path, *, worker: Path = WORKER,
           env: dict[str, str] | None = None, timeout: int = 900) -> list[dict]:
    """Run ``worker`` (a script writing ``<out>/rank<k>.json``) under torchrun with the
    cases named; return each rank's results (rank order). ``env``: extra variables."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(worker), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "120", **(env or {})}
    if "PARTC_TEST_LAUNCH_CACHE" in os.environ and "PARTC_CACHE_DIR" not in env:
        env["PARTC_CACHE_DIR"] = os.environ["PARTC_TEST_LAUNCH_CACHE"]  # tests/conftest.py
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    files = [out / f"rank{r}.json" for r in range(nproc)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        # A crash at process exit (seen once under gloo) must read as a crash, not a flake.
        pytest.fail(f"torchrun exited with {done.returncode}; stderr tail:\n"
                    f"{done.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


# Every launch declared with :func:`launched`: (its module, fixture name) -> (processes,
# cases). The launches of one process count share one torchrun (:func:`pooled`).
LAUNCHES: dict[tuple[str, str], tuple[int, list[str]]] = {}


def launched(name: str, nproc: int, cases: list[str], worker: str | None = None):
    """A module-scoped fixture ``name``: the per-rank results of the ``cases`` that this
    session's selected tests read (:func:`wanted`), each rank's results holding those
    cases only. ``worker``: the module of ``tests/runtime`` whose ``run_case`` runs them
    (``worker.py``'s own by default; ``worker.py`` hands ``<worker>::<case>`` over).
    Every such launch of ``nproc`` processes in the session runs in one torchrun
    (:func:`pooled`): a launch's fixed cost (torchrun, and each rank importing torch,
    partc and transformers: about 70% of a two-case launch) is paid once."""
    module = sys._getframe(1).f_globals["__name__"]
    LAUNCHES[module, name] = (nproc, [pooled_name(case, worker) for case in cases])

    @pytest.fixture(scope="module", name=name)
    def fixture(request, tmp_path_factory) -> list[dict]:
        mine = wanted(request, cases)
        ranks = pooled(nproc, pool(request.session, nproc), tmp_path_factory)
        return [{case: results[pooled_name(case, worker)] for case in mine}
                for results in ranks]
    return fixture


def pooled_name(case: str, worker: str | None) -> str:
    """The name worker.py runs ``case`` of ``worker`` under."""
    return f"{worker}::{case}" if worker else case


def _launched_cases() -> set[str]:
    """The case names of every launch declared with :func:`launched`."""
    return {case.rpartition("::")[2] for _, cases in LAUNCHES.values() for case in cases}


def pool(session: pytest.Session, nproc: int) -> list[str]:
    """The cases of every :func:`launched` launch of ``nproc`` processes that the
    session's selected tests read, in declaration order. Every xdist worker collects the
    same items, so each computes the same pool."""
    cases: dict[str, None] = {}
    for (module, name), (n, declared) in LAUNCHES.items():
        if n == nproc:
            bare = [case.rpartition("::")[2] for case in declared]
            read = set(_wanted(session, module, name, bare))
            cases.update(dict.fromkeys(c for c, b in zip(declared, bare) if b in read))
    return list(cases)


# A pooled launch may hold compiled cases (tests/runtime/test_compiled.py): inductor
# compiles in the rank itself (a pool of compile processes costs more than it saves on
# two cores), and a stage's first step compiles while its peers wait, longer than the
# watchdog's default minute on a loaded machine (partc.runtime.compiled).
POOL_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "PARTC_WATCHDOG_S": "600"}


def pooled(nproc: int, cases: list[str], tmp_path_factory) -> list[dict]:
    """One torchrun of ``cases`` per session, shared by the xdist workers: the first to
    ask runs it under a file lock and keeps each rank's results; the others read them
    (or the failure, reported again)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's
    digest = hashlib.sha256("\n".join(cases).encode()).hexdigest()[:12]
    out = root / f"launch-pool{nproc}-{digest}"
    results, failed = out / "results.json", out / "failed.txt"
    with filelock.FileLock(f"{out}.lock"):
        if failed.exists():
            pytest.fail(failed.read_text())
        if not results.exists():
            try:
                ranks = launch(nproc, cases, out, env=POOL_ENV,
                               timeout=max(900, 120 * len(cases)))
            except pytest.fail.Exception as error:
                out.mkdir(parents=True, exist_ok=True)
                failed.write_text(str(error))
                raise
            results.write_text(json.dumps(ranks))
            return ranks
    return json.loads(results.read_text())


def wanted(request: pytest.FixtureRequest, cases: list[str]) -> list[str]:
    """The ``cases`` that the selected tests of the requesting module read through this
    fixture (:func:`_wanted`)."""
    return _wanted(request.session, request.module.__name__, request.fixturename, cases)


def _wanted(session: pytest.Session, module: str, fixture: str,
            cases: list[str]) -> list[str]:
    """The ``cases`` that the selected tests of ``module`` read through ``fixture``: a
    test parametrized by case names reads those (none of ``fixture``'s, where they are
    another launch's), a test marked ``@pytest.mark.reads(case, ...)`` the cases it
    names, any other test reads them all.
    So a case whose tests are all deselected (``slow`` ones in the default profile, see
    :func:`matrix`) is not run; none when no selected test uses the fixture."""
    names: set[str] = set()
    used = False
    for item in session.items:
        if (getattr(getattr(item, "module", None), "__name__", None) != module
                or fixture not in item.fixturenames):
            continue
        used = True
        params = getattr(item, "callspec", None)
        named = {v for v in (params.params.values() if params else ())
                 if isinstance(v, str) and v in _launched_cases()}
        marker = item.get_closest_marker("reads")
        named |= set(marker.args) if marker else set()
        if not named:   # a test that names no case reads them all
            return list(cases)
        names |= named & set(cases)   # (a test of another launch's case reads none here)
    return [case for case in cases if case in names] if used else []


def matrix(cases: list[str], default: list[str] | set[str]) -> list:
    """``cases`` as parameters, those not in ``default`` marked ``slow``: the default
    profile keeps one case per feature, ``-m slow`` runs the rest."""
    unknown = set(default) - set(cases)
    assert not unknown, f"default cases not in the matrix: {sorted(unknown)}"
    return [pytest.param(case, id=case,
                         marks=() if case in default else pytest.mark.slow)
            for case in cases]


def assert_vocab_parallel_loss(result: dict) -> None:
    """The case's loss ran Megatron's vocab-parallel cross entropy on the head's class
    shards: its layer's collectives are the two forward all-reduces (maxima; sums of
    exponentials and target logits), no gather of the logits."""
    loss = result["layer_collectives"]["loss"]
    assert loss == [["all_reduce", "forward"]] * 2, loss


def assert_trains_like_one_process(rank: int, result: dict) -> None:
    """The case ran, and its losses and parameters match one process within RTOL."""
    assert "error" not in result, f"rank {rank}: {result.get('traceback', result.get('error'))}"
    for ours, ref in zip(result["losses"], result["ref_losses"]):
        assert ours == pytest.approx(ref, rel=RTOL)
    worst = max(result["param_errors"].values(), default=0.0)  # a stage may hold none
    assert worst < RTOL, f"rank {rank}: parameter error {worst}"


two = launched("two", 2, TWO + OFFLOAD)
four = launched("four", 4, FOUR)


def check_parity(ranks: list[dict], name: str, *, messages: bool = True) -> None:
    stages = set()
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "error" not in seen, f"rank {rank}: {seen.get('traceback', seen['error'])}"
        assert len(seen["losses"]) == STEPS
        for step, (loss, ref) in enumerate(zip(seen["losses"], seen["ref_losses"])):
            assert abs(loss - ref) <= RTOL * abs(ref), f"rank {rank} step {step}: {loss} vs {ref}"
        worst = max(seen["param_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= RTOL, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e} (relative)"
        # The plan's count of point-to-point messages is what the runtime posted.
        for step, posted in enumerate(seen["messages"] if messages else ()):
            assert posted == {"sends": seen["predicted"]["sends"],
                              "recvs": seen["predicted"]["recvs"]}, (rank, step)
        stages.add(seen["stage"])
    constraints = CASES[name].constraints
    assert stages == set(range(constraints["pp"]))
    assert ranks[0][name]["mesh"]["pp"] == constraints["pp"]
    if "schedule" in constraints:
        assert ranks[0][name]["schedule"] == constraints["schedule"]


@pytest.mark.parametrize("name", matrix(PLAIN_TWO, DEFAULT_TWO))
def test_two_processes_match_one(two, name):
    check_parity(two, name)


@pytest.mark.parametrize("name", matrix(PLAIN_FOUR, DEFAULT_FOUR))
def test_four_processes_match_one(four, name):
    check_parity(four, name)


@pytest.mark.parametrize("name", matrix(CP_TWO, DEFAULT_CP_TWO))
def test_context_parallel_trains_like_one_process(two, name):
    check_parity(two, name)
    assert two[0][name]["mesh"]["cp"] == 2
    if name.endswith("zero3"):   # one dp replica: ZeRO-3 shards over the cp pair
        assert two[0][name]["mesh"]["dp"] == 1 and two[0][name]["zero_stage"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", CP_FOUR)
def test_context_parallel_composes_with_pp_tp_and_zero3(four, name):
    check_parity(four, name)
    assert four[0][name]["mesh"]["cp"] == 2


@pytest.mark.reads("cp-attention")
def test_context_parallel_attention_is_plain_attention(two):
    # Every mask (a window shorter than a chunk, one longer than a rank's shard), both
    # kinds, output and gradients, in float64.
    for rank, results in enumerate(two):
        errors = results["cp-attention"]
        assert "error" not in errors, errors.get("traceback")
        assert len(errors) == 8 and max(errors.values()) < 1e-12, (rank, errors)


# What the estimate measures a layer's ops saving (on fakes) and what the runtime's hooks
# copy differ by the odd small storage (a mask: 1% of a tiny Llama layer's bytes).
OFFLOAD_SLACK = 0.02


def check_offload(ranks: list[dict], name: str) -> None:
    """The case trains like one process, and each rank moved to the host and back, and
    held there at most, what the plan says for its stage (after the first step, which
    also infers shapes), leaving nothing there."""
    check_parity(ranks, name)
    for rank, results in enumerate(ranks):
        seen = results[name]
        traffic, host = seen["planned_offload"]
        for step, (out, back, left, peak) in enumerate(seen["offloaded"][1:], 1):
            where = f"rank {rank} step {step}"
            assert out == back and left == 0, (where, out, back, left)
            assert out == pytest.approx(traffic, rel=OFFLOAD_SLACK), (where, out, traffic)
            assert peak == pytest.approx(host, rel=OFFLOAD_SLACK), (where, peak, host)
    assert any(results[name]["planned_offload"][0] for results in ranks)


@pytest.mark.parametrize("name", matrix(OFFLOAD_TWO, ["llama-pp2-1f1b-offload"]))
def test_offloaded_activations_train_like_one_process(two, name):
    check_offload(two, name)


@pytest.mark.slow
@pytest.mark.reads(*OFFLOAD_FOUR)
def test_offloaded_activations_under_pp_and_tp_train_like_one_process(four):
    check_offload(four, OFFLOAD_FOUR[0])


@pytest.mark.reads("gpt-pp4-gpipe")
def test_every_rank_parameter_is_held_once_per_stage(four):
    """Across the 4 stages of GPT (4 blocks) every parameter is somewhere; only the tied
    embedding/head weight is on two stages."""
    held: dict[str, int] = {}
    for results in four:
        for fqn in results["gpt-pp4-gpipe"]["param_errors"]:
            held[fqn] = held.get(fqn, 0) + 1
    assert held.pop("tok_emb.weight") == 2
    assert set(held.values()) == {1}
    assert len(held) == 4 * 12 + 3  # 12 tensors per block; pos_emb and ln_f's two


@pytest.mark.reads("mismatch")
def test_ranks_with_different_plans_refuse_to_run(two):
    for rank, results in enumerate(two):
        message = results["mismatch"]["different-plans"]
        assert message.startswith("ranks disagree on the plan"), (rank, message)


@pytest.mark.reads("mismatch")
def test_batches_of_other_shapes_are_refused_then_training_goes_on(two):
    for results in two:
        seen = results["mismatch"]
        assert "idx has shape (8, 8), the plan's is (8, 16)" in seen["shorter-sequence"]
        assert "idx has shape (4, 16), the plan's is (8, 16)" in seen["smaller-batch"]
        assert seen["loss-after"] > 0


@pytest.mark.reads("gpt-pp2-loss-alone")
def test_a_stage_without_parameters_trains(two):
    # The loss alone on the last stage: that rank holds no parameter, and the README's
    # loop (module.optimizer, forward_backward, step, zero_grad) still trains.
    results = two
    for rank, result in enumerate(results):
        assert_trains_like_one_process(rank, result["gpt-pp2-loss-alone"])
    last = results[1]["gpt-pp2-loss-alone"]
    assert last["stage"] == 1 and last["own_params"] == 0 and last["planned_params"] == 0
    assert len(results[0]["gpt-pp2-loss-alone"]["param_errors"]) > 0


@pytest.mark.parametrize("name", matrix(OFFLOAD, DEFAULT_OFFLOAD))
def test_offloaded_optimizer_trains_as_one_process(two, name):
    """The optimizer's state, masters and step on the host tier: the same losses and
    parameters as one process, every step on the host (the exact bytes against the plan:
    tests/runtime/test_offload.py)."""
    check_parity(two, name)
    for rank, results in enumerate(two):
        seen = results[name]
        assert "optimizer" in seen["offload"], rank
        # Parameter offload: FSDP2's own copies, torch's optimizer over its host shards.
        assert seen["host"]["steps"] == (0 if "params" in seen["offload"] else STEPS), rank
        assert seen["host"]["host_resident"] > 0 and seen["planned_host_bytes_per_node"] > 0
