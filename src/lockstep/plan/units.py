"""Sizes, bandwidths, parameter counts and dtypes as people type them, and back to text.

The planner reads `80GB`, `80GiB`, `25Gbit/s`, `7B` (parameters) or `bf16` from the
command line and prints bytes the same way. Decimal prefixes are powers of 1000
(1 GB = 1e9 bytes, the unit of vendors' memory and link figures); binary ones
(KiB, MiB, GiB) are powers of 1024. A memory figure must carry its unit: `80` alone
is refused, because 80 what is exactly the mistake this tool exists to catch.
"""

from __future__ import annotations

import re
from enum import Enum

_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_NUMBER = r"(?P<num>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_SIZE_RE = re.compile(_NUMBER + r"\s*(?P<prefix>[KMGTP]i?)?(?P<unit>B)?$", re.IGNORECASE)
_RATE_RE = re.compile(
    _NUMBER + r"\s*(?P<prefix>[KMGTP]i?)?(?P<unit>B|bit|b)(?:/s|ps)$", re.IGNORECASE
)
_COUNT_RE = re.compile(_NUMBER + r"\s*(?P<suffix>[KMBGT])?$", re.IGNORECASE)
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}

SIZE_FORMS = "a number with a unit: 512B, 4KB, 80GB (1e9 bytes) or 80GiB (2**30 bytes)"
RATE_FORMS = "a rate with a unit: 100GB/s, 12.5GiB/s, 25Gbit/s or 25Gbps"
COUNT_FORMS = "a count: 7B, 7.5B, 125M, 4M, 350K or 7e9"


class DType(Enum):
    """Storage types the planner knows, with their size in bytes."""

    FP32 = ("fp32", 4)
    FP16 = ("fp16", 2)
    BF16 = ("bf16", 2)
    FP8 = ("fp8", 1)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def nbytes(self) -> int:
        return self.value[1]


_DTYPE_ALIASES = {
    "fp32": DType.FP32,
    "float32": DType.FP32,
    "float": DType.FP32,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "half": DType.FP16,
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp8": DType.FP8,
}


def _multiplier(prefix: str | None) -> int:
    prefix = (prefix or "").upper()
    return _BINARY[prefix] if prefix.endswith("I") else _DECIMAL[prefix]


def parse_bytes(text: str, arg: str, *, unit_required: bool = True) -> int:
    """Parse a positive byte size such as `80GB` or `4KiB`.

    Args:
        text: what the user typed.
        arg: the flag it came from, named in the error.
        unit_required: refuse a bare number (memory figures); bench sizes allow one.

    Returns:
        The size in bytes, rounded to an integer.

    Raises:
        ValueError: not a size, no unit where one is required, or not positive.
    """
    match = _SIZE_RE.match(text.strip())
    has_unit = bool(match and (match["prefix"] or match["unit"]))
    if match is None or (unit_required and not has_unit):
        raise ValueError(f"{arg} expects {SIZE_FORMS}; found {text!r}")
    value = float(match["num"]) * _multiplier(match["prefix"])
    if value < 1:
        raise ValueError(f"{arg} must be at least 1 byte; found {text!r}. Expected {SIZE_FORMS}")
    return round(value)


def parse_rate(text: str, arg: str) -> float:
    """Parse a positive bandwidth such as `100GB/s` or `25Gbit/s` into bytes per second.

    Raises:
        ValueError: not a rate, or not positive.
    """
    match = _RATE_RE.match(text.strip())
    if match is None:
        raise ValueError(f"{arg} expects {RATE_FORMS}; found {text!r}")
    value = float(match["num"]) * _multiplier(match["prefix"])
    if match["unit"] != "B":  # bits: `b`, `bit`, `Gbps`
        value /= 8
    if value <= 0:
        raise ValueError(f"{arg} must be positive; found {text!r}. Expected {RATE_FORMS}")
    return value


def parse_count(text: str, arg: str) -> int:
    """Parse a positive parameter count such as `7B` (billions) or `125M`.

    Raises:
        ValueError: not a count, or not positive.
    """
    match = _COUNT_RE.match(text.strip())
    if match is None:
        raise ValueError(f"{arg} expects {COUNT_FORMS}; found {text!r}")
    value = round(float(match["num"]) * _COUNT_SUFFIX[(match["suffix"] or "").upper()])
    if value < 1:
        raise ValueError(f"{arg} must be at least 1; found {text!r}. Expected {COUNT_FORMS}")
    return value


def looks_like_count(text: str) -> bool:
    """True when `text` reads as a parameter count (`7B`, `125M`, `7e9`)."""
    return _COUNT_RE.match(text.strip()) is not None


def parse_dtype(text: str, arg: str) -> DType:
    """Parse a dtype name (`fp32`, `bf16`, `float16`, ...).

    Raises:
        ValueError: an unknown name; the message lists the accepted ones.
    """
    dtype = _DTYPE_ALIASES.get(text.strip().lower())
    if dtype is None:
        names = ", ".join(d.label for d in DType)
        raise ValueError(f"{arg} expects one of {names}; found {text!r}")
    return dtype


def format_bytes(nbytes: float) -> str:
    """`56000000000` -> `56.0 GB` (decimal units, one decimal)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """Bytes per second as `300 GB/s`, or `3.1 GB/s`; three significant digits."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def format_seconds(seconds: float) -> str:
    """A duration as `12.3 ms`, `450 us`, `2.5 s` or `210 s` (three significant digits)."""
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def format_count(count: float) -> str:
    """A parameter count as `6.74B`, `4.19M`, `350K` (three significant digits)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.0f}"
