"""Parsing and printing of bytes, rates and times; one place for unit conventions.

Memory sizes accept SI ("80GB" = 80e9 bytes) and binary ("80GiB" = 80 * 2**30) suffixes;
rates likewise ("900GB/s"). Printing uses binary units for memory, as nvidia-smi and
torch.cuda do.
"""

from __future__ import annotations

import re

_SUFFIXES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*(/s)?\s*$", re.I)


def parse_bytes(value: int | float | str) -> int:
    """``"80GiB"`` → 85899345920; numbers pass through as bytes."""
    if isinstance(value, bool):
        raise TypeError("a size cannot be a bool")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return int(value)
    match = _NUMBER.match(value)
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(
            f"cannot read {value!r} as a size: write e.g. '80GiB', '40GB' or a number of bytes"
        )
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])


def parse_rate(value: int | float | str) -> float:
    """``"900GB/s"`` → 9e11 bytes/s; numbers pass through as bytes/s."""
    if isinstance(value, str):
        return float(parse_bytes(value.strip().removesuffix("/s").removesuffix("/S")))
    return float(parse_bytes(value))


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def format_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
