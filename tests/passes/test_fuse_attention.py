"""Attention written as plain ops becomes one fused call, computing what it did.

On the sample GPT (symbolic_trace: ``masked_fill`` with a ``tril`` mask, scale as a
computed number) and Hugging Face Llama (grouped-query ``repeat_kv``), GPT-2 and BERT
(torch.export: additive ``where`` masks built from positions, scale a constant): the
rewritten graph gives the original model's outputs and gradients; what the estimate
measures is what the fused kernel keeps, counted here by hand.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import partc
from partc import meta
from partc.passes.fuse_attention import (count_fused, fuse_attention, fused_kernel, is_fused,
                                         skips_masked_blocks)
from partc.passes.pipeline import analyze
from partc.passes.propagate import propagate
from partc.passes.trace import trace
from samples import gpt
from tests import models
from tests.hf_families import FAMILIES
from tests.tolerances import FP32

BATCH, SEQ = 2, 16


def _build(name: str, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return {"gpt": lambda: gpt.gpt_tiny(dropout=dropout),
            "llama": lambda: models.llama(),
            "gpt2": lambda: models.gpt2(dropout=dropout),
            "bert": lambda: models.bert(dropout=dropout)}[name]()


def _fused(model: nn.Module, *inputs: torch.Tensor, **kwargs: torch.Tensor):
    gm, ctx = trace(model, inputs, kwargs=kwargs or None)
    propagate(gm, ctx)
    return fuse_attention(gm, ctx)


def _calls(gm) -> list:
    return [n for n in gm.graph.nodes if is_fused(n)]


def _first(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


# Causal language models get is_causal; BERT without padding needs no mask at all.
@pytest.mark.parametrize("name,causal", [("gpt", True), ("llama", True), ("gpt2", True),
                                         ("bert", False)])
def test_fused_graph_matches_the_model(name: str, causal: bool) -> None:
    model = _build(name)
    ids = torch.randint(1, 128, (BATCH, SEQ))
    gm = _fused(copy.deepcopy(model), ids)
    calls = _calls(gm)
    assert len(calls) == 2  # one per block
    for call in calls:
        assert call.kwargs == {"dropout_p": 0.0, "is_causal": causal, "scale": 0.25}
    assert "softmax" not in gm.code
    ours, theirs = _first(gm(ids)), _first(model(ids))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(theirs)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    grads = {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}
    assert len(grads) == sum(1 for p in model.parameters() if p.grad is not None)
    for fqn, param in model.named_parameters():
        # Relative to the gradient's norm, against 1e-2 where that is ~0 (a key
        # projection's bias has a gradient that is mathematically zero: rounding noise).
        if param.grad is not None:
            error = (grads[fqn] - param.grad).norm() / max(param.grad.norm(), 1e-2)
            assert error < 1e-5, (fqn, error.item())


def test_padding_mask_is_passed_as_additive_mask() -> None:
    model = _build("bert")
    ids = torch.randint(1, 128, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    gm = _fused(copy.deepcopy(model), ids, attention_mask=mask)
    calls = _calls(gm)
    assert len(calls) == 2 and all(c.kwargs["attn_mask"] is calls[0].kwargs["attn_mask"]
                                   and not c.kwargs["is_causal"] for c in calls)
    torch.testing.assert_close(gm.forward(ids, mask)[0],
                               model(ids, attention_mask=mask).last_hidden_state,
                               rtol=1e-5, atol=1e-5)


def test_training_dropout_moves_into_the_call() -> None:
    gm = _fused(_build("gpt2", dropout=0.1), torch.randint(1, 128, (BATCH, SEQ)))
    assert [c.kwargs["dropout_p"] for c in _calls(gm)] == [0.1, 0.1]
    assert "dropout" not in str(_calls(gm)[0].args)


class _ReturnsProbs(nn.Module):
    """Attention whose probabilities are returned: nothing to fuse without losing them."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        probs = F.softmax(q @ k.transpose(-2, -1) * 0.5, dim=-1)
        return probs @ v, probs


class _NoMaskNoScale(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.matmul(q, k.transpose(2, 3)), -1) @ v


def test_attention_with_other_users_is_left_as_written(caplog) -> None:
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="partc"):
        gm = _fused(_ReturnsProbs(), q, k, v)
    assert count_fused(gm) == 0 and "softmax" in gm.code
    assert "used outside the attention" in caplog.text


def test_unscaled_attention_gets_scale_one() -> None:
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    gm = _fused(_NoMaskNoScale(), q, k, v)
    (call,) = _calls(gm)
    assert call.kwargs == {"dropout_p": 0.0, "is_causal": False, "scale": 1.0}
    torch.testing.assert_close(gm(q, k, v), _NoMaskNoScale()(q, k, v))


def _layer0(analysis):
    return analysis.layers[[layer.name for layer in analysis.layers].index("model.layers.0")]


def _saved(analysis) -> float:
    return sum(layer.saved_bytes["none"] for layer in analysis.layers)


def test_saved_bytes_are_the_fused_kernels() -> None:
    """Llama, 4 query heads of 16 over 2 key/value heads, fp32, batch 2, seq 64: the
    call keeps q, the repeated k and v, its output (b, h, s, d each) and one log-sum-exp
    per row (b, h, s). The written attention kept the (b, h, s, s) probabilities instead
    of the output and log-sum-exp (the output projection keeps its own copy either way)."""
    seq, heads, head_dim = 64, 4, 16
    ids = torch.randint(1, 128, (BATCH, seq))
    gm, fused = analyze(_build("llama"), (ids,), attention="fused", full_trace=True)
    _, written = analyze(_build("llama"), (ids,), full_trace=True)
    call = _calls(gm)[0]
    q, k, v = call.args
    kept = sum(meta.cost(n).saved_bytes for n in (q, k, v, call))
    out, lse = BATCH * heads * seq * head_dim * 4, BATCH * heads * seq * 4
    assert kept == 4 * out + lse
    probs = BATCH * heads * seq * seq * 4
    saved, was = _layer0(fused).saved_bytes["none"], _layer0(written).saved_bytes["none"]
    assert was - saved >= (probs - out - lse) / BATCH  # per sample


def test_backward_recomputes_the_scores() -> None:
    """The written products' forward FLOPs, less the half of the (seq x seq) products the
    GPU kernels skip under the causal mask; backward 2.5x the fused kernel's forward."""
    ids = torch.randint(1, 128, (BATCH, SEQ))
    _, fused = analyze(_build("gpt"), (ids,), attention="fused", full_trace=True)
    _, written = analyze(_build("gpt"), (ids,), full_trace=True)
    attention = 2 * 2 * 4 * SEQ * SEQ * 16  # two products per head, per sample
    for ours, theirs in zip(fused.layers, written.layers):
        skipped = attention / 2 if ours.name.startswith("blocks.") else 0.0
        assert ours.fwd_flops == theirs.fwd_flops - skipped
        # written: 2 x attention (4 x skipped) in backward; fused: 2.5 x its half of it.
        assert ours.bwd_flops == pytest.approx(theirs.bwd_flops - 4 * skipped
                                               + 2.5 * skipped)
        assert ours.fwd_mem_bytes <= theirs.fwd_mem_bytes


def test_the_fused_call_is_the_one_heavy_op_marked_attention() -> None:
    """The cost model prices a fused attention kernel at the device's attention share of
    peak: each block's call is its one HeavyOp marked so, holding the block's (seq x
    seq) products (half of them skipped under the causal mask); the written products
    are plain matmuls."""
    ids = torch.randint(1, 128, (BATCH, SEQ))
    _, fused = analyze(_build("gpt"), (ids,), attention="fused", full_trace=True)
    _, written = analyze(_build("gpt"), (ids,), full_trace=True)
    half = 2 * 2 * 4 * SEQ * SEQ * 16 / 2
    for layer in fused.layers:
        marked = [op for op in layer.heavy_ops if op.attention]
        if layer.name.startswith("blocks."):
            assert [(op.count, op.flops, op.bwd_extra_flops) for op in marked] == [
                (1, half, half / 2)]
        else:
            assert marked == []
    assert not any(op.attention for layer in written.layers for op in layer.heavy_ops)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dropout_is_measured_as_the_fused_kernel_keeps_it(device: str) -> None:
    """Fake CPU tensors send dropout to the math path; on a GPU the estimate keeps what
    the fused kernels keep (they redraw the mask in backward), as without dropout. On a
    CPU, SDPA with dropout does take the math path (the CPU flash kernel takes no
    dropout), which computes every (seq x seq) product, the half the causal flash kernel
    skips counted again, and keeps every head's probabilities for backward: planned as
    the fused kernel, GPT-BigCode trained on a CPU (attention dropout 0.1) held 7.7x the
    memory planned at 1,024 tokens."""
    ids = torch.randint(1, 128, (BATCH, SEQ))
    _, with_dropout = analyze(_build("gpt", 0.1), (ids,), attention="fused", full_trace=True,
                              autocast_device=device)
    _, without = analyze(_build("gpt", 0.0), (ids,), attention="fused", full_trace=True,
                         autocast_device=device)
    block = [layer.name for layer in without.layers].index("blocks.0")
    ours, theirs = with_dropout.layers[block], without.layers[block]
    skipped = 2 * 4 * SEQ * SEQ * 16 if device == "cpu" else 0   # half of two products
    assert ours.fwd_flops == theirs.fwd_flops + skipped
    # The block's two other dropouts (attention and MLP outputs) keep their masks: CUDA's
    # native_dropout a byte per element of a (seq, 64) activation, per sample; a CPU its
    # fp32 noise, four bytes.
    masks = 2 * SEQ * 64 * (1 if device == "cuda" else 4)
    extra = ours.saved_bytes["none"] - theirs.saved_bytes["none"] - masks
    if device == "cuda":
        assert extra == 0
    else:   # the probabilities for softmax's backward, the dropped ones for the product's
        plane = 4 * SEQ * SEQ * 4   # (heads, seq, seq) in fp32, per sample
        assert 2 * plane <= extra <= 3 * plane


def test_compile_plans_and_emits_the_attention_chosen() -> None:
    """The option reaches the plan, its report and the emitted stage code; a cache holding
    the model measured as written does not answer for the fused one."""
    import partc
    from partc.cache import PlanCache

    model = _build("gpt")
    ids, targets = gpt.example_inputs(model, batch=4, seq=SEQ)
    cache = PlanCache()
    programs = {attention: partc.compile(
        model, (ids,), loss_fn=gpt.loss_fn, example_target=targets, cache=cache,
        budget=partc.DeviceBudget(num_devices=2, device="A100-80GB"),
        train=partc.TrainSpec(global_batch_size=4, attention=attention),
        constraints=partc.Constraints(pp=2, tp=1, dp=1, recompute="none", num_microbatches=2))
        for attention in ("as_written", "fused")}
    written, fused = programs["as_written"], programs["fused"]
    assert cache.hits["analysis"] == 0
    assert fused.plan.train.attention == "fused"
    assert "attention fused" in fused.report() and "attention as the model" in written.report()
    # Per layer (the stages' sums also depend on where each plan cuts, and on how many
    # microbatches each stage holds).
    activations = [sum(layer.saved_bytes["none"] for layer in program.problem.layers)
                   for program in (fused, written)]
    assert activations[0] < activations[1]
    code = "".join(fused.code().values())
    assert code.count("scaled_dot_product_attention(") == 2 and "softmax" not in code
    assert "softmax" in "".join(written.code().values())


def test_a_model_on_the_meta_device_is_measured_like_one_with_weights() -> None:
    """Fake meta tensors would send SDPA to the math path; the estimate runs the kernel."""
    ids = torch.randint(1, 128, (BATCH, SEQ))
    _, real = analyze(_build("llama"), (ids,), attention="fused", full_trace=True)
    with torch.device("meta"):
        model = _build("llama")
    _, planned = analyze(model, (ids.to("meta"),), attention="fused", full_trace=True)
    assert [layer.saved_bytes for layer in planned.layers] == \
        [layer.saved_bytes for layer in real.layers]


def test_a_models_own_causal_mask_becomes_is_causal() -> None:
    """Llama with Hugging Face's sdpa attention passes a (batch, 1, seq, seq) boolean mask;
    fused, the call takes is_causal instead and backward keeps no mask."""
    torch.manual_seed(0)
    model = models.llama(attention="sdpa")
    ids = torch.randint(1, 128, (BATCH, SEQ))
    gm = _fused(copy.deepcopy(model), ids)
    assert [c.kwargs for c in _calls(gm)] == [{"dropout_p": 0.0, "is_causal": True,
                                                "scale": 0.25}] * 2
    torch.testing.assert_close(gm(ids)[0], model(ids).logits, rtol=1e-5, atol=1e-5)
    _, fused = analyze(model, (ids,), attention="fused", full_trace=True)
    _, written = analyze(model, (ids,), full_trace=True)
    # Per sample: the boolean mask, which every block reads and the model holds once
    # (charged to the layer that makes it), and in each block the additive copy SDPA
    # makes of it and its kernel keeps for backward (float32).
    mask, additive = SEQ * SEQ, 4 * SEQ * SEQ
    assert _saved(written) - _saved(fused) == mask + 2 * additive
    assert _layer0(written).saved_bytes["none"] == _layer0(fused).saved_bytes["none"] + additive


class LearnedBias(nn.Module):
    """Attention whose additive mask is a parameter (T5's relative position bias)."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.bias = nn.Parameter(torch.randn(1, heads, SEQ, SEQ))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=1.0)
        return self.out(y.transpose(1, 2).reshape(b, s, width))


def test_a_mask_that_needs_a_gradient_is_measured_on_the_math_path() -> None:
    """The fused CPU kernel cannot differentiate its mask; SDPA then runs the math path,
    and the estimate measures that one: the same values and gradients, and the model
    analyses (it failed with "not differentiable with respect to argument 'attn_mask'")."""
    from partc.passes.fuse_attention import fused_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, 2, SEQ, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, SEQ, SEQ, requires_grad=True)
    ours = fused_kernel(q, k, v, attn_mask=bias, scale=1.0)
    (ours_grad,) = torch.autograd.grad(ours.square().sum(), bias)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    (theirs_grad,) = torch.autograd.grad(theirs.square().sum(), bias)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_grad, theirs_grad)
    _, analysis = analyze(LearnedBias(), (torch.randn(BATCH, SEQ, 16),), full_trace=True)
    assert analysis.layers


class WindowedCausal(nn.Module):
    """Attention with a causal mask built from positions, as Hugging Face builds one, and
    a sliding window (keeps j in i - window < j <= i)."""

    def __init__(self, window: int, width: int = 8) -> None:
        super().__init__()
        self.window = window
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None].expand(
            b, 1, s, s))
        return y.transpose(1, 2).reshape(b, s, width)


@pytest.mark.parametrize("window, causal", [(SEQ, True), (SEQ // 2, False)])
def test_a_long_mask_is_proved_tile_by_tile(monkeypatch, window, causal):
    """Above BLOCK_ELEMENTS a shapes-only mask is judged from its tiles' bounds, and only
    tiles that mix kept and dropped positions are made (at most LEAF_SIDE a side): the
    same verdict as whole, a window that bites only in the last rows included, with
    about seq x LEAF_SIDE elements made for a causal mask, not seq x seq."""
    from partc.passes.helpers import mask_rows

    x = torch.randn(BATCH, SEQ, 8)
    made = []
    original = mask_rows.RowBlocks.tile

    def counted(self, rows, cols):
        made.append((rows[1] - rows[0]) * (cols[1] - cols[0]))
        return original(self, rows, cols)

    monkeypatch.setattr(mask_rows, "BLOCK_ELEMENTS", 3 * SEQ)
    monkeypatch.setattr(mask_rows, "LEAF_SIDE", 2)
    monkeypatch.setattr(mask_rows.RowBlocks, "tile", counted)
    gm = _fused(WindowedCausal(window), x)
    assert [c.kwargs.get("is_causal", False) for c in gm.graph.nodes
            if c.op == "call_function" and "scaled_dot_product" in str(c.target)] == [causal]
    # The diagonal's tiles, 2 x 2 (twice: once disproving "keeps every position").
    assert made and max(made) <= 4 and (sum(made) <= 2 * 2 * SEQ if causal else True)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_models_masks_read_in_blocks_fuse_as_whole(monkeypatch, name):
    from partc.passes.helpers import mask_rows

    ids = torch.randint(1, 128, (BATCH, SEQ))
    whole = [c.kwargs for c in _calls(_fused(_build(name), ids))]
    monkeypatch.setattr(mask_rows, "BLOCK_ELEMENTS", 2 * SEQ)
    assert [c.kwargs for c in _calls(_fused(_build(name), ids))] == whole
    sdpa = models.llama(attention="sdpa")
    assert all(c.kwargs["is_causal"] for c in _calls(_fused(sdpa, ids)))


def test_values_of_another_head_size_are_measured_on_the_efficient_kernel() -> None:
    """DeepSeek's latent attention: queries and keys of 24 per head, values of 16. The
    measured kernel's output has the values' head size (the flash CPU kernel's fake would
    have had the queries'), its products those of the written attention, and the whole
    model plans, as published (192 against 128) it did not."""
    b, h, s = 2, 4, 32
    with FakeTensorMode():
        q, k = torch.empty(b, h, s, 24), torch.empty(b, h, s, 24)
        v = torch.empty(b, h, s, 16)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
        for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
            with FlopCounterMode(display=False) as counted:
                out = fused_kernel(q, k, v, **kwargs)
            assert out.shape == (b, h, s, 16)
            assert counted.get_total_flops() == 2 * b * h * s * s * (24 + 16)

    family = FAMILIES["deepseek-v3"]
    family = dataclasses.replace(family, fields={**family.fields, "v_head_dim": 8})
    ids = torch.randint(1, 128, (BATCH, SEQ))
    program = partc.compile(family.build(), (ids,), loss_fn=lambda out, t: out.logits.mean(),
                            example_target=ids, cache=None,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            constraints=partc.Constraints(pp=2))
    partc.validate_plan(program.problem, program.plan)


def test_attention_with_sinks_is_one_call_with_one_more_key(caplog) -> None:
    """gpt-oss's attention: a per-head sink logit joins each row's softmax and is dropped
    after it (its value is zero), the rows shifted by their maximum first. It was left as
    written (the (seq x seq) probabilities of every head kept; a 120B shape planned at
    MFU 4%). The call gets the sink as one more key, first, and each query one more
    feature, 1, padded to 8; the mask (full or sliding-window) keeps the sink's column.
    The graph computes what the model does, with the sinks trained."""
    torch.manual_seed(0)
    family = FAMILIES["gpt-oss"]   # a window shorter than the sequence: not causal
    model = dataclasses.replace(family, fields={**family.fields, "sliding_window": 8}).build()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    ids = torch.randint(1, 128, (BATCH, SEQ))
    with caplog.at_level("INFO", logger="partc"):
        gm = _fused(model, ids)
    # The router's softmax, over (tokens, experts), is no attention left as written.
    assert "left as written" not in caplog.text
    calls = _calls(gm)
    assert [model.config.layer_types[i] for i in range(2)] == ["sliding_attention",
                                                               "full_attention"]
    assert len(calls) == 2 and not any(n.target is torch.ops.aten.softmax.int
                                       and "self_attn" in meta.module_path(n)
                                       for n in gm.graph.nodes)
    head = model.config.head_dim
    width = -(-(head + 1) // 8) * 8
    sliding, full = calls
    for call in calls:
        q, k, v = (call.args[i].meta["val"] for i in range(3))
        assert q.shape[-1] == k.shape[-1] == width and k.shape[-2] == v.shape[-2] == SEQ + 1
        assert meta.attention_sink(call)
    # The sliding window's mask keeps the sink's column; the causal layer's call is
    # square and causal (a made-up first query row, dropped after), so that the kernel
    # skips the half the mask hides, its values padded like its keys.
    assert sliding.kwargs["attn_mask"].meta["val"].shape[-1] == SEQ + 1
    assert not sliding.kwargs["is_causal"] and sliding.args[2].meta["val"].shape[-1] == head
    assert full.kwargs["is_causal"] and "attn_mask" not in full.kwargs
    assert full.args[0].meta["val"].shape[-2] == SEQ + 1
    assert full.args[2].meta["val"].shape[-1] == width
    assert skips_masked_blocks(full, "cuda") and not skips_masked_blocks(sliding, "cuda")
    expected = model(ids).logits
    torch.testing.assert_close(_first(gm(ids)), expected, rtol=FP32, atol=FP32)
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    ours = torch.autograd.grad(_first(gm(ids)).square().mean(), sinks)
    theirs = torch.autograd.grad(expected.square().mean(), sinks)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=FP32, atol=FP32)


def test_sdpa_keeps_an_additive_copy_of_each_boolean_mask_it_is_given() -> None:
    """What the estimate counts of a boolean mask (``fused_kernel``), as the CPU runs it:
    each call makes an additive float copy and keeps it for backward, one per call."""
    from partc.runtime import telemetry

    seq = 256
    q = torch.randn(1, 2, seq, 8, requires_grad=True)
    keep = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]

    def live_after(calls: int, mask) -> int:
        counter = telemetry._TensorMemory(lambda: [q])
        counter.start()
        x = q
        for _ in range(calls):
            x = F.scaled_dot_product_attention(x, x, x, attn_mask=mask, scale=0.25)
        live = counter.peak()
        counter.stop()
        return live

    copy_bytes = 4 * seq * seq
    for calls in (1, 2):
        extra = live_after(calls, keep) - live_after(calls, None)
        assert calls * copy_bytes <= extra <= calls * copy_bytes + 4 * q.numel() * 4
