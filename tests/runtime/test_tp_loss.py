"""The loss over vocabulary-sharded logits (``partc.runtime.tp_loss``): on gloo ranks, each
rank holding its slice of the classes, the user's loss gives the value torch gives on the
whole logits and each rank the gradient of its slice, for the losses language models
write (a GPT's flattened cross entropy, Hugging Face's shifted sum, ``nn.CrossEntropyLoss``
with label smoothing over classes in dim 1, ignored positions, every reduction, PaLM's
z-loss beside a cross entropy, ``nll_loss`` of ``log_softmax``) and for a
loss the mode cannot follow (it gathers and stays right); what the probe accepts."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import pytest
from torch import nn

from partc.runtime import topology
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.tp_loss import (ShardedLossError, VocabParallelLoss, _index_keeps,
                                   _local_sizes, probe)

VOCAB = 48


class Call(nn.Module):
    """Stands for ``passes/trace.LossCall``: the loss of one output leaf and the target."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, logits, target):
        return self.fn(logits, target)


def gpt(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def hugging_face(logits, target):
    shifted = target[:, 1:]
    count = (shifted != -100).sum()
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), shifted.reshape(-1),
                           ignore_index=-100, reduction="sum") / count


def smoothed(logits, target):
    return nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=3)(
        (logits * 0.5).transpose(1, 2), target.masked_fill(target == -100, 3))


def per_position(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").sum()


def z_loss(logits, target):
    """PaLM's auxiliary loss beside the cross entropy: the log-partition squared."""
    return gpt(logits, target) + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()


def nll_of_log_softmax(logits, target):
    """The older spelling, classes in dim 1: log-probabilities, then their negative pick."""
    scores = F.log_softmax(logits.transpose(1, 2), dim=1)
    return F.nll_loss(scores, target, reduction="sum") / target.numel()


def entropy_too(logits, target):
    """A loss the mode cannot follow all the way: the entropy term gathers the logits."""
    probs = logits.softmax(-1)
    return gpt(logits, target) - 0.01 * (probs * probs.clamp_min(1e-9).log()).sum(-1).mean()


LOSSES = {"gpt": gpt, "hugging_face": hugging_face, "smoothed": smoothed,
          "per_position": per_position, "z_loss": z_loss,
          "nll_of_log_softmax": nll_of_log_softmax, "entropy_too": entropy_too}


def _cases(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, VOCAB, dtype=dtype) * 3
    target = torch.randint(0, VOCAB, (3, 5))
    target[0, 2] = -100
    target[1, 4] = 3
    return logits, target


def _worker(rank: int, world: int, path: str, failures) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        _losses_agree(rank, world)
    except AssertionError as error:
        failures.append(f"rank {rank}: {error!r}")
        raise
    finally:
        # The groups went with the helper's frame: leaving joins their gloo
        # threads before the interpreter shuts down.
        topology.leave()


def _losses_agree(rank: int, world: int) -> None:
    """``_worker``'s checks, in a frame of their own: the groups they hold go when it
    returns."""
    group = TensorParallelGroup(world, dist.group.WORLD)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        for name, fn in LOSSES.items():
            logits, target = _cases(dtype)
            whole = logits.clone().requires_grad_()
            expected = fn(whole, target)
            expected.backward()
            width = VOCAB // world
            part = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_()
            # Hugging Face's loss and the z-loss compute in fp32 whatever comes in.
            close = max(tolerance, 1e-5) if name in ("hugging_face", "z_loss") \
                else tolerance
            loss = VocabParallelLoss(group, Call(fn), 0)
            got = loss(part, target)
            got.backward()
            torch.testing.assert_close(got, expected, rtol=close, atol=close)
            torch.testing.assert_close(
                part.grad, whole.grad[..., rank * width:(rank + 1) * width],
                rtol=close, atol=close)
            gathered = 1 if name == "entropy_too" else 0
            cross_entropies = 0 if name == "nll_of_log_softmax" else 1
            assert (loss.gathered, loss.cross_entropies) == (gathered, cross_entropies), name


@pytest.mark.parametrize("world", [2, 3])
def test_the_sharded_loss_equals_the_whole_one_with_each_rank_its_slice_of_the_gradient(
        tmp_path, world):
    failures = mp.Manager().list()
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), failures), nprocs=world)
    assert not failures


def test_the_probe_accepts_losses_it_follows_to_a_cross_entropy_and_nothing_else():
    shapes = [torch.empty(3, 5, VOCAB), torch.zeros(3, 5, dtype=torch.long)]
    # Per cross entropy two all-reduces: the maximum of each of the 15 positions (fp32),
    # then the sums of exponentials and the target logits (and, smoothing, of the logits).
    plain = (("all_reduce", "forward", 4 * 15), ("all_reduce", "forward", 8 * 15))
    for name in ("gpt", "per_position"):
        assert probe(Call(LOSSES[name]), shapes, 0, 4) == plain, name
    shifted = (("all_reduce", "forward", 4 * 12), ("all_reduce", "forward", 8 * 12))
    assert probe(Call(hugging_face), shapes, 0, 4) == shifted
    assert probe(Call(smoothed), shapes, 0, 4) == (("all_reduce", "forward", 4 * 15),
                                                   ("all_reduce", "forward", 12 * 15))
    # The z-loss's logsumexp: each position's maximum, then its sum of exponentials.
    assert probe(Call(z_loss), shapes, 0, 4) == plain + (("all_reduce", "forward", 60),) * 2
    # log_softmax: the maximum and the sum forward, the sum's gradient backward; then the
    # picked log-probability of each position.
    assert probe(Call(nll_of_log_softmax), shapes, 0, 4) == (
        ("all_reduce", "forward", 60), ("all_reduce", "forward", 60),
        ("all_reduce", "backward", 60), ("all_reduce", "forward", 60))
    twice = lambda x, t: gpt(x, t) + gpt(x[:, 1:], t[:, 1:])  # noqa: E731
    assert len(probe(Call(twice), shapes, 0, 4)) == 4
    assert probe(Call(entropy_too), shapes, 0, 4) is None
    assert probe(Call(gpt), shapes, 0, 5) is None          # 48 classes, not in 5
    assert probe(Call(lambda x, t: (x - t).pow(2).mean()), shapes, 0, 2) is None
    weighted = lambda x, t: F.cross_entropy(x.reshape(-1, VOCAB), t.reshape(-1),  # noqa: E731
                                            weight=torch.ones(VOCAB))
    assert probe(Call(weighted), shapes, 0, 2) is None


def test_a_loss_that_changes_its_slice_in_place_is_refused():
    def masks_in_place(logits, target):
        logits[..., 0] = -1e4
        return gpt(logits, target)

    loss = VocabParallelLoss(TensorParallelGroup(2), Call(masks_in_place), 0)
    with pytest.raises(ShardedLossError, match="in place"):
        loss(torch.randn(3, 5, VOCAB // 2), torch.zeros(3, 5, dtype=torch.long))
    assert probe(Call(masks_in_place), [torch.empty(3, 5, VOCAB),
                                        torch.zeros(3, 5, dtype=torch.long)], 0, 2) is None


def test_reshapes_and_indexing_keep_the_class_dim_only_where_it_stays_whole():
    whole = torch.Size([2, 5, 48])
    assert _local_sizes(whole, 2, [-1, 48], 4) == ([10, 12], 1)
    assert _local_sizes(whole, 2, [2, 5, 6, 8], 4) is None     # the classes split
    assert _local_sizes(whole, 2, [2, 240], 4) is None         # merged with positions
    assert _local_sizes(torch.Size([2, 48, 5]), 1, [2, 48, 5], 4) == ([2, 12, 5], 1)
    assert _index_keeps((slice(None), slice(None, -1)), 2, 3) == 2
    assert _index_keeps((Ellipsis, 0, slice(None)), 2, 3) == 1
    assert _index_keeps((None, 0), 2, 3) == 2
    assert _index_keeps((Ellipsis, slice(0, 3)), 2, 3) is None
    assert _index_keeps((slice(None), torch.tensor([0])), 2, 3) is None


def test_hooks_and_storages_asked_of_the_slice_are_the_slices():
    """What autograd and memory tools ask inside the loss (a module hook registering a
    gradient hook, a tracker reading storages) is the slice's: nothing is gathered."""
    seen = []

    def hooked(logits, target):
        logits.register_hook(lambda grad: seen.append(tuple(grad.shape)))
        seen.append(logits.untyped_storage().nbytes())
        return gpt(logits, target)

    loss = VocabParallelLoss(TensorParallelGroup(2), Call(hooked), 0)
    part = torch.randn(3, 5, VOCAB // 2, requires_grad=True)
    loss(part, torch.zeros(3, 5, dtype=torch.long)).backward()
    assert (loss.gathered, loss.cross_entropies) == (0, 1)
    assert seen == [part.untyped_storage().nbytes(), (3, 5, VOCAB // 2)]
