"""Memory sizes: parsing `40GiB`-style strings, printing byte counts, and the KV-cache budget
left on a GPU once the weights are loaded."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

from hybrid_kv.planner.errors import PlanError

__all__ = ["format_bytes", "format_bytes_at_least", "kv_cache_budget", "parse_memory"]

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNIT_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_memory(text: str | int) -> int:
    """Bytes in a memory size: `"40GiB"`, `"512MiB"`, `"80GB"`, `"1.5TiB"`, `"4096B"`.

    `KiB/MiB/GiB/TiB` (and the bare `K/M/G/T`) are powers of 1024; `KB/MB/GB/TB` are powers
    of 1000; `B` is bytes. A string needs a unit (`"40"` is refused with a suggestion, since
    40 bytes is never what was meant); an `int` is a byte count.
    """
    if isinstance(text, bool):
        raise PlanError(f"memory size must be a string or int, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise PlanError(f"memory size must be > 0, got {text}")
        return text
    if not isinstance(text, str):
        raise PlanError(f"memory size must be a string or int, got {text!r}")
    if text.strip().startswith("-"):
        raise PlanError(f"memory size must be positive, got {text!r}")
    match = _MEMORY_RE.match(text)
    if match is None:
        raise PlanError(
            f"bad memory size {text!r}: expected a number with a unit, e.g. 40GiB, 512MiB, 80GB"
        )
    number, prefix, binary, byte_suffix = match.groups()
    prefix = prefix.lower()
    if not prefix and not binary and not byte_suffix:
        if Fraction(number) == 0:
            # No unit makes a size of nothing: say what is wrong, not which unit to add.
            raise PlanError(f"memory size must be positive, got {text!r}")
        raise PlanError(
            f"memory size {text!r} has no unit: write {number}GiB (or {number}GB, {number}MiB; "
            f"{number}B for bytes)"
        )
    if binary and not prefix:
        raise PlanError(f"bad memory size {text!r}: 'i' needs a unit prefix (KiB, MiB, GiB)")
    decimal = bool(byte_suffix) and not binary and bool(prefix)
    base = 1000 if decimal else 1024
    if len(number) > 100:
        # A size of more than 100 digits is no memory size (and Python's int parsing stops at
        # 4300 digits with its own error).
        raise PlanError(f"bad memory size {text[:40]!r}...: more than 100 digits")
    value = Fraction(number) * base ** _UNIT_POWERS[prefix]
    result = math.floor(value)
    if result <= 0:
        raise PlanError(f"memory size must be at least one byte, got {text!r}")
    return result


def format_bytes(num_bytes: int) -> str:
    """Human-readable binary size: `1.50 GiB` (rounded half to even, as a float's `.2f` rounds;
    exact, so sizes past a float's range are written too)."""
    return _format_binary(num_bytes, round)


def _format_binary(num_bytes: int, hundredths_of: Callable[[Fraction], int]) -> str:
    """`num_bytes` in the largest binary unit (up to TiB) that keeps it from 1 up, with two
    decimals rounded by `hundredths_of` (a hundredth's count from the exact value)."""
    value = Fraction(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{round(value)} {unit}"
            hundredths = hundredths_of(value * 100)
            sign = "-" if hundredths < 0 else ""
            whole, cents = divmod(abs(hundredths), 100)
            return f"{sign}{whole}.{cents:02d} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int, noun: str) -> str:
    """`n noun`, the noun plural unless `n` is one: `1 group`, `7 groups`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_bytes_at_least(num_bytes: int) -> str:
    """`format_bytes` rounded up instead of to nearest: a size `--memory` takes that holds
    `num_bytes` (to advise a budget: `16.00 GiB` would be short of 16.002 GiB)."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    return _format_binary(num_bytes, math.ceil)


def kv_cache_budget(gpu_memory_bytes: int, utilization: float, weight_bytes: int) -> int:
    """Bytes left for the KV cache on one GPU, as vLLM sizes it: `ceil(gpu * utilization)`
    minus the weights this rank holds. Activation peaks, CUDA graphs and the non-torch
    allocations vLLM also measures at start-up are not modelled: the real budget is smaller.

    Raises `PlanError` when the GPU memory or the weights are not a positive int byte count,
    the utilisation is outside (0, 1], or the weights do not fit. The budget is never more than
    `gpu * utilization`.
    """
    for name, value in (("gpu memory", gpu_memory_bytes), ("weights", weight_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{name} must be an int byte count, got {value!r}")
        if value <= 0:
            raise PlanError(f"{name} must be > 0 bytes, got {value}")
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
        raise PlanError(f"gpu memory utilization must be a number, got {utilization!r}")
    if not 0 < utilization <= 1:
        raise PlanError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    # Exact: a float product rounds, and overflows for byte counts past 1e308.
    requested = math.ceil(gpu_memory_bytes * Fraction(str(float(utilization))))
    budget = requested - weight_bytes
    if budget <= 0:
        raise PlanError(
            f"the weights ({format_bytes(weight_bytes)} per GPU) do not fit in "
            f"{utilization:g} x {format_bytes(gpu_memory_bytes)} = {format_bytes(requested)}; "
            "raise --gpu-memory-utilization or --tensor-parallel-size"
        )
    return budget
