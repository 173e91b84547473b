"""The JSON files the command line reads (workloads, kvtrace/1 traces, `--lengths` files), plain
or gzip-compressed, read as text of at most `MAX_INPUT_CHARS` characters: a few megabytes of
gzip can expand to gigabytes (a gzip bomb), which would be read into memory before parsing. The
conformance workloads and traces are under 10 MB of text each; 256 MiB leaves room for far
larger ones."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["MAX_INPUT_CHARS", "InputTooLargeError", "open_text", "read_lines", "read_text"]

MAX_INPUT_CHARS = 1 << 28
"""The most characters read from one input file (after decompression)."""


class InputTooLargeError(ValueError):
    """An input file holding more than `MAX_INPUT_CHARS` characters (after decompression); the
    message leaves the file's name to the caller, as `OSError`'s and `json`'s do."""

    def __init__(self, path: str | Path) -> None:
        compressed = " once decompressed" if _is_gzip(path) else ""
        super().__init__(
            f"more than {MAX_INPUT_CHARS:,} characters{compressed}, more than hybrid-kv reads "
            "from one input file"
        )


def _is_gzip(path: str | Path) -> bool:
    return str(path).endswith(".gz")


def open_text(path: str | Path) -> IO[str]:
    """`path` opened for reading as UTF-8 text, decompressed when its name ends in `.gz`."""
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 (the caller closes it)


def read_text(path: str | Path) -> str:
    """The whole text of `path`; `InputTooLargeError` past `MAX_INPUT_CHARS` characters, found
    without reading more than one character past them."""
    limit = MAX_INPUT_CHARS
    with open_text(path) as f:
        text = f.read(limit + 1)
    if len(text) > limit:
        raise InputTooLargeError(path)
    return text


def read_lines(path: str | Path) -> Iterator[str]:
    """The lines of `path` in turn; `InputTooLargeError` once they pass `MAX_INPUT_CHARS`
    characters (a line is never read further than that)."""
    remaining = MAX_INPUT_CHARS
    with open_text(path) as f:
        while line := f.readline(remaining + 1):
            remaining -= len(line)
            if remaining < 0:
                raise InputTooLargeError(path)
            yield line
