"""partc.codec on hand-built dataclasses: what each annotation and field policy writes,
that it reads back equal, and that a wrong value is refused naming its field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from partc.codec import (NONE_AS_EMPTY, UNLESS_DEFAULT, CodecError, as_list, check, from_data,
                         own_form, to_data)
from partc.names import Phase, Recompute, Schedule
from partc.placement import REPLICATE, Placement, Shard


@as_list
@dataclass(frozen=True, kw_only=True)
class Move:
    kind: str
    phase: Phase
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Inner:
    size: int


@own_form
@dataclass(frozen=True, kw_only=True)
class Sizes:
    sizes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": ",".join(map(str, self.sizes))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sizes":
        return cls(sizes=tuple(int(s) for s in data["sizes"].split(",")))


@dataclass(frozen=True, kw_only=True)
class Record:
    schedule: Schedule
    modes: dict[str, Recompute]
    dtype: torch.dtype
    params: dict[str, Placement]
    moves: tuple[Move, ...]
    sizes: Sizes
    inner: Inner | None = field(default=None, metadata=NONE_AS_EMPTY)
    extra: int = field(default=1, metadata=UNLESS_DEFAULT)
    note: str | None = None


RECORD = Record(schedule=Schedule.ONE_F_ONE_B, modes={"blocks.0": Recompute.FULL},
                dtype=torch.bfloat16, params={"w": Shard(0), "b": REPLICATE},
                moves=(Move(kind="all_reduce", phase=Phase.FORWARD, nbytes=8),),
                sizes=Sizes(sizes=(1, 2)))
DATA = {"schedule": "1f1b", "modes": {"blocks.0": "full"}, "dtype": "bfloat16",
        "params": {"w": "Shard(0)", "b": "Replicate()"}, "moves": [["all_reduce", "forward", 8]],
        "sizes": {"sizes": "1,2"}, "inner": {}, "note": None}


def test_each_annotation_is_written_as_plain_json_and_read_back_equal():
    assert to_data(RECORD) == DATA
    back = from_data(Record, DATA)
    assert back == RECORD and back.schedule is Schedule.ONE_F_ONE_B
    assert back.modes["blocks.0"] is Recompute.FULL and back.moves[0].phase is Phase.FORWARD
    check(back, Record)


def test_field_policies_keep_the_older_form():
    both = Record(**{**RECORD.__dict__, "inner": Inner(size=3), "extra": 2})
    data = to_data(both)
    assert data["inner"] == {"size": 3} and data["extra"] == 2
    assert from_data(Record, data) == both
    assert "extra" not in DATA and from_data(Record, DATA).extra == 1


@pytest.mark.parametrize("change, where, says", [
    ({"schedule": "2f2b"}, "schedule", "unknown schedule '2f2b'"),
    ({"modes": {"blocks.0": "most"}}, "modes.blocks.0", "unknown recompute 'most'"),
    ({"dtype": "float7"}, "dtype", "not a torch dtype"),
    ({"params": {"w": "Sharded"}}, "params.w", "not a placement"),
    ({"moves": [["all_reduce", "forward"]]}, "moves[0]", "a list of 3 items"),
    ({"cp": 2}, "cp", "unknown key"),
])
def test_a_wrong_value_is_refused_naming_its_field(change, where, says):
    with pytest.raises(CodecError, match=says) as caught:
        from_data(Record, {**DATA, **change})
    assert caught.value.field == where


def test_check_wants_the_enum_not_its_string():
    with pytest.raises(CodecError, match="expected Schedule") as caught:
        check(Record(**{**RECORD.__dict__, "schedule": "1f1b"}), Record)
    assert caught.value.field == "schedule"


def test_names_are_their_strings():
    assert Schedule.ONE_F_ONE_B == "1f1b" and f"{Schedule.GPIPE}" == str(Schedule.GPIPE) == "gpipe"
    assert {"full": 1}[Recompute.FULL] == 1 and Recompute("none") is Recompute.NONE


def test_a_list_record_leaves_off_its_trailing_defaults_and_reads_without_them():
    """A pipeline run's times (``RunTime``) gained two delays after plans were written:
    at 0 they are left off, so such files read and write as before; a delay that is not
    0 is written with whatever precedes it; fewer items than the fields without
    defaults are refused."""
    from partc.plan import RunTime

    old = [1.0, 2.0, 0.0, 0.5, 0.25]
    assert to_data(from_data(RunTime, old)) == old
    delayed = RunTime(forward=1.0, backward=2.0, recompute=0.0, send=0.0, receive=0.0,
                      receive_delay=0.5)
    assert to_data(delayed) == [1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    assert from_data(RunTime, to_data(delayed)) == delayed
    with pytest.raises(CodecError, match="expected a list of 7 items"):
        from_data(RunTime, [1.0, 2.0])
