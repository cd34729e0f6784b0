"""What MovedBytes counts of each op: every tensor read and written but parameters,
nothing for views, allocations and matmuls, and no leaf's gradient copy."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from partc.passes.helpers.op_bytes import MovedBytes, flop_formulas

N = 64   # elements of each fp32 tensor: 256 bytes


def _counter(run, frozen=(), cuda=False) -> MovedBytes:
    counter = MovedBytes({StorageWeakRef(t.untyped_storage()) for t in frozen}, cuda)
    with counter:
        run()
    return counter


def _counted(run, frozen=(), cuda=False) -> float:
    return _counter(run, frozen, cuda).moved


def _kernels(run, cuda=False) -> int:
    return _counter(run, cuda=cuda).kernels


def test_reads_and_writes_of_each_kind_of_op():
    a, b = torch.randn(N), torch.randn(N)
    weight = torch.randn(N)
    assert _counted(lambda: a + b) == 3 * 4 * N               # two read, one written
    assert _counted(lambda: a.add_(b)) == 3 * 4 * N           # in place: a read and written
    assert _counted(lambda: a.copy_(b)) == 2 * 4 * N          # the destination is not read
    assert _counted(lambda: weight.copy_(b), frozen=[weight]) == 2 * 4 * N
    assert _counted(lambda: a.view(8, 8).t()) == 0            # views
    assert _counted(lambda: torch.empty(N)) == 0              # an allocation
    assert _counted(lambda: a.view(8, 8) @ b.view(8, 8)) == 0  # a matmul: its FLOPs price it
    assert _counted(lambda: a * weight, frozen=[weight]) == 2 * 4 * N
    # masked_fill copies its input, then fills the copy in place.
    mask = torch.zeros(N, dtype=torch.bool)
    assert _counted(lambda: a.masked_fill(mask, 0.0)) == 4 * 4 * N + N


def test_softmax_backward_as_cuda_runs_it_and_no_leaf_copy():
    x = torch.randn(8, 8, requires_grad=True)
    grad = torch.randn(8, 8)
    for cuda, passes in ((False, 3), (True, 6)):
        y = torch.softmax(x, -1)
        # The incoming gradient reaches the leaf through softmax's backward as a new
        # tensor; autograd's storing of it in .grad is not counted either way.
        assert _counted(lambda: y.backward(grad), cuda=cuda) == passes * 4 * N
        x.grad = None
    # An add passes the caller's gradient straight on: autograd copies it into the
    # leaf's .grad (it cannot take over a tensor the caller holds), which is not counted.
    y = x + 1
    assert _counted(lambda: y.backward(grad)) == 0
    assert x.grad is not grad and torch.equal(x.grad, grad)


def test_kernels_each_op_launches():
    a, b = torch.randn(N), torch.randn(N)
    mask = torch.zeros(N, dtype=torch.bool)
    assert _kernels(lambda: a + b) == 1
    assert _kernels(lambda: a.view(8, 8).t()) == 0            # views
    assert _kernels(lambda: torch.empty(N)) == 0              # an allocation
    assert _kernels(lambda: a.view(8, 8) @ b.view(8, 8)) == 1  # a matmul launches one
    assert _kernels(lambda: a.masked_fill(mask, 0.0)) == 2    # the copy, then the fill
    assert _kernels(lambda: a.size()) == 0                    # a query
    x = torch.randn(8, 8, requires_grad=True)
    grad = torch.randn(8, 8)
    for cuda, launched in ((False, 1), (True, 2)):   # CUDA's multiply of its own
        y = torch.softmax(x, -1)
        assert _kernels(lambda: y.backward(grad), cuda=cuda) == launched
        x.grad = None
    y = x + 1
    assert _kernels(lambda: y.backward(grad)) == 0            # the leaf's copy: none
    counter = MovedBytes(set(), False)
    with counter:
        with counter.paused():
            a + b
        a * b
    assert counter.kernels == 1


def test_grouped_matmuls_count_one_product_per_routed_row():
    """torch's grouped matmul in its three forms (as FlopCounterMode hands a formula
    the shapes): routed tokens by each group's matrix, a batch of groups, and a weight's
    gradient (the groups split the inner size); and Hugging Face's custom op, forward
    and backward (two grouped matmuls as large)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.integrations import moe  # noqa: F401  registers its custom ops

    grouped = flop_formulas()[torch.ops.aten._grouped_mm]
    assert grouped((12, 8), (4, 8, 6), out_shape=(12, 6)) == 2 * 12 * 8 * 6
    assert grouped((4, 3, 8), (4, 8, 6), out_shape=(4, 3, 6)) == 2 * 4 * 3 * 8 * 6
    assert grouped((6, 12), (12, 8), out_shape=(4, 6, 8)) == 2 * 6 * 12 * 8
    tokens, weight = torch.randn(12, 8, requires_grad=True), torch.randn(4, 8, 6)
    offsets = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        torch.ops.transformers.grouped_mm_fallback(tokens, weight, offsets).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 12 * 8 * 6
