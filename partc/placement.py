"""How a tensor is laid out over a tensor-parallel group, in DTensor's words.

The planner writes these into the plan, the sharding pass chooses them, the runtime
reads them to slice and gather whole parameters: one type for all three.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Placement:
    """``Replicate()``, ``Shard(dim)`` / ``Shard(dim, chunks=k)`` or ``Partial()`` (sum)."""

    kind: str  # "R", "S", "P", or "*" (an input read only for its dtype and device)
    dim: int = -1
    chunks: int = 1

    def __str__(self) -> str:
        if self.kind == "R":
            return "Replicate()"
        if self.kind == "P":
            return "Partial()"
        if self.kind == "*":
            return "Any()"
        return (f"Shard({self.dim})" if self.chunks == 1
                else f"Shard({self.dim}, chunks={self.chunks})")

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @staticmethod
    def parse(text: str) -> "Placement":
        text = text.strip()
        if text == "Replicate()":
            return REPLICATE
        if text == "Partial()":
            return PARTIAL
        if text.startswith("Shard(") and text.endswith(")"):
            inner = text[len("Shard("):-1].split(",")
            chunks = int(inner[1].split("=")[1]) if len(inner) > 1 else 1
            return Shard(int(inner[0]), chunks)
        raise ValueError(f"not a placement: {text!r}")


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def Shard(dim: int, chunks: int = 1) -> Placement:  # noqa: N802 (DTensor's spelling)
    return Placement("S", dim, chunks)
