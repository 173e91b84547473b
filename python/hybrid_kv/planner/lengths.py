"""Request-length distributions the min-waste search optimises over.

Waste at one length is the wrong objective when lengths vary: a grouping that is tight at 1k
tokens can waste far more at 128k. The planner therefore minimises the expected waste of the
requests resident in the pool, with lengths drawn from a `LengthDistribution`:

* `default(max_model_len)`: log-uniform over `128 .. max_model_len` (every power of two and
  the point halfway to the next, plus `max_model_len`, equally weighted): short chat turns
  and long documents alike, as a serving deployment sees them when nothing else is known;
* `point(n)`: every request has `n` tokens (`--reference-len`);
* `parse("1024:5,8192:2,128K:1")`: a histogram of lengths and counts (`--lengths`), the
  lengths read as vLLM reads token counts (`parse_token_count`);
* `load(path)`: a workload (`{"requests": [{"prompt": [...], "output": [...]}]}`, `.json` or
  `.json.gz`) or a `kvtrace/1` trace (`req` records), each request counted at its prompt +
  output length.
"""

from __future__ import annotations

import bisect
import json
import math
import operator
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from hybrid_kv.inputs import InputTooLargeError, read_text
from hybrid_kv.planner.errors import PlanError

__all__ = ["MAX_POINTS", "LengthDistribution", "parse_token_count"]

MAX_POINTS = 512
"""Distinct lengths kept; larger samples are binned by quantile (each bin at its median)."""

_SHORTEST_DEFAULT = 128

_TOKEN_COUNT_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_token_count(text: str) -> int:
    """A token count as vLLM's `--max-model-len` and `--max-num-batched-tokens` read it
    (`human_readable_int`): an integer, or a number with a decimal suffix (`32k` = 32,000,
    `25.6k` = 25,600) or a whole number with a binary one (`32K` = 32,768). `ValueError`
    otherwise; range checks are the caller's."""
    value = text.strip()
    match = _TOKEN_COUNT_RE.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"not a token count: {text!r} (e.g. 32768, 32K = 32,768 or 32k = 32,000)"
            ) from None
    number, suffix = match.groups()
    if suffix in _BINARY_SUFFIXES:
        if "." in number:
            raise ValueError(
                f"{text!r}: no decimals with a binary suffix like {suffix} "
                f"(did you mean {number}{suffix.lower()}?)"
            )
        return int(number) * _BINARY_SUFFIXES[suffix]
    return math.floor(Fraction(number) * _DECIMAL_SUFFIXES[suffix])


@dataclass(frozen=True)
class LengthDistribution:
    """Request lengths (tokens) with integer weights (counts), sorted by length."""

    lengths: tuple[int, ...]
    weights: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.weights):
            raise PlanError("a length distribution needs at least one length and one weight each")
        for length, weight in zip(self.lengths, self.weights, strict=True):
            for name, value in (("length", length), ("weight", weight)):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise PlanError(f"request {name}s must be positive ints, got {value!r}")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise PlanError("lengths must be distinct and sorted")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_counts(cls, counts: Mapping[int, int], source: str) -> LengthDistribution:
        """From `{length: count}` (positive ints); more than `MAX_POINTS` lengths are binned by
        quantile."""
        if not isinstance(counts, Mapping):
            raise PlanError(f"counts must be a mapping of length to count, got {counts!r}")
        items = sorted(
            (_positive(length, "request lengths"), _positive(count, "counts"))
            for length, count in counts.items()
        )
        if len(items) > MAX_POINTS:
            items = _quantile_bins(items, MAX_POINTS)
        return cls(tuple(k for k, _ in items), tuple(v for _, v in items), source)

    @classmethod
    def point(cls, length: int) -> LengthDistribution:
        return cls((length,), (1,), f"every request {length} tokens")

    @classmethod
    def default(cls, max_model_len: int) -> LengthDistribution:
        lengths = {max_model_len}
        power = _SHORTEST_DEFAULT
        while power < max_model_len:
            lengths.add(power)
            if power * 3 // 2 < max_model_len:
                lengths.add(power * 3 // 2)
            power *= 2
        ordered = tuple(sorted(lengths))
        return cls(
            ordered,
            (1,) * len(ordered),
            f"log-uniform {ordered[0]}..{max_model_len} tokens ({len(ordered)} lengths)",
        )

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], source: str) -> LengthDistribution:
        """From request lengths (ints; those below 1 are left out)."""
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
            raise PlanError(f"lengths must be an iterable of ints, got {lengths!r}")
        counts = Counter(n for n in (_int(n, "request lengths") for n in lengths) if n > 0)
        if not counts:
            raise PlanError(f"{source}: no request with a positive length")
        return cls.from_counts(counts, source)

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """`"1024:5,8K:2"` (length:count pairs, lengths as `parse_token_count` reads them; a
        bare length counts once) or a file path."""
        if not isinstance(text, str) or not text.strip():
            raise PlanError("--lengths needs LENGTH:COUNT pairs or a workload/trace file")
        path = Path(text)
        try:
            exists = path.exists()
        except (OSError, ValueError):
            # A histogram longer than a file name can be (or holding a NUL): not a file.
            exists = False
        if path.suffix in (".json", ".gz", ".jsonl") or exists:
            return cls.load(path)
        counts: Counter[int] = Counter()
        for part in text.split(","):
            length, _, count = part.strip().partition(":")
            try:
                value = parse_token_count(length)
                weight = int(count) if count else 1
            except ValueError:
                raise PlanError(
                    f"bad --lengths entry {part.strip()!r}: expected LENGTH:COUNT, e.g. 4096:3 "
                    "or 4K:3"
                ) from None
            if value <= 0 or weight <= 0:
                raise PlanError(f"bad --lengths entry {part.strip()!r}: values must be positive")
            counts[value] += weight
        return cls.from_counts(counts, f"histogram {text}")

    @classmethod
    def load(cls, path: str | Path) -> LengthDistribution:
        """Prompt + output lengths of a workload JSON or a kvtrace/1 trace."""
        path = Path(path)
        if not path.exists():
            raise PlanError(f"no such file: {path}")
        if not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file"
            raise PlanError(f"--lengths {path} is {what}")
        try:
            text = read_text(path)
        except (OSError, EOFError, UnicodeDecodeError, InputTooLargeError, zlib.error) as error:
            # EOFError: a gzip file cut short.
            raise PlanError(f"cannot read {path}: {error}") from None
        lengths = _lengths_from_text(text, path)
        return cls.from_lengths(lengths, f"{path.name} ({len(lengths)} requests)")

    # ------------------------------------------------------------------ use

    def clipped(self, max_model_len: int) -> LengthDistribution:
        """Lengths above `max_model_len` counted at `max_model_len` (the engine stops there)."""
        if self.lengths[-1] <= max_model_len:
            return self
        counts: Counter[int] = Counter()
        for length, weight in zip(self.lengths, self.weights, strict=True):
            counts[min(length, max_model_len)] += weight
        return LengthDistribution.from_counts(counts, self.source + f", clipped at {max_model_len}")

    @property
    def total_weight(self) -> int:
        return sum(self.weights)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "lengths": list(self.lengths),
            "weights": list(self.weights),
        }


def _int(value: object, what: str) -> int:
    """`value` as an int: Python and numpy integers (not bools, floats or strings)."""
    if isinstance(value, bool):
        raise PlanError(f"{what} must be ints, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PlanError(f"{what} must be ints, got {value!r}") from None


def _positive(value: object, what: str) -> int:
    number = _int(value, what)
    if number <= 0:
        raise PlanError(f"{what} must be positive, got {number}")
    return number


def _quantile_bins(items: list[tuple[int, int]], bins: int) -> list[tuple[int, int]]:
    """Merge sorted `(length, count)` items into `bins` bins of about equal weight, each bin
    at the length where its cumulative weight crosses half the bin."""
    total = sum(count for _, count in items)
    cumulative = []
    running = 0
    for _, count in items:
        running += count
        cumulative.append(running)
    merged: Counter[int] = Counter()
    start = 0
    for b in range(bins):
        end_weight = total * (b + 1) // bins
        end = bisect.bisect_left(cumulative, end_weight, lo=start) + 1
        end = min(max(end, start + 1), len(items))
        chunk = items[start:end]
        if not chunk:
            break
        weight = sum(count for _, count in chunk)
        half = weight / 2
        seen = 0
        for length, count in chunk:
            seen += count
            if seen >= half:
                merged[length] += weight
                break
        start = end
        if start >= len(items):
            break
    if start < len(items):  # rounding left a tail: fold it into the last bin
        tail = items[start:]
        merged[tail[len(tail) // 2][0]] += sum(count for _, count in tail)
    return sorted(merged.items())


def _lengths_from_text(text: str, path: Path) -> list[int]:
    try:
        try:
            documents = [json.loads(text)]
        except json.JSONDecodeError:
            try:
                documents = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as error:
                raise PlanError(f"{path} is neither JSON nor JSON lines: {error}") from None
    except RecursionError:
        raise PlanError(f"{path}: not valid JSON (nested too deeply)") from None
    lengths: list[int] = []
    for document in documents:
        if not isinstance(document, dict):
            continue
        if isinstance(document.get("requests"), list):  # a workload
            for request in document["requests"]:
                if not isinstance(request, dict):
                    continue
                prompt, output = request.get("prompt"), request.get("output", [])
                if isinstance(prompt, list) and isinstance(output, list):
                    lengths.append(len(prompt) + len(output))
        elif document.get("kind") == "req":  # a kvtrace/1 request record
            prompt_len = document.get("num_prompt_tokens")
            max_tokens = document.get("max_tokens", 0)
            if isinstance(prompt_len, int) and isinstance(max_tokens, int):
                lengths.append(prompt_len + max_tokens)
    if not lengths:
        raise PlanError(
            f"{path}: no requests found (expected a workload with 'requests' holding "
            "'prompt' and 'output' lists, or kvtrace/1 'req' records)"
        )
    return lengths
