"""A layer's run kept by all it reads (passes/helpers/run_memo.py): a graph measured from
the same context gets it for the same layer, as a run of that layer gives it; a layer that
calls the tensor-parallel group is measured each time."""

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import autocast_policy, meta
from partc.passes import estimate as estimate_pass
from partc.passes.estimate import estimate
from partc.passes.helpers.graph import carries_grad, layer_nodes
from partc.passes.helpers.layer_run import Setting
from partc.passes.helpers.run_memo import run_key
from partc.passes.layers import layers
from partc.passes.propagate import propagate
from partc.passes.tp import chooser as tp_chooser
from partc.passes.tp.rewrite import GROUP, copy_module, tp_rewrite
from partc.passes.trace import trace
from tests import models
from tests.passes.test_tp_rewrite import LINK


def _measured(model, example, **context):
    gm, ctx = trace(model, (example,))
    ctx = dataclasses.replace(ctx, **context)
    for run in (propagate, layers, estimate):
        gm = run(gm, ctx)
    return gm, ctx


def _copy(gm):
    return copy_module(gm, tp_chooser.Sharding(tp=1, sequence_parallel=False))[0]


def _measurements(gm) -> tuple:
    nodes = tuple((node.name, meta.cost(node), node.meta.get(meta.RUN_DTYPES))
                  for node in gm.graph.nodes)
    return nodes, meta.layer_costs(gm), meta.cut_bytes(gm)


def _counting(monkeypatch, module, name: str) -> list:
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_graph_measured_from_the_same_context_reuses_its_layers_runs(monkeypatch):
    """Under bf16 autocast (casts, dtypes as made): the copy measured from the analysis'
    context runs no layer and ends with every cost a fresh measurement gives."""
    torch.manual_seed(0)
    gm, ctx = _measured(models.MLP(), torch.randn(2, 8), autocast=torch.bfloat16)
    fresh = _copy(gm)
    estimate(fresh, dataclasses.replace(ctx, layer_runs={}, ring_work={}))
    runs = _counting(monkeypatch, estimate_pass, "run_layer")
    kept = _copy(gm)
    estimate(kept, ctx)
    assert not runs
    assert _measurements(kept) == _measurements(fresh)


def test_a_layer_that_calls_the_group_is_measured_each_time():
    torch.manual_seed(0)
    gm, ctx = _measured(models.MLP(8, 16, 8), torch.randn(2, 8))
    chosen = tp_chooser.choose(gm, 2, LINK, prefer="memory")
    local, moved = copy_module(gm, chosen)
    tp_rewrite(local, dataclasses.replace(ctx, sharding=moved))
    propagate(local, ctx)
    setting = Setting(fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                      with_grad=carries_grad(local), autocast=None, dtypes={})
    calling = [info for info in meta.layers(local)
               if any(n.op == "get_attr" and n.target == GROUP for n in layer_nodes(local, info))]
    assert calling
    assert all(run_key(local, layer_nodes(local, info), setting) is None for info in calling)


def test_cuda_autocast_rules_are_installed_once_per_estimate(monkeypatch):
    """Installing CUDA's rules registers hundreds of kernels: once for all the layers."""
    torch.manual_seed(0)
    gm, ctx = _measured(models.MLP(), torch.randn(2, 8), autocast=torch.bfloat16)
    installed = _counting(monkeypatch, autocast_policy, "_kernels")
    estimate(_copy(gm), dataclasses.replace(ctx, layer_runs={}))
    assert len(meta.layers(gm)) > 1 and len(installed) == 1
