"""Parsing and printing of bytes, rates and times; one place for unit conventions.

Memory sizes and rates are written with an explicit unit, so that nobody has to guess
whether "40G" means 40 * 10**9 or 40 * 2**30 bytes:

- binary suffixes: ``KiB MiB GiB TiB`` ("80GiB" = 80 * 2**30 bytes), the way nvidia-smi
  and torch.cuda count memory;
- decimal (SI) suffixes: ``kB KB MB GB TB`` ("80GB" = 80 * 10**9 bytes), the way vendors
  quote memory and bandwidth;
- ``B`` or no suffix: bytes. Plain numbers (int or float) are bytes too.

A bare prefix (``"40G"``, ``"512M"``, ``"1T"``) is refused as ambiguous, with a message
suggesting GiB or GB; so is a lower-case ``b`` after a decimal prefix (``"400Gb/s"``), which
reads as bits. Prefixes and the ``i`` are case-insensitive ("gib", "Gib" and "GiB" agree).
Rates append ``/s`` ("900GB/s" = 9e11 bytes per second). Every value must be finite and
not negative; what counts as too small (zero memory, zero bandwidth) is the caller's
check, which names its field. Printing uses binary units for memory.
"""

from __future__ import annotations

import math
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)
_EXAMPLES = "write e.g. '80GiB' (2**30 bytes each), '40GB' (10**9 bytes each) or a number of bytes"


def _multiplier(text: str, number: str, suffix: str) -> int:
    """Bytes per unit of ``suffix``; a ValueError that says why for anything else."""
    if suffix in ("", "b", "B"):
        return 1
    prefix, unit = suffix[:-1].lower(), suffix[-1]
    if prefix in _BINARY and unit in "bB":
        return _BINARY[prefix]
    if prefix in _DECIMAL and unit == "B":
        return _DECIMAL[prefix]
    if suffix.lower() in _DECIMAL or prefix in _DECIMAL and unit == "b":
        letter = (suffix if suffix.lower() in _DECIMAL else prefix).upper()
        binary, decimal = _BINARY[letter.lower() + "i"], _DECIMAL[letter.lower()]
        why = "is ambiguous" if suffix.lower() in _DECIMAL else "reads as bits"
        raise ValueError(f"{text!r} {why}: write '{number}{letter}iB' (units of "
                         f"2**{binary.bit_length() - 1} bytes) or '{number}{letter}B' "
                         f"(units of 10**{len(str(decimal)) - 1} bytes)")
    raise ValueError(f"cannot read {text!r} as a size: {_EXAMPLES}")


def _check_number(value: float, text: object) -> float:
    if not math.isfinite(value):
        raise ValueError(f"a size must be finite, got {text!r}")
    if value < 0:
        raise ValueError(f"a size cannot be negative, got {text!r}")
    return value


def parse_bytes(value: int | float | str) -> int:
    """``"80GiB"`` → 85899345920; numbers pass through as bytes (see the module docstring)."""
    if isinstance(value, bool):
        raise TypeError("a size cannot be a bool")
    if isinstance(value, (int, float)):
        return int(_check_number(float(value), value))
    if not isinstance(value, str):
        raise TypeError(f"a size must be a number or a string like '80GiB', "
                        f"got {type(value).__name__}")
    match = _NUMBER.match(value)
    if not match:
        raise ValueError(f"cannot read {value!r} as a size: {_EXAMPLES}")
    number = _check_number(float(match.group(1)), value)
    return int(number * _multiplier(value, match.group(1), match.group(2)))


def parse_rate(value: int | float | str) -> float:
    """``"900GB/s"`` → 9e11 bytes/s; numbers pass through as bytes/s."""
    if isinstance(value, str):
        return float(parse_bytes(value.strip().removesuffix("/s").removesuffix("/S")))
    return float(parse_bytes(value))   # whole bytes per second, as sizes


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
