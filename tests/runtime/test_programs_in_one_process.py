"""Several programs in one process train as each trains alone (nothing partc sets up for
one program changes another's run).

Under torchrun with 2 processes, a tp=2 GPT, a pp=2 GPT and a tp=2 Llama with sequence
parallelism are compiled and built one after the other, then each is trained in turn
(3 SGD steps) against one process. Seen before the tensor-parallel group was the
program's own: building a program without tensor parallelism cleared a process-wide
group, and the tp=2 program built before it then ran its collectives as a group of one
(its first step failed in pipelining's shape inference).
"""

from __future__ import annotations

import pytest

from .test_parity import check_parity, launched

PROGRAMS = ["gpt-tp2", "gpt-pp2-1f1b", "llama-tp2-sp"]
TOGETHER = "+".join(PROGRAMS)

together = launched("together", 2, [TOGETHER])


@pytest.mark.reads(TOGETHER)   # (the programs' names are other launches' cases)
@pytest.mark.parametrize("name", PROGRAMS)
def test_each_program_trains_as_it_does_alone(together, name):
    ranks = []
    for rank, results in enumerate(together):
        seen = results[TOGETHER]
        assert "error" not in seen, f"rank {rank}: {seen.get('traceback', seen.get('error'))}"
        ranks.append(seen)
    check_parity(ranks, name)
    for rank, seen in enumerate(ranks):
        # Each program counts the collectives of its own group only.
        result = seen[name]
        assert result["collectives"] == result["planned_collectives"], (rank, name)
