"""The README's Python examples run as printed (a new user copies them), against the installed
package: each block in a fresh namespace; torch's on "meta" where the README names a GPU (the
plan's 24 GiB then allocates nothing). What their comments say they print or return is checked
too."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks, "README.md has no ```python blocks"
    return blocks


def _run(code: str) -> tuple[dict[str, object], str]:
    namespace: dict[str, object] = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    return namespace, out.getvalue()


def _block(needle: str) -> str:
    (block,) = [b for b in _python_blocks() if needle in b]
    return block


def test_every_python_block_is_one_of_those_run_here() -> None:
    needles = ("hk.KVCacheManager(", "hk.BlockPool(", "plan_kv_cache(load_model(")
    assert all(any(n in b for n in needles) for b in _python_blocks())


def test_the_manager_example_runs_and_probes_what_it_says() -> None:
    block = _block("hk.KVCacheManager(")
    said = re.search(r"^manager\.probe\(.*\)\s+# (\d+):", block, flags=re.M)
    assert said, "the example's probe line says what it returns"
    # The last line's value is what the README states.
    probe_line = said.group(0).split("#")[0].strip()
    namespace, _ = _run(block)
    assert eval(probe_line, namespace) == int(said.group(1))  # noqa: S307
    table = namespace["block_table"]
    assert table[0, 0] > 0  # the batch call filled the request's row


def test_the_block_pool_example_runs() -> None:
    namespace, _ = _run(_block("hk.BlockPool("))
    hashes = namespace["hashes"]
    assert hashes.shape == (6, 2) and str(hashes.dtype) == "uint64"  # as its comment says
    assert namespace["hit"] == namespace["blocks"][0]


def test_the_planner_example_prints_its_summary_line() -> None:
    pytest.importorskip("torch", reason="the example allocates torch buffers")
    block = _block("plan_kv_cache(load_model(")
    said = re.search(r"print\(plan\.summary_line\(\)\)\s+# (.*?) \.\.\.", block)
    assert said, "the example's print line says what it prints"
    assert '"cuda"' in block
    block = block.replace('"cuda"', '"meta"')
    namespace, out = _run(block)
    assert out.startswith(said.group(1)), out
    assert len(namespace["views"]) == 62  # Gemma-3-27B's layers
