"""The grouping search: which layers share block ids, and at which block and page sizes.

Model of memory (DESIGN.md "Allocation"): non-sharing layers with equal specs form a
*bucket*. At a base block size every bucket gets a page size (`Sizing`): attention pages are
unified on the largest (a smaller page that divides it grows its block size, otherwise it is
padded), a Mamba state takes `span` whole attention pages. A *group* is a set of layers
sharing block ids; a block holds one page of every layer of a group, and every block has the
widest group's size, so narrower groups leave *padding*.

Candidates are scored by the expected waste of resident requests whose lengths follow a
`LengthDistribution` (see `plan.ExpectedWaste`), from per-bucket figures computed once per
block size (`Scorer`), so thousands of groupings are compared cheaply.

`vllm_candidate` reproduces vLLM 0.33 (Mamba block-size alignment, page unification, its
group-size heuristic and strided assignment, one group for layers of one type with different
page sizes); `search` enumerates group widths and Mamba block sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import cast

from hybrid_kv.planner.lengths import LengthDistribution
from hybrid_kv.planner.plan import GroupKind, admission_blocks, blocks_held
from hybrid_kv.specs import (
    ATTENTION_SPEC_TYPES,
    DTYPE_SIZES,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "MAX_BLOCKS",
    "Bucket",
    "Candidate",
    "Group",
    "Scorer",
    "Sizing",
    "buckets_of",
    "search",
    "uniform_type",
    "vllm_candidate",
]

MAX_BLOCK_SIZE = 2**20
"""Tokens a block holds at most: the largest block size the manager (its core) takes."""

MAX_BLOCKS = 2**31 - 1
"""Blocks a pool can hold: block ids are int32 (vLLM's block tables and hybrid-kv's core). A
larger budget makes a pool of this many blocks (the plan's reasons say so)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    """Non-sharing layers with equal specs, in model order."""

    spec: LayerSpec
    layers: tuple[str, ...]

    @property
    def kind(self) -> GroupKind:
        return cast(GroupKind, self.spec.kind)  # sharing layers never form buckets

    @property
    def window(self) -> int | None:
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None

    @property
    def chunk(self) -> int | None:
        spec = self.spec
        return spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None


def buckets_of(layers: Mapping[str, LayerSpec]) -> list[Bucket]:
    order: dict[LayerSpec, list[str]] = {}
    for name, spec in layers.items():
        if isinstance(spec, KVSharingSpec):
            continue
        order.setdefault(spec, []).append(name)
    return [Bucket(spec, tuple(names)) for spec, names in order.items()]


@dataclass(frozen=True)
class Sizing:
    """Block size, page bytes and used bytes of every bucket at one base block size.

    `slice_bytes` is the unit page (one attention page); a bucket's page is `spans[b]`
    slices (a Mamba state over several pages: option B) or, when `uniform_type`, its own
    size."""

    base_block_size: int
    slice_bytes: int
    block_sizes: tuple[int, ...]
    spans: tuple[int, ...]
    page_bytes: tuple[int, ...]
    used_bytes: tuple[int, ...]
    mamba: tuple[bool, ...]
    notes: tuple[str, ...]
    uniform_type: bool = False

    @property
    def mixed_pages(self) -> bool:
        return len(set(self.page_bytes)) > 1


Group = tuple[tuple[int, str], ...]
"""A group's members in slot order: `(bucket index, layer name)`."""


@dataclass(frozen=True)
class Candidate:
    """One grouping and its score."""

    label: str
    sizing: Sizing
    groups: tuple[Group, ...]
    block_bytes: int
    expected_held: int
    expected_written: int
    admission: int
    num_attention_groups: int
    attention_block_size: int | None

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def waste_fraction(self) -> Fraction:
        if not self.expected_held:
            return Fraction(0)
        return Fraction(self.expected_held - self.expected_written, self.expected_held)

    def num_blocks(self, memory_bytes: int) -> int:
        """Blocks the budget makes, at most `MAX_BLOCKS`."""
        return min(memory_bytes // self.block_bytes, MAX_BLOCKS) if self.block_bytes else 1

    def fits(self, memory_bytes: int) -> bool:
        """vLLM's admission check: the pool minus the null block holds one request (the pool
        at most `MAX_BLOCKS` blocks)."""
        return self.admission + 1 <= self.num_blocks(memory_bytes)

    def sort_key(self) -> tuple[Fraction, int, int, int, int]:
        """Least waste first; on a tie vLLM's own grouping, then fewer groups, then smaller
        blocks, then narrower blocks."""
        return (
            self.waste_fraction,
            0 if self.label == "vllm" else 1,
            self.num_groups,
            max(self.sizing.block_sizes, default=0),
            self.block_bytes,
        )


class Scorer:
    """Expected held and written bytes of each bucket at each block size, over a length
    distribution, and vLLM's per-request admission: the figures candidates are scored by."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        lengths: LengthDistribution,
        max_model_len: int,
        max_in_flight_tokens: int,
        mamba_cache_mode: str,
    ) -> None:
        self.buckets = buckets
        self.lengths = lengths
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.mamba_cache_mode = mamba_cache_mode
        self._cache: dict[tuple[int, int], tuple[int, int, int]] = {}

    def per_layer(self, bucket: int, block_size: int) -> tuple[int, int, int]:
        """`(expected blocks a group holds, expected bytes one layer writes, blocks a group
        reserves for admission)` for `bucket` at `block_size` (expectations are weighted
        sums over the length distribution)."""
        key = (bucket, block_size)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        b = self.buckets[bucket]
        held = written = 0
        for length, weight in zip(self.lengths.lengths, self.lengths.weights, strict=True):
            count = blocks_held(
                b.kind, block_size, length, sliding_window=b.window, attention_chunk_size=b.chunk
            )
            held += weight * count
            if isinstance(b.spec, MambaSpec):
                written += weight * b.spec.state_bytes
            else:
                first = cdiv(length, block_size) - count
                written += weight * (length - first * block_size) * b.spec.bytes_per_token
        admission = admission_blocks(
            b.kind,
            block_size,
            self.max_model_len,
            self.max_in_flight_tokens,
            sliding_window=b.window,
            attention_chunk_size=b.chunk,
            mamba_cache_mode=self.mamba_cache_mode,
            prefill_checkpoint_blocks=getattr(b.spec, "prefill_checkpoint_blocks", 0),
        )
        self._cache[key] = (held, written, admission)
        return held, written, admission

    def candidate(self, label: str, sizing: Sizing, groups: tuple[Group, ...]) -> Candidate:
        pages = sizing.page_bytes
        block_bytes = max((sum(pages[b] for b, _ in members) for members in groups), default=0)
        held = written = admission = attention_groups = 0
        attention_block: int | None = None
        for members in groups:
            first = members[0][0]
            block_size = sizing.block_sizes[first]
            group_held, _, group_admission = self.per_layer(first, block_size)
            held += group_held * block_bytes
            admission += group_admission
            for b, _ in members:
                written += self.per_layer(b, sizing.block_sizes[b])[1]
            if not sizing.mamba[first]:
                attention_groups += 1
                if attention_block is None or block_size < attention_block:
                    attention_block = block_size
        return Candidate(
            label,
            sizing,
            groups,
            block_bytes,
            held,
            written,
            admission,
            attention_groups,
            attention_block,
        )


# --------------------------------------------------------------------------- sizing


def _unit_alignment(buckets: Sequence[Bucket]) -> int:
    """Unit pages are a multiple of the largest element size, so typed views stay aligned."""
    sizes = [1]
    for bucket in buckets:
        if isinstance(bucket.spec, MambaSpec):
            sizes.extend(DTYPE_SIZES[d] for d in bucket.spec.dtypes)
        else:
            sizes.append(DTYPE_SIZES[bucket.spec.dtype])  # type: ignore[union-attr]
    return max(sizes)


def attention_token_bytes(buckets: Sequence[Bucket]) -> int:
    return max(
        (b.spec.bytes_per_token for b in buckets if isinstance(b.spec, ATTENTION_SPEC_TYPES)),
        default=0,
    )


def max_state_bytes(buckets: Sequence[Bucket]) -> int:
    return max(
        (b.spec.state_bytes for b in buckets if isinstance(b.spec, MambaSpec)),
        default=0,
    )


def sizing_at(buckets: Sequence[Bucket], base_block_size: int) -> Sizing:
    """Unify page sizes at `base_block_size` (vLLM's rule: grow the block size of a smaller
    attention page when it divides the largest, else pad; Mamba states take whole pages)."""
    unit = _unit_alignment(buckets)
    token_bytes = attention_token_bytes(buckets)
    if token_bytes:
        slice_bytes = round_up(base_block_size * token_bytes, unit)
    else:
        slice_bytes = round_up(max_state_bytes(buckets), unit)
    block_sizes: list[int] = []
    spans: list[int] = []
    used: list[int] = []
    notes: list[str] = []
    for bucket in buckets:
        spec = bucket.spec
        if isinstance(spec, MambaSpec):
            block_sizes.append(base_block_size)
            spans.append(cdiv(spec.state_bytes, slice_bytes))
            used.append(spec.state_bytes)
            continue
        page = base_block_size * spec.bytes_per_token
        block_size = base_block_size
        if page != slice_bytes and slice_bytes % page == 0:
            block_size = base_block_size * (slice_bytes // page)
            notes.append(
                f"{spec.kind} layers with {spec.bytes_per_token} B/token ({bucket.layers[0]}, ...) "
                f"use block size {block_size} so their page matches {slice_bytes} B"
            )
        elif page != slice_bytes:
            notes.append(
                f"{spec.kind} layers with {spec.bytes_per_token} B/token ({bucket.layers[0]}, ...) "
                f"are padded from {page} B to {slice_bytes} B per block (pages do not divide)"
            )
        block_sizes.append(block_size)
        spans.append(1)
        used.append(block_size * spec.bytes_per_token)
    return Sizing(
        base_block_size,
        slice_bytes,
        tuple(block_sizes),
        tuple(spans),
        tuple(span * slice_bytes for span in spans),
        tuple(used),
        tuple(isinstance(b.spec, MambaSpec) for b in buckets),
        tuple(notes),
    )


def uniform_type(buckets: Sequence[Bucket]) -> bool:
    """vLLM's `UniformTypeKVCacheSpecs` rule: every layer needs the same number of token
    slots (all full attention, MLA included; all sliding window with one window; all chunked
    local with one chunk; all Mamba with one state size), so they form one group whatever
    their page sizes."""
    specs = [b.spec for b in buckets]
    if all(isinstance(s, (FullAttentionSpec, MLAAttentionSpec)) for s in specs):
        return True
    if all(isinstance(s, SlidingWindowSpec) for s in specs):
        return len({cast(SlidingWindowSpec, s).sliding_window for s in specs}) == 1
    if all(isinstance(s, ChunkedLocalAttentionSpec) for s in specs):
        return len({cast(ChunkedLocalAttentionSpec, s).attention_chunk_size for s in specs}) == 1
    if all(isinstance(s, MambaSpec) for s in specs):
        return len({cast(MambaSpec, s).state_bytes for s in specs}) == 1
    return False


def uniform_sizing(buckets: Sequence[Bucket], block_size: int) -> Sizing:
    """One group holding every layer, each with its own page (no unification)."""
    pages = []
    used = []
    for bucket in buckets:
        spec = bucket.spec
        if isinstance(spec, MambaSpec):
            # A page holds a whole number of the state's widest elements, so that every
            # block's states stay aligned for their typed views (an fp32 state beside an fp8
            # one would otherwise start at an odd byte in every other block).
            pages.append(round_up(spec.state_bytes, _unit_alignment((bucket,))))
            used.append(spec.state_bytes)
        else:
            pages.append(block_size * spec.bytes_per_token)
            used.append(pages[-1])
    return Sizing(
        block_size,
        min(pages),
        (block_size,) * len(buckets),
        (1,) * len(buckets),
        tuple(pages),
        tuple(used),
        tuple(isinstance(b.spec, MambaSpec) for b in buckets),
        (),
        uniform_type=True,
    )


# --------------------------------------------------------------------------- vLLM


def vllm_group_size(buckets: Sequence[Bucket]) -> int:
    counts = [len(b.layers) for b in buckets]
    smallest, largest = min(counts), max(counts)
    return largest if largest < 1.5 * smallest else smallest


def mamba_alignment(buckets: Sequence[Bucket], alignment: int) -> int:
    """vLLM's kernel alignment when growing attention blocks for Mamba: 128 with MLA."""
    if any(isinstance(b.spec, MLAAttentionSpec) for b in buckets):
        return max(alignment, 128)
    return alignment


def vllm_block_size(buckets: Sequence[Bucket], block_size: int, alignment: int) -> int:
    """vLLM's platform alignment for Mamba hybrids: grow the attention block size (a
    multiple of max(kernel alignment, block_size)) until one attention page holds a state."""
    token_bytes = attention_token_bytes(buckets)
    state_bytes = max_state_bytes(buckets)
    if not token_bytes or not state_bytes:
        return block_size
    align = max(mamba_alignment(buckets, alignment), block_size)
    return max(block_size, align * cdiv(state_bytes, align * token_bytes))


def split(buckets: Sequence[Bucket], spans: Sequence[int], width: int) -> tuple[Group, ...] | None:
    """Split every bucket into groups of at most `width` slots, strided like vLLM
    (`layers[i::num_groups]`); None if some layer does not fit in `width` slots."""
    groups: list[Group] = []
    for index, (bucket, span) in enumerate(zip(buckets, spans, strict=True)):
        per_group = width // span
        if per_group == 0:
            return None
        num_groups = cdiv(len(bucket.layers), per_group)
        for i in range(num_groups):
            groups.append(tuple((index, name) for name in bucket.layers[i::num_groups]))
    return tuple(groups)


def vllm_candidate(
    layers: Mapping[str, LayerSpec],
    buckets: Sequence[Bucket],
    block_size: int,
    alignment: int,
    scorer: Scorer,
) -> Candidate:
    """vLLM 0.33's grouping of these buckets."""
    if len(buckets) == 1 or uniform_type(buckets):
        # One group, every layer in model order, each with its own page.
        index = {name: b for b, bucket in enumerate(buckets) for name in bucket.layers}
        group = tuple((index[name], name) for name in layers if name in index)
        return scorer.candidate("vllm", uniform_sizing(buckets, block_size), (group,))
    sizing = sizing_at(buckets, vllm_block_size(buckets, block_size, alignment))
    groups = split(buckets, sizing.spans, vllm_group_size(buckets))
    assert groups is not None  # every span is 1 after vLLM's alignment
    return scorer.candidate("vllm", sizing, groups)


# --------------------------------------------------------------------------- min-waste


def search_block_sizes(
    buckets: Sequence[Bucket], block_size: int, alignment: int, allow_spans: bool
) -> list[int]:
    """Attention block sizes to try: for Mamba hybrids, option A (one attention page holds a
    state) and, when pages may differ in size, option B for every k (k pages hold a state)."""
    token_bytes = attention_token_bytes(buckets)
    state_bytes = max_state_bytes(buckets)
    if not token_bytes or not state_bytes:
        return [block_size]
    align = mamba_alignment(buckets, alignment)
    sizes = {vllm_block_size(buckets, block_size, alignment)}
    if allow_spans:
        num_layers = sum(len(b.layers) for b in buckets)
        for width in range(1, num_layers + 1):
            tokens = cdiv(state_bytes, width * token_bytes)
            sizes.add(max(block_size, round_up(tokens, align)))
    return sorted(sizes)


def widths(buckets: Sequence[Bucket], spans: Sequence[int]) -> set[int]:
    """Group widths (slots) worth trying: the tightest width for every bucket and group
    count."""
    result = set()
    for bucket, span in zip(buckets, spans, strict=True):
        for num_groups in range(1, len(bucket.layers) + 1):
            result.add(span * cdiv(len(bucket.layers), num_groups))
    return result


def search(
    buckets: Sequence[Bucket],
    block_size: int,
    alignment: int,
    scorer: Scorer,
    *,
    allow_spans: bool,
    max_attention_groups: int | None,
    max_groups: int | None,
) -> list[Candidate]:
    """Every grouping within the caps; the best of each (block size, block bytes)."""
    found: dict[tuple[int, int], Candidate] = {}
    for base in search_block_sizes(buckets, block_size, alignment, allow_spans):
        sizing = sizing_at(buckets, base)
        if not allow_spans and max(sizing.spans) > 1:
            continue
        label = "A" if max(sizing.spans) == 1 else "B"
        for width in sorted(widths(buckets, sizing.spans)):
            groups = split(buckets, sizing.spans, width)
            if groups is None or (max_groups is not None and len(groups) > max_groups):
                continue
            candidate = scorer.candidate(label, sizing, groups)
            if (
                max_attention_groups is not None
                and candidate.num_attention_groups > max_attention_groups
            ):
                continue
            key = (base, candidate.block_bytes)
            best = found.get(key)
            if best is None or candidate.sort_key() < best.sort_key():
                found[key] = candidate
    return list(found.values())
