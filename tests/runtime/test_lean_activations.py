"""What tensor-parallel code keeps for backward: sharded dropout keeps a bool mask of its
own part only, equal to its part of the unsharded program's mask; under sequence
parallelism a linear reading a gathered shard keeps the shard and gathers it again in
backward; and the plan's saved bytes per layer are what the emitted stage saves.

One process: the groups are stand-ins (``TensorParallelGroup(size)`` acts as one rank
and moves no data), with the rank set by hand to check each rank's part.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from benchmarks.saved_bytes import compile_gpt, estimated_saved_bytes, saved_storages
from partc.runtime.tp import TensorParallelGroup, shard_of
from samples.gpt import GPTConfig


def _group(size: int, rank: int) -> TensorParallelGroup:
    group = TensorParallelGroup(size)
    group.rank = rank
    return group


def _saved(fn) -> list[torch.Tensor]:
    """The tensors autograd keeps while ``fn()`` runs, and its result."""
    kept: list[torch.Tensor] = []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return kept, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["dropout", "native_dropout"])
@pytest.mark.parametrize("dim,chunks", [(1, 1), (2, 3), (0, 1)])
def test_sharded_dropout_keeps_its_part_of_the_unsharded_mask_as_bool(dtype, method, dim,
                                                                       chunks):
    size, p = 2, 0.3
    whole = torch.randn(6, 8, 12, dtype=dtype)
    torch.manual_seed(7)
    if method == "dropout":
        reference = F.dropout(whole.clone().requires_grad_(), p, True)
    else:
        reference, reference_mask = torch.native_dropout(whole, p, True)
    for rank in range(size):
        group = _group(size, rank)
        x = shard_of(whole, dim, chunks, rank, size).contiguous().requires_grad_()
        torch.manual_seed(7)
        kept, out = _saved(lambda: getattr(group, method)(x, p, True, dim, chunks))
        if method == "native_dropout":
            out, mask = out
            assert torch.equal(mask, shard_of(reference_mask, dim, chunks, rank, size))
        if method == "dropout" or dtype == torch.float32:
            # (aten's bfloat16 native_dropout rounds its product differently; the masks
            # are equal, checked above.)
            assert torch.equal(out, shard_of(reference.detach(), dim, chunks, rank, size))
        # Kept for backward: one bool mask of this rank's part, nothing of the whole.
        assert [t.dtype for t in kept] == [torch.bool]
        assert kept[0].untyped_storage().nbytes() == x.numel()
        grad = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, x, grad)
        kept_mask = (out != 0).to(dtype)
        if method == "dropout":
            assert torch.equal(got, grad * kept_mask.div_(1 - p))
        else:
            assert torch.equal(got, grad * kept_mask * (1 / (1 - p)))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("product", ["linear", "addmm"])
def test_product_of_gathered_keeps_the_shard_and_gathers_once_again(autocast, product):
    """``linear_of_gathered`` and ``addmm_of_gathered`` (GPT-2's Conv1D: the gathered
    value flattened to a matrix, the weight (in, out)) give autograd's values and
    gradients, keep the shard in the dtype the product computes in, never the whole,
    and gather it once again in backward for all the products that read it."""
    group = _group(2, 0)   # a stand-in: its gather repeats this rank's shard
    torch.manual_seed(0)
    shard = torch.randn(3, 4, 16, requires_grad=True)
    shape = (20, 16) if product == "linear" else (16, 20)
    weights = [torch.randn(*shape, requires_grad=True) for _ in range(2)]
    biases = [torch.randn(20, requires_grad=True),
              None if product == "linear" else torch.randn(20, requires_grad=True)]

    def op(whole, w, b):
        return F.linear(whole, w, b) if product == "linear" else torch.addmm(b, whole, w)

    def lean_op(whole, w, b):
        if product == "linear":
            return group.linear_of_gathered(whole, shard, w, b, 1)
        return group.addmm_of_gathered(b, whole, w, shard, 1)

    def gathered():
        whole = group.gather_from_tp(shard, 1, 1, True)
        return whole if product == "linear" else whole.view(-1, 16)

    def reference():
        whole = gathered()
        return sum(op(whole, w, b).square().sum() for w, b in zip(weights, biases))

    def lean():
        whole = gathered()
        return sum(lean_op(whole, w, b).square().sum() for w, b in zip(weights, biases))

    def under_autocast(fn):
        # Autocast as the runtime runs mixed precision: the products compute in bfloat16.
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return fn()

    inputs = [shard, *weights, *[b for b in biases if b is not None]]
    want_loss = under_autocast(reference)
    want = torch.autograd.grad(want_loss, inputs)
    group.counts.clear()
    kept, loss = _saved(lambda: under_autocast(lean))
    assert torch.equal(loss, want_loss)
    assert not any(t.shape in ((3, 8, 16), (24, 16)) for t in kept), "the gathered input is kept"
    compute = torch.bfloat16 if autocast else torch.float32
    kept_shards = [t for t in kept if t.shape == shard.shape]
    assert kept_shards and all(t.dtype == compute for t in kept_shards)
    if not autocast:
        shard_storage = StorageWeakRef(shard.untyped_storage())
        assert any(StorageWeakRef(t.untyped_storage()) == shard_storage for t in kept)
    gathers = group.counts["all_gather"]
    got = torch.autograd.grad(loss, inputs)
    assert group.counts["all_gather"] == gathers + 1   # one gather again for both products
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_plan_saves_what_the_emitted_stage_saves_under_sequence_parallelism():
    config = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64,
                       dropout=0.1)
    program = compile_gpt(config, batch=4, seq=16, tp=2, sp=True)
    assert program.plan.tp == 2 and program.plan.sequence_parallel
    records = saved_storages(program)
    estimated = estimated_saved_bytes(program)
    batch, seq, width = 4, 16, 64
    for block in ("blocks.0", "blocks.1"):
        mine = [r for r in records if r[0] == block]
        measured = sum(size for _, size, _, _ in mine)
        assert measured == pytest.approx(estimated[block], rel=0.02), block
        # Nothing of the gathered whole sequence is kept, and the dropout masks are bool
        # and local: the attention probabilities' (heads split over the group) and the
        # two residual branches' (sequence split).
        assert not any(shape == (batch, seq, width) and dtype == torch.float32
                       for _, _, dtype, shape in mine), mine
        masks = sorted(shape for _, _, dtype, shape in mine if dtype == torch.bool
                       and len(shape) > 2)
        assert masks == sorted([(batch, 2, seq, seq), (batch, seq // 2, width),
                                (batch, seq // 2, width)]), masks


def test_plan_saves_what_the_bf16_runtime_saves():
    """In bf16 the estimate runs the layers as the runtime does (bf16 parameters, CUDA's
    autocast policy on CPU ranks too, the loss in fp32 outside autocast): the bytes one
    step of the built module keeps for backward, under its real mixed-precision path,
    are the plan's to the byte (the LayerNorms' fp32 copies of their bf16 weights
    included). Once the estimate saw fp32 parameters under CPU autocast's policy: 0.77x
    of what the runtime keeps."""
    from benchmarks.memory_check import _case, compile_case
    from benchmarks.saved_bytes import runtime_saved_bytes

    case = _case("gpt-bf16", "gpt", dtype=torch.bfloat16, batch=4, seq=32, pp=1,
                 num_microbatches=1, recompute="none")
    program, inputs, target = compile_case(case)
    kept = runtime_saved_bytes(program, inputs, target)
    estimated = sum(layer.saved_bytes["none"] for layer in program.problem.model.layers)
    assert estimated * program.plan.micro_batch_size == sum(kept.values())
    assert kept[torch.bfloat16] > kept[torch.float32]



@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_recomputed_loss_keeps_the_outputs_as_they_came(mode):
    """Under mixed precision the loss runs on fp32 copies of the last stage's bf16
    outputs. Recomputed, it keeps after its forward the outputs themselves (which the
    schedule holds until the loss's backward anyway), not the copies, twice their size:
    the estimate's "full" loss keeps its inputs only. Without recompute it keeps its
    fp32 log-softmax. The loss and its gradient are the same either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from partc.runtime.rank_build import PlannedLoss

    logits = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 64, (4, 16))
    made: set[StorageWeakRef] = set()   # the fp32 storages as large as the logits

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                    and out.numel() >= logits.numel():
                made.add(StorageWeakRef(out.untyped_storage()))
            return out

    def loss_call(output, labels):
        return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    with Watch():
        loss = PlannedLoss(loss_call, mode, mixed=True)(logits, target)
    alive = sum(not ref.expired() for ref in made)
    assert alive == (0 if mode == "full" else 1)
    grad, = torch.autograd.grad(loss, logits)
    want_loss = loss_call(logits.float(), target)
    want_grad, = torch.autograd.grad(want_loss, logits)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
