"""A Hypothesis state machine over `KVCacheManager`: random admissions (with prefix hits),
chunked prefill, decodes, preemptions, finishes, garbage-collected and removed requests, probes
and cache resets, with the manager's invariants checked after every step."""

from __future__ import annotations

import gc

import hybrid_kv as hk
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

LAYOUTS = [
    [{"kind": "full", "block_size": 4}],
    [
        {"kind": "full", "block_size": 4},
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 6},
    ],
    [
        {"kind": "full", "block_size": 8},
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 9},
        {"kind": "sliding_window", "block_size": 4, "sliding_window": 9},
    ],
    [
        {"kind": "chunked_local", "block_size": 4, "attention_chunk_size": 8},
        {"kind": "full", "block_size": 4},
    ],
    [{"kind": "sliding_window", "block_size": 4, "sliding_window": 5}],
    [{"kind": "full", "block_size": 4}, {"kind": "mamba", "block_size": 4}],
    # Mamba-2: prefill checkpoints exported into blocks of their own.
    [
        {"kind": "full", "block_size": 4},
        {
            "kind": "mamba",
            "block_size": 4,
            "num_prefill_checkpoint_blocks": 1,
            "prefill_checkpoint_alignment": 1,
        },
    ],
]
PREFIXES = [[], list(range(100, 112)), list(range(200, 220))]
MAX_LEN = 96


class Req:
    def __init__(self, request: hk.Request, max_outputs: int) -> None:
        self.request = request
        self.max_outputs = max_outputs
        self.running = False
        self.done = False


class ManagerMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    @initialize(layout=st.sampled_from(range(len(LAYOUTS))), num_blocks=st.integers(6, 40))
    def setup(self, layout: int, num_blocks: int) -> None:
        self.groups = LAYOUTS[layout]
        self.m = hk.KVCacheManager(self.groups, num_blocks, MAX_LEN)
        self.live: dict[str, Req] = {}
        self.serial = 0

    # ----- rules ---------------------------------------------------------------------------

    @rule(
        target=reqs,
        prefix=st.sampled_from(range(len(PREFIXES))),
        suffix=st.lists(st.integers(0, 5), min_size=1, max_size=30),
        max_outputs=st.integers(1, 8),
    )
    def new_request(self, prefix: int, suffix: list[int], max_outputs: int) -> str:
        self.serial += 1
        rid = f"r{self.serial}"
        prompt = PREFIXES[prefix] + suffix
        req = hk.Request(rid, np.array(prompt, dtype=np.int64), block_size=self.m.hash_block_size)
        self.live[rid] = Req(req, max_outputs)
        return rid

    @rule(
        rid=reqs,
        budget=st.integers(1, 40),
        external=st.integers(0, 12) | st.just(0),
        must_fit=st.booleans(),
    )
    def schedule(self, rid: str, budget: int, external: int, must_fit: bool) -> None:
        r = self.live.get(rid)
        if r is None or r.done:
            return
        req = r.request
        if not r.running:
            blocks, hit = self.m.get_computed_blocks(req)
            assert hit <= req.num_tokens - 1
            assert hit % self.m.scheduler_block_size == 0
            # Tokens a KV connector supplies after the local hit (never the last one).
            external = max(0, min(external, req.num_tokens - 1 - hit, MAX_LEN - 2 - hit))
            n = min(req.num_tokens - hit - external, budget, MAX_LEN - 1 - hit - external)
            if n <= 0:
                return
            free = self.m.num_free_blocks
            new = self.m.allocate_slots(
                req,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_external_computed_tokens=external,
                full_sequence_must_fit=must_fit,
            )
            if new is None:
                # Refused: nothing changed (the request holds no blocks yet).
                assert self.m.num_free_blocks == free
                assert all(len(g) == 0 for g in self.m.get_block_ids(rid))
                return
            r.running = True
            req.num_computed_tokens = hit + external + n
        else:
            computed = req.num_computed_tokens
            n = min(req.num_tokens - computed, budget, MAX_LEN - 1 - computed)
            if n <= 0:
                return
            new = self.m.allocate_slots(req, n)
            if new is None:
                self.m.free(req)  # preempted
                req.num_computed_tokens = 0
                r.running = False
                return
            req.num_computed_tokens = computed + n
        if req.num_computed_tokens == req.num_tokens:
            if req.num_output_tokens < r.max_outputs and req.num_tokens < MAX_LEN - 1:
                req.append_output_token_ids(req.num_tokens % 7)
            else:
                self.m.free(req)
                r.running = False
                r.done = True

    @rule(rid=consumes(reqs), how=st.sampled_from(["gc", "remove"]))
    def finish(self, rid: str, how: str) -> None:
        r = self.live.pop(rid, None)
        if r is None:
            return
        if how == "remove":
            if self.m.num_requests and rid in self.registered():
                self.m.free(r.request)
                self.m.remove_request(rid)
        del r
        gc.collect()

    @rule(rid=reqs)
    def probe_agrees_with_get_computed_blocks(self, rid: str) -> None:
        r = self.live.get(rid)
        if r is None or r.running or r.request.num_output_tokens:
            return
        prompt = r.request.prompt_token_ids
        _, hit = self.m.get_computed_blocks(r.request)
        assert self.m.probe(prompt) == hit

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = self.m.num_free_blocks == self.m.num_blocks - 1
        assert self.m.reset_prefix_cache() == idle
        if idle:
            assert self.m.num_cached_blocks == 0

    # ----- invariants --------------------------------------------------------------------------

    def registered(self) -> set[str]:
        out = set()
        for rid in self.live:
            try:
                self.m.get_block_ids(rid)
                out.add(rid)
            except hk.UnknownRequestError:
                pass
        return out

    @invariant()
    def blocks_in_use_are_exactly_the_blocks_requests_hold(self) -> None:
        if not hasattr(self, "m"):
            return
        held: dict[int, tuple[int, int]] = {}
        for rid in self.registered():
            tables = self.m.get_block_ids(rid)
            assert len(tables) == len(self.groups)
            if not self.live[rid].running:
                assert all(len(t) == 0 for t in tables), "a waiting request holds no blocks"
            for g, table in enumerate(tables):
                ids = table.tolist()
                for pos, b in enumerate(ids):
                    if b == 0:
                        continue
                    # A block shared by requests is the same cached prefix block: one group,
                    # one position.
                    assert held.setdefault(b, (g, pos)) == (g, pos)
                kind = self.groups[g]["kind"]
                if kind == "mamba":
                    # Align mode keeps the current state and at most the one it started from,
                    # plus a prefill checkpoint exported from inside the last chunk.
                    exports = self.groups[g].get("num_prefill_checkpoint_blocks", 0)
                    assert sum(1 for b in ids if b) <= 2 + exports, ids
                elif kind in ("sliding_window", "chunked_local"):
                    # Freed slots only ever precede the live ones.
                    first = next((i for i, b in enumerate(ids) if b), len(ids))
                    assert all(ids[first:]), ids
                else:
                    assert all(ids), "a full-attention table has no null slot"
        assert self.m.num_free_blocks + len(held) == self.m.num_blocks - 1
        assert abs(self.m.usage - len(held) / (self.m.num_blocks - 1)) < 1e-12
        assert self.m.num_requests == len(self.registered())


TestManagerStateMachine = ManagerMachine.TestCase
TestManagerStateMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
