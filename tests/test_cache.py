"""The plan cache: measured models and plans reused by content, in memory and on disk."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import partc
from partc.device.budget import preset
from partc.cache import problem_key
from partc.identity import model_hash
from samples.gpt import gpt_tiny, loss_fn
from tests.random_models import BlockSpec, ModelSpec, build

ROOT = Path(__file__).resolve().parents[1]


def _compile(model, cache, memory="64MiB", batch=8, dtype=torch.float32, num_devices=2,
             **budget):
    ids = torch.zeros(batch, 16, dtype=torch.long)
    return partc.compile(model, (ids,), budget=partc.DeviceBudget(
        num_devices=num_devices, memory=memory, **{"device": "CPU", **budget}), train=partc.TrainSpec(
        # As written on every device (a GPU's default fuses the attention: another graph).
        global_batch_size=batch, dtype=dtype, attention="as_written"), loss_fn=loss_fn,
        example_target=ids,
        cache=cache)


def test_same_problem_returns_the_stored_plan_and_a_new_budget_skips_tracing():
    cache = partc.PlanCache()
    first = _compile(gpt_tiny(n_layer=3), cache)
    assert first.graph is not None and cache.hits == {"analysis": 0, "plan": 0}
    # Another instance of the same architecture: same graph signature, same problem.
    again = _compile(gpt_tiny(n_layer=3), cache)
    assert cache.hits == {"analysis": 1, "plan": 1}
    assert again.graph is None and again.plan == first.plan
    assert problem_key(again.problem) == problem_key(first.problem)
    # Less memory: the measured model is reused, the plan is made again.
    tighter = _compile(gpt_tiny(n_layer=3), cache, memory="3MiB")
    assert cache.hits == {"analysis": 2, "plan": 1}
    partc.validate_plan(tighter.problem, tighter.plan)
    assert tighter.plan.stages[0].limit_bytes == 3 * 2**20
    # A different architecture or batch shape is a different graph signature.
    _compile(gpt_tiny(n_layer=4), cache)
    _compile(gpt_tiny(n_layer=3), cache, batch=4)
    assert cache.hits["analysis"] == 2
    # Mixed precision measures the layers under autocast: a model measured apart.
    mixed = _compile(gpt_tiny(n_layer=3), cache, dtype=torch.bfloat16)
    assert cache.hits["analysis"] == 2 and mixed.graph is not None
    assert mixed.problem.model.summary.autocast == "bfloat16"
    assert mixed.problem.train.measured_scale == 1.0


def test_a_stored_plan_carries_this_compiles_training_setup():
    # max_grad_norm is no number the planner reads: the same problem, the stored plan,
    # but the runtime must clip as this compile asks.
    cache = partc.PlanCache()
    ids = torch.zeros(8, 16, dtype=torch.long)
    plans = [partc.compile(gpt_tiny(n_layer=2), (ids,), loss_fn=loss_fn, example_target=ids,
                           budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                           train=partc.TrainSpec(global_batch_size=8, max_grad_norm=clip),
                           cache=cache).plan for clip in (None, 1.0)]
    assert cache.hits["plan"] == 1
    assert [plan.train.max_grad_norm for plan in plans] == [None, 1.0]
    assert plans[0].hash == plans[1].hash


def test_mixed_precision_is_measured_apart_for_gpus_and_cpus():
    """GPUs run other kernels than CPUs (dropout: CUDA's fused kernel keeps a 1-byte
    mask, a CPU its noise in the compute dtype; the autocast policy is CUDA's on both):
    under bf16 a GPU with a CPU's numbers is measured apart from the CPU, in fp32 the
    measurement is shared."""
    cpu_preset = preset("CPU")
    like_cpu = {name: getattr(cpu_preset, name) for name in (
        "peak_flops", "flops_efficiency", "hbm_bandwidth", "devices_per_node",
        "intra_node_bandwidth", "inter_node_bandwidth", "link_latency_s",
        "intra_node_latency_s", "context_memory", "communicator_memory",
        "memory_fragmentation")}
    cache = partc.PlanCache()
    _compile(gpt_tiny(n_layer=2), cache)
    _compile(gpt_tiny(n_layer=2), cache, device="H100-80GB", **like_cpu)
    assert cache.hits["analysis"] == 1
    cpu = _compile(gpt_tiny(n_layer=2, dropout=0.1), cache, dtype=torch.bfloat16)
    gpu = _compile(gpt_tiny(n_layer=2, dropout=0.1), cache, dtype=torch.bfloat16,
                   device="H100-80GB", **like_cpu)
    assert cache.hits["analysis"] == 1 and gpu.graph is not None
    blocks = [(c.saved_bytes["none"], g.saved_bytes["none"]) for c, g in zip(
        cpu.problem.model.layers, gpu.problem.model.layers) if c.name.startswith("blocks.")]
    assert blocks and all(on_cpu > on_gpu for on_cpu, on_gpu in blocks)


def test_a_cache_directory_serves_a_new_process(tmp_path):
    first = _compile(gpt_tiny(n_layer=2), partc.PlanCache(tmp_path))
    fresh = partc.PlanCache(tmp_path)     # nothing in memory: as a new process sees it
    again = _compile(gpt_tiny(n_layer=2), fresh)
    assert fresh.hits == {"analysis": 1, "plan": 1} and again.plan == first.plan
    # A damaged entry is ignored, and the plan is made (and stored) again.
    for path in tmp_path.rglob("plan/*.json"):
        path.write_text("{not json")
    damaged = partc.PlanCache(tmp_path)
    remade = _compile(gpt_tiny(n_layer=2), damaged)
    assert damaged.hits == {"analysis": 1, "plan": 0} and remade.plan.hash == first.plan.hash


def test_no_cache_traces_every_time():
    program = _compile(gpt_tiny(n_layer=2), None)
    assert program.graph is not None


def test_cost_tables_are_shared_between_problems_that_differ_only_in_memory():
    """The planner keeps nothing between calls; the plan cache keeps its TableCache per
    problem, the devices' memory left out, so that re-planning after a budget change
    starts from the tables and plans of the last solve."""
    from tests.planner.instances import devices, layer, problem

    layers = [layer(f"l{i}") for i in range(3)]
    cache = partc.PlanCache()
    tables = cache.table_cache(problem(layers, [0.0, 0.0], devices(2, 10**9)))
    assert cache.table_cache(problem(layers, [0.0, 0.0], devices(2, 10**8))) is tables
    assert cache.table_cache(problem(layers, [0.0, 0.0], devices(2, [10**9, 10**8]))) is tables
    assert cache.table_cache(problem(layers, [1e3, 0.0], devices(2, 10**9))) is not tables
    assert partc.PlanCache().table_cache(problem(layers, [0.0, 0.0],
                                                 devices(2, 10**9))) is not tables
    # Re-planning with less memory fills the same cache with what the solve learnt.
    tight = problem(layers, [0.0, 0.0], devices(2, 10**8))
    partc.plan_problem(tight, table_cache=cache.table_cache(tight))
    assert tables.best_config is not None and tables.solutions


def test_cache_files_are_json_and_a_planted_pickle_never_runs(tmp_path):
    """Files are data, never code: no entry is a pickle, and a pickle planted where an
    entry lies (or where the old versions kept theirs) is discarded unread."""
    import pickle

    first = _compile(gpt_tiny(n_layer=2), partc.PlanCache(tmp_path))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    # Beside each entry, the empty lock its maker held (PlanCache.computing).
    assert all(p.stat().st_size == 0 for p in files if p.suffix == ".lock")
    entries = sorted(p for p in files if p.suffix != ".lock")
    assert [p.suffix for p in entries] == [".json", ".json"]
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for protocol, path in enumerate(entries):   # protocol 0 is ASCII text
        planted = pickle.dumps(Payload(), protocol=protocol)
        path.write_bytes(planted)
        path.with_suffix(".pkl").write_bytes(planted)
    fresh = partc.PlanCache(tmp_path)
    again = _compile(gpt_tiny(n_layer=2), fresh)
    assert not marker.exists()
    assert fresh.hits == {"analysis": 0, "plan": 0} and again.plan.hash == first.plan.hash
    # Both entries were made again, as JSON.
    for path in entries:
        json.loads(path.read_text())


def test_an_analysis_and_a_plan_read_back_from_disk_are_equal(tmp_path):
    first = _compile(gpt_tiny(n_layer=2), partc.PlanCache(tmp_path), num_devices=4)
    assert first.problem.model.tensor_parallel   # TPOptions, placements, nested analyses
    fresh = partc.PlanCache(tmp_path)
    key = next(tmp_path.rglob("analysis/*.json")).stem
    assert fresh.analysis(key) == first.problem.model
    assert repr(fresh.analysis(key)) == repr(first.problem.model)   # the plan key holds
    assert fresh.plan(first.problem) == first.plan


# A cut file and a foreign schema by default; -m slow an old version and an invalid plan.
@pytest.mark.parametrize("damage", ["truncated", pytest.param("version", marks=pytest.mark.slow),
                                    "schema", pytest.param("invalid", marks=pytest.mark.slow)])
def test_a_bad_entry_is_discarded_with_a_warning_and_made_again(tmp_path, caplog, damage):
    first = _compile(gpt_tiny(n_layer=2), partc.PlanCache(tmp_path))
    plan_file = next(tmp_path.rglob("plan/*.json"))
    analysis_file = next(tmp_path.rglob("analysis/*.json"))
    data = json.loads(plan_file.read_text())
    if damage == "truncated":
        text = analysis_file.read_text()
        analysis_file.write_text(text[:len(text) // 2])
        plan_file.write_text(plan_file.read_text()[:100])
    elif damage == "version":
        analysis = json.loads(analysis_file.read_text())
        analysis_file.write_text(json.dumps({**analysis, "version": 99}))
        plan_file.write_text(json.dumps({**data, "schema_version": 99}))
    elif damage == "schema":   # a mistyped field in each
        analysis = json.loads(analysis_file.read_text())
        analysis["analysis"]["layers"][0]["fwd_flops"] = "many"
        analysis_file.write_text(json.dumps(analysis))
        data["stages"][0]["limit_bytes"] = "16GiB"
        plan_file.write_text(json.dumps(data))
    else:   # well-formed, but not what the cost model gives for this problem
        data["stages"][0]["memory_bytes"]["peak"] += 1
        plan_file.write_text(json.dumps(data))
    cache = partc.PlanCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="partc"):
        again = _compile(gpt_tiny(n_layer=2), cache)
    assert again.plan.hash == first.plan.hash
    assert "discarding" in caplog.text
    assert cache.hits["plan"] == 0
    assert cache.hits["analysis"] == (1 if damage == "invalid" else 0)
    # The entries were replaced by good ones: a new process reads both.
    fresh = partc.PlanCache(tmp_path)
    _compile(gpt_tiny(n_layer=2), fresh)
    assert fresh.hits == {"analysis": 1, "plan": 1}


def test_models_of_one_shape_but_other_forwards_are_measured_apart():
    """Seen before (random models, tests/random_models.py): a model with ``relu_`` where
    another of the same module tree and shapes had ``silu`` got the other's measured
    graph, and its lowering failed ("the plan's sharding has 6 node choices, the traced
    layer 7"). Another activation, an in-place op or a tied weight is another graph."""
    first, second = BlockSpec(width=4, activation="silu"), BlockSpec(width=4, activation="silu")
    spec = ModelSpec(d_in=4, d_out=4, blocks=(first, second))
    others = [(dataclasses.replace(first, activation="relu"), second),
              (dataclasses.replace(first, in_place="mul_"), second),
              (first, dataclasses.replace(second, tied_to=0))]
    models = [build(spec)] + [build(dataclasses.replace(spec, blocks=b)) for b in others]
    assert len({model_hash(model) for model in models}) == 1
    cache = partc.PlanCache()
    x = torch.zeros(8, 4)
    for model in models:
        partc.compile(model, (x,), budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                      loss_fn=torch.nn.functional.mse_loss, example_target=x, cache=cache)
    assert cache.hits["analysis"] == 0
    partc.compile(build(spec), (x,), budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                  loss_fn=torch.nn.functional.mse_loss, example_target=x, cache=cache)
    assert cache.hits["analysis"] == 1  # the same model again: measured once


def test_writers_of_one_entry_at_once_do_not_collide(tmp_path):
    """Every rank of a node writes the same entry when they share PARTC_CACHE_DIR: each
    through a partial file of its own (a shared partial name once made one rank's
    rename fail, and that rank left its peers waiting in the next collective)."""
    import threading

    cache = partc.PlanCache(tmp_path)
    plan = _compile(gpt_tiny(n_layer=2), cache).plan
    errors, start = [], threading.Barrier(8)

    def write():
        start.wait()
        try:
            for _ in range(20):
                cache._put(cache._plans, "same", plan, "json", plan.to_json().encode())
        except Exception as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [p.name for p in tmp_path.rglob("*.partial")] == []
    assert len(list(tmp_path.rglob("same.json"))) == 1


def test_processes_sharing_a_directory_make_each_entry_once(tmp_path):
    """Ranks of a node sharing PARTC_CACHE_DIR: while one traces and plans (holding the
    entry's lock), the others wait, then read what it stored; one analysis and one plan
    made in all. (Threads stand in for the processes: each lock is taken by file.)"""
    import threading

    caches = [partc.PlanCache(tmp_path) for _ in range(3)]
    plans, errors, start = {}, [], threading.Barrier(len(caches))

    def rank(index: int) -> None:
        start.wait()
        try:
            plans[index] = _compile(gpt_tiny(n_layer=2), caches[index]).plan.hash
        except Exception as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(caches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(plans.values())) == 1
    assert sum(cache.hits["analysis"] for cache in caches) == len(caches) - 1
    assert sum(cache.hits["plan"] for cache in caches) == len(caches) - 1



def gemma3_key() -> tuple[list[str], str]:
    """A tiny Gemma 3 (one sliding-window layer, one global), traced and measured: the
    order ``set(layer_types)`` iterates in in this process, and its problem's key."""
    from partc.compiler import build_problem
    from partc.passes.pipeline import analyze
    from tests.hf_families import FAMILIES

    model = FAMILIES["gemma3"].build()
    _, analysis = analyze(model, (torch.zeros(2, 8, dtype=torch.long),))
    problem = build_problem(analysis, partc.DeviceBudget(num_devices=1, device="CPU"),
                            partc.TrainSpec(global_batch_size=2), partc.Constraints())
    return list(set(model.config.layer_types)), problem_key(problem)


def test_the_problem_key_does_not_follow_the_order_set_iteration_traced_in(monkeypatch):
    """Gemma 3 computes one rotary table per ``set(layer_types)``, so each process traces
    its sliding-window and global tables in the order its string hashing decides (here
    both orders, in one process: Gemma's ``set`` made to iterate sorted, then reversed).
    The problem key, which the plan cache reads across processes, is the same: layers
    are described by what they compute, not in trace order."""
    from transformers.models.gemma3 import modeling_gemma3

    keys, traced = [], []
    for reverse in (False, True):
        def ordered(names, reverse=reverse):
            traced.append(tuple(sorted(frozenset(names), reverse=reverse)))
            return traced[-1]
        monkeypatch.setattr(modeling_gemma3, "set", ordered, raising=False)
        keys.append(gemma3_key()[1])
    assert set(traced) == {("full_attention", "sliding_attention"),
                           ("sliding_attention", "full_attention")}
    assert keys[0] == keys[1]


def _hash_seed_iterating(names: list[str], other_than: list[str]) -> int:
    """A PYTHONHASHSEED under which ``set(names)`` iterates in another order than
    ``other_than`` (asked of bare interpreters: they start in milliseconds)."""
    for seed in range(64):
        done = subprocess.run(
            [sys.executable, "-S", "-c", "import sys; print(*set(sys.argv[1:]))", *names],
            env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True,
            text=True, check=True)
        if done.stdout.split() != other_than:
            return seed
    raise AssertionError(f"no hash seed of 64 iterates {names} otherwise than {other_than}")


@pytest.mark.slow   # a second process importing torch, partc and transformers: ~8 s CPU
def test_a_new_process_finds_the_plan_whatever_order_its_string_hashing_traces_in():
    """The same across processes, as the plan cache meets it: this one and another whose
    PYTHONHASHSEED iterates Gemma 3's ``set(layer_types)`` the other way."""
    from tests.hf_families import FAMILIES

    order, key = gemma3_key()
    seed = _hash_seed_iterating(FAMILIES["gemma3"].fields["layer_types"], other_than=order)
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, "-c", "import json, tests.test_cache as t; "
         "print(json.dumps(t.gemma3_key()))"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    other_order, other_key = json.loads(done.stdout.strip().splitlines()[-1])
    assert other_order != order   # the other process traced the tables the other way
    assert other_key == key
