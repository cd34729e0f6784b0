"""partc.heap: full collections held off while partc plans, and put back after."""

import gc
import threading
import weakref

import pytest
import torch

import partc
from partc import compiler, heap
from samples.gpt import gpt_tiny, loss_fn


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_held_while_entered_and_put_back(thresholds):
    with heap.young_collections_only():
        assert gc.get_threshold() == (700, 10, heap.HELD_THRESHOLD)
        with heap.young_collections_only():   # re-entered: still held
            assert gc.get_threshold()[2] == heap.HELD_THRESHOLD
        assert gc.get_threshold()[2] == heap.HELD_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)


def test_put_back_when_the_body_raises(thresholds):
    with pytest.raises(RuntimeError):
        with heap.young_collections_only():
            raise RuntimeError("planning failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_young_collections_as_they_were(thresholds):
    gc.set_threshold(0)   # the user turned collection off: it stays off
    with heap.young_collections_only():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(700, 10, 10)
    with heap.young_collections_only():
        # a cycle made inside is still reclaimed by the young collections
        class Node:
            pass
        node = Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        gc.collect(0)
        assert ref() is None


def test_outermost_of_two_threads_puts_back(thresholds):
    inside, leave = threading.Event(), threading.Event()

    def plan():
        with heap.young_collections_only():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=plan)
    worker.start()
    inside.wait(10)
    with heap.young_collections_only():
        pass
    assert gc.get_threshold()[2] == heap.HELD_THRESHOLD   # the worker is still planning
    leave.set()
    worker.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def _thresholds_seen(monkeypatch, module, name: str) -> list:
    """The collector's thresholds at each call of ``module.name`` from now on."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def _compiled() -> partc.Program:
    return partc.compile(gpt_tiny(n_layer=2), (torch.zeros(2, 16, dtype=torch.long),),
                         loss_fn=loss_fn, cache=None,
                         budget=partc.DeviceBudget(num_devices=1, device="CPU"))


def test_compile_holds_full_collections(thresholds, monkeypatch):
    """partc.compile traces and plans with full collections held, and puts them back."""
    seen = _thresholds_seen(monkeypatch, compiler, "solve")
    _compiled()
    assert seen == [(700, 10, heap.HELD_THRESHOLD)]
    assert gc.get_threshold() == (700, 10, 10)


def test_the_planner_holds_full_collections_when_called_alone(thresholds, monkeypatch):
    """partc.planner.solve, called without partc.compile (as the validation rows call
    it), plans with full collections held too."""
    from partc.planner import search

    program = _compiled()
    seen = _thresholds_seen(monkeypatch, search, "candidate_configs")
    search.solve(program.problem)
    assert seen == [(700, 10, heap.HELD_THRESHOLD)]
    assert gc.get_threshold() == (700, 10, 10)


def test_lowering_holds_full_collections(thresholds, monkeypatch):
    """Program.lower (which build and code call) traces the whole model with them held."""
    from partc import program as program_module

    program = _compiled()
    seen = _thresholds_seen(monkeypatch, program_module, "lower")
    assert set(program.code()) == {"stage_0.py"}
    assert seen == [(700, 10, heap.HELD_THRESHOLD)]
    assert gc.get_threshold() == (700, 10, 10)
