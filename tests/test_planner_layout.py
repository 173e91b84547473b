"""vLLM's six KV-cache layouts: byte strides of `[L, B, H, N, C]`, padded pages, refusals."""

from __future__ import annotations

import pytest
from hybrid_kv.planner import KV_CACHE_LAYOUTS, PlanError
from hybrid_kv.planner.layout import LayerShape, check_layout, place_groups

# Two layers, 3 blocks, 2 heads, 4 tokens, 8 bytes per head and token.
SHAPE = LayerShape(heads=2, tokens=4, content_bytes=8, page_bytes=64)
EXPECTED = {  # layer, block, head, token, byte strides
    "LBNHC": (192, 64, 8, 16, 1),
    "LBHNC": (192, 64, 32, 8, 1),
    "LHBNC": (192, 32, 96, 8, 1),
    "BLHNC": (64, 128, 32, 8, 1),
    "BLNHC": (64, 128, 8, 16, 1),
    "BHLNC": (32, 128, 64, 8, 1),
}


@pytest.mark.parametrize("layout", KV_CACHE_LAYOUTS)
def test_strides_follow_the_memory_order(layout: str) -> None:
    (run,) = place_groups([[("a", "x", SHAPE), ("b", "x", SHAPE)]], 3, layout)
    layer, block, head, token, byte = EXPECTED[layout]
    assert (run.layer_stride, run.block_stride) == (layer, block)
    assert run.view_strides == (block, head, token, byte)
    assert run.layer_offset(1) == layer


def test_a_padded_page_widens_the_block_step() -> None:
    padded = LayerShape(heads=1, tokens=1, content_bytes=40, page_bytes=64)
    (run,) = place_groups([[("m", "s", padded)]], 3, "LBNHC")
    assert run.block_stride == 64 and run.layer_stride == 192
    heads = LayerShape(heads=2, tokens=4, content_bytes=6, page_bytes=64)
    with pytest.raises(PlanError, match="cannot pad pages"):
        place_groups([[("a", "s", heads)]], 3, "LHBNC")


def test_groups_overlay_each_other_from_byte_zero() -> None:
    runs = place_groups([[("a", "x", SHAPE)], [("b", "x", SHAPE), ("c", "x", SHAPE)]], 3, "LBNHC")
    assert [(r.layer_names, r.offset) for r in runs] == [(("a",), 0), (("b", "c"), 0)]


def test_mixed_page_sizes_need_a_block_outermost_compact_layout() -> None:
    small = LayerShape(heads=2, tokens=4, content_bytes=4, page_bytes=32)
    groups = [[("a", "x", SHAPE)], [("b", "y", small)]]
    for layout in ("LBNHC", "LBHNC", "LHBNC", "BHLNC"):
        with pytest.raises(PlanError, match="different sizes|other head counts or page sizes"):
            place_groups(groups, 3, layout)
    runs = place_groups(groups, 3, "BLNHC")
    assert {r.block_stride for r in runs} == {64}


def test_layout_names_are_checked() -> None:
    assert check_layout("bhlnc") == "BHLNC"
    with pytest.raises(PlanError, match="choose from LBNHC"):
        check_layout("NHD")
