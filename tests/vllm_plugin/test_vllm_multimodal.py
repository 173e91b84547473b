"""Requests with multimodal inputs (images in the prompt), on vLLM 0.33's `KVCacheManager` and on
hybrid-kv's adapter, call for call.

vLLM keys a block that overlaps a multimodal item by the item's identifier and its offset in the
block (`("mm", identifier, offset)` extra keys), so the same tokens with another image, or the
same image at another position, miss the cache from the first block it touches, and KV events
publish those keys. A seeded driver admits requests with shared system prompts (an image in some
of them), user images from a small set (so some repeat, at the same offset or not), with LoRA
adapters and cache salts, prefills them in chunks, decodes a few tokens and frees them, on every
layout. Some requests ask for structured output (`harness.draw_grammars`, from a generator of
their own): one whose grammar still compiles is looked up after the requests behind it, one whose
grammar fails is freed before any lookup and one whose grammar rejects a sampled token is freed
mid-decode, both finished with an error; with drafting, a structured-output request's decode steps
schedule the drafts its grammar accepts and roll back those the model rejects; in some cases (from
a generator of their own) such a request is preempted mid-decode and resumed: freed, then looked
up and computed again with its output tokens. (vLLM 0.33 refuses none of this: structured outputs
are checked against the model and the tokenizer, not against multimodal inputs or speculative
decoding.) After every call the two managers must agree on the
hit, the new blocks, the free-block count, every live request's block table and the KV events.
(The scheduler differential tests cannot carry images: vLLM's scheduler would need an encoder
budget, which the offline model has not.)
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from hybrid_kv.vllm.testing import block_ids as ids  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

NUM_CASES = int(os.environ.get("HYBRID_KV_RANDOM_CASES", "12"))
FIRST_SEED = int(os.environ.get("HYBRID_KV_RANDOM_SEED", "0"))
# The harness's layouts of the hybrid models served (the unusual ones added after them are drawn
# by test_vllm_random's unusual-layout runs): a seed keeps its draws as the harness grows, and
# none draws a layout on which vLLM's own manager fails (a window-only model with MTP lookahead
# hashes raises IndexError in vLLM 0.33).
LAYOUTS = sorted(
    [
        "full",
        "deepseek",
        "gpt-oss-unified",
        "gpt-oss",
        "gemma3",
        "odd-window",
        "llama4",
        "mixed-bs",
        "jamba",
        "granite4",
        "jamba-2x",
    ]
)
IMAGES = ("img-a", "img-b", "img-c")
LORAS = (None, ("alpha", 1, "/adapters/alpha"))


def draw_spec(
    rng: random.Random,
    i: int,
    systems: list[tuple[tuple[int, ...], Any]],
    snippet: tuple[int, ...],
) -> Any:
    """A prompt: a shared system prompt (with its image, if any), then user text with 0-2
    images from `IMAGES` at drawn offsets. The text before an image is often a fixed snippet
    (or nothing), so equal token prefixes with different images, or the same image one block
    further on, are common: only the images' keys tell them apart."""
    system, system_mm = rng.choice(systems)
    prompt = list(system)
    mm = list(system_mm)
    for _ in range(rng.choice([0, 1, 1, 2])):
        before = rng.choice([(), snippet, snippet + snippet, "random"])
        if before == "random":
            before = tuple(rng.randrange(1, 30000) for _ in range(rng.choice([3, 21])))
        prompt += before
        length = rng.choice([8, 16, 40])
        mm.append((rng.choice(IMAGES), len(prompt), length))
        prompt += [7] * length  # placeholder tokens, the same for every image
    prompt += [rng.randrange(1, 30000) for _ in range(rng.randint(1, 40))]
    return harness.RequestSpec(
        request_id=f"req-{i}",
        prompt=tuple(prompt),
        max_tokens=rng.randint(1, 6),
        arrival_step=0,
        cache_salt=rng.choice([None, None, "tenant-a"]),
        lora=rng.choice(LORAS),
        mm=tuple(mm),
    )


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_CASES))
def test_multimodal_requests_match_vllms_manager(seed: int) -> None:
    rng = random.Random(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    multi_group = len(harness.LAYOUTS[layout](harness.BLOCK_SIZE)) > 1
    drafting = rng.choice(["none", "none", "eagle", "mtp"])
    options = harness.Options(
        layout=layout,
        num_blocks=rng.choice([400, 2000]),
        dense_retention=rng.random() < 0.3,
        kv_events=True,
        lora=True,
        # EAGLE's and MTP's lookahead hashes: a block's hash (and its event's extra keys) also
        # covers the items overlapping its next 1 or 2 tokens.
        eagle_tokens={"none": 0, "eagle": 1, "mtp": 2}[drafting],
        eagle_method="mtp" if drafting == "mtp" else "eagle3",
        # Hashes finer than the blocks (partial hash hits on Mamba layouts); vLLM refuses them
        # for a single group.
        prefix_match_unit=8 if multi_group and rng.random() < 0.3 else None,
    )
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    assert ours.uses_hybrid_kv, f"fell back to vLLM's manager for {options}"
    sm, om = stock.kv_cache_manager, ours.kv_cache_manager
    hash_bs = stock.hash_block_size
    log: list[Any] = []

    def same(what: str, a: Any, b: Any) -> None:
        assert b == a, f"seed {seed} ({options}): {what} differs after {log[-4:]}"

    def check(live: dict[str, Any]) -> None:
        same("free blocks", sm.block_pool.get_num_free_blocks(), om.core.num_free_blocks)
        for rid in live:
            same(f"{rid}'s blocks", ids(sm.get_blocks(rid)), ids(om.get_blocks(rid)))
        same("KV events", sm.take_events(), om.take_events())

    snippet = tuple(rng.randrange(1, 30000) for _ in range(16))
    systems: list[tuple[tuple[int, ...], Any]] = [((), ())]
    for _ in range(2):
        text = [rng.randrange(1, 30000) for _ in range(rng.choice([20, 48, 100]))]
        if rng.random() < 0.5:
            systems.append((tuple(text), ()))
        else:
            # An image inside the system prompt: shared by every request that uses it.
            at = rng.randrange(len(text))
            prompt = tuple(text[:at] + [7] * 16 + text[at:])
            systems.append((prompt, (("sys-img", at, 16),)))
            # The same system text with another image at the same place.
            systems.append((prompt, (("sys-img-2", at, 16),)))
    live: dict[str, tuple[Any, Any]] = {}
    # Structured output, from generators of their own: each request's grammar (drawn for a
    # template of the 24 requests, arriving one per admission), the drafts the model accepts.
    grammars = [
        t.grammar
        for t in harness.draw_grammars(
            random.Random(f"{seed}-grammar"),
            [harness.RequestSpec(f"req-{i}", (), 6, i) for i in range(24)],
        )
    ]
    acceptance = random.Random(f"{seed}-drafts")
    # For some cases (from a generator of its own), vLLM's scheduler preempts structured-output
    # requests mid-decode, after their grammars accepted tokens, and resumes them.
    preemptions = random.Random(f"{seed}-grammar-preemption")
    preemption_rate = preemptions.choice([0.0, 0.0, 0.1, 0.3])

    def finish_with_error(spec: Any, pair: tuple[Any, Any]) -> None:
        """vLLM's scheduler finishing a request with an error (`finish_requests`) and freeing
        it, whether it holds blocks or was never looked up."""
        log.append(("finish with an error", spec.request_id))
        for m, r in zip((sm, om), pair, strict=True):
            r.status = RequestStatus.FINISHED_ERROR
            m.free(r)
        live.pop(spec.request_id, None)
        check(live)

    def prefill(spec: Any, pair: tuple[Any, Any], chunks: random.Random) -> bool:
        """Looks `pair` up and computes its tokens (its prompt, and on resumption its output
        tokens too) in chunks drawn from `chunks`. Out of blocks, the request goes (vLLM's
        scheduler would preempt it); whether it is still there."""
        sm.new_step_starts()
        om.new_step_starts()
        # (blocks, hit tokens, shared-prefix boundary)
        s_got, o_got = (m.get_computed_blocks(r) for m, r in zip((sm, om), pair, strict=True))
        same("hit", (ids(s_got[0]), *s_got[1:]), (ids(o_got[0]), *o_got[1:]))
        (s_hit, s_n), (o_hit, o_n) = s_got[:2], o_got[:2]
        for r, got in zip(pair, (s_got, o_got), strict=True):
            r.shared_prefix_boundary = got[2]
        length = pair[0].num_tokens
        done = s_n
        first = True
        while done < length:
            chunk = min(length - done, chunks.choice([16, 37, 512]))
            if layout in harness.MAMBA_LAYOUTS:
                # vLLM's scheduler ends a Mamba `align` prefill chunk where a state must be
                # cached (block boundaries, the prompt's checkpoint, a shared-prefix junction).
                chunk = stock._mamba_block_aligned_split(pair[0], chunk, s_n if first else 0)
                assert chunk > 0, "the split left nothing to schedule"
            news = [
                m.allocate_slots(
                    r,
                    chunk,
                    num_new_computed_tokens=hit_n if first else 0,
                    new_computed_blocks=hit if first else None,
                )
                for m, r, hit, hit_n in zip((sm, om), pair, (s_hit, o_hit), (s_n, o_n), strict=True)
            ]
            same("new blocks", ids(news[0]), ids(news[1]))
            if news[0] is None:
                break
            first = False
            done += chunk
            for r in pair:
                r.num_computed_tokens = done
            live[spec.request_id] = pair
            check(live)
            sm.new_step_starts()
            om.new_step_starts()
        if done < length:
            for m, r in zip((sm, om), pair, strict=True):
                m.free(r)
            live.pop(spec.request_id, None)
            check(live)
            return False
        return True

    def decode_under_grammar(spec: Any, pair: tuple[Any, Any], length: int) -> bool:
        """Decodes a structured-output request as vLLM's scheduler does: with drafting, each
        step schedules the drafts its grammar accepts (the rest are dropped) and the model
        accepts a prefix of them; a sampled token the grammar rejects finishes the request with
        an error. Whether the request is still there."""
        rid = spec.request_id
        grammar = harness.FakeGrammar(rid, spec.grammar)
        sampled = [harness.next_token(rid, length)]
        while True:
            for r in pair:
                r.append_output_token_ids(sampled)
            if not grammar.accept_tokens(rid, sampled):
                finish_with_error(spec, pair)
                return False
            produced = pair[0].num_output_tokens
            if produced >= spec.max_tokens:
                return True
            position = length + produced
            if preemptions.random() < preemption_rate:
                # vLLM's scheduler preempts the request (its pool short, or a request of a
                # higher priority): it frees its blocks and drops its drafts; resumed, it is
                # looked up and computed again with its output tokens, then samples the next
                # token under its grammar, which kept the tokens it accepted.
                log.append(("preempt", rid, produced))
                for m, r in zip((sm, om), pair, strict=True):
                    m.free(r)
                    r.status = RequestStatus.PREEMPTED
                    r.num_computed_tokens = 0
                    r.spec_token_ids = []
                    r.num_preemptions += 1
                live.pop(rid, None)
                check(live)
                log.append(("resume", rid))
                if not prefill(spec, pair, preemptions):
                    return False
                for r in pair:
                    r.status = RequestStatus.RUNNING
                sampled = [harness.next_token(rid, position)]
                continue
            drafts = grammar.validate_tokens(
                [
                    harness.next_token(rid, position + j)
                    for j in range(min(stock.num_spec_tokens, spec.max_tokens - produced - 1))
                ]
            )
            for r in pair:
                r.spec_token_ids = list(drafts)
            log.append(("decode", rid, len(drafts)))
            news = [
                m.allocate_slots(
                    r, 1 + len(drafts), num_lookahead_tokens=stock.num_lookahead_tokens
                )
                for m, r in zip((sm, om), pair, strict=True)
            ]
            same("decode blocks", ids(news[0]), ids(news[1]))
            if news[0] is None:
                return True
            accepted = acceptance.randint(0, len(drafts))
            for r in pair:
                r.num_computed_tokens += 1 + accepted
                r.spec_token_ids = []
            sm.new_step_starts()
            om.new_step_starts()
            check(live)
            sampled = [*drafts[:accepted], harness.next_token(rid, position + accepted)]

    def run(spec: Any) -> None:
        """Admits `spec`, prefills it in chunks, decodes it and maybe frees a live request."""
        grammar = spec.grammar
        if grammar is not None and grammar.fails:
            # Its grammar does not compile: the request finishes before any lookup.
            finish_with_error(
                spec,
                (
                    harness.make_request(spec, hash_bs, stock.num_hash_lookahead_tokens),
                    harness.make_request(spec, hash_bs, stock.num_hash_lookahead_tokens),
                ),
            )
            return
        pair = (
            harness.make_request(spec, hash_bs, stock.num_hash_lookahead_tokens),
            harness.make_request(spec, hash_bs, stock.num_hash_lookahead_tokens),
        )
        if grammar is not None:
            for r in pair:
                r.status = RequestStatus.WAITING  # its grammar compiled
        log.append(("admit", spec.request_id, spec.mm))
        if not prefill(spec, pair, rng):
            return
        length = len(spec.prompt)
        if spec.grammar is not None:
            if not decode_under_grammar(spec, pair, length):
                return
        else:
            for step in range(spec.max_tokens):
                token = harness.next_token(spec.request_id, length + step)
                for r in pair:
                    r.append_output_token_ids(token)
                news = [m.allocate_slots(r, 1) for m, r in zip((sm, om), pair, strict=True)]
                same("decode blocks", ids(news[0]), ids(news[1]))
                if news[0] is None:
                    break
                for r in pair:
                    r.num_computed_tokens += 1
                sm.new_step_starts()
                om.new_step_starts()
        check(live)
        # Some requests stay (their blocks shared with later ones), the others finish.
        if rng.random() < 0.6 or len(live) > 6:
            victim = rng.choice(sorted(live))
            log.append(("free", victim))
            for m, r in zip((sm, om), live.pop(victim), strict=True):
                r.status = r.status.FINISHED_STOPPED
                m.free(r)
            check(live)

    # A request whose grammar still compiles is passed over (vLLM's scheduler looks up the
    # requests behind it first) until the admission its grammar is ready at.
    deferred: list[Any] = []
    for i in range(24):
        spec = draw_spec(rng, i, systems, snippet)
        if grammars[i] is not None:
            spec = dataclasses.replace(spec, grammar=grammars[i])
        if spec.grammar is not None and spec.grammar.ready_at > i:
            deferred.append(spec)
        else:
            run(spec)
        for ready in [d for d in deferred if d.grammar.ready_at <= i]:
            deferred.remove(ready)
            run(ready)
    for spec in deferred:
        run(spec)


@pytest.mark.parametrize("drafting", ["none", "eagle", "mtp"])
def test_an_image_in_a_blocks_lookahead_tokens_keys_that_block(drafting: str) -> None:
    # Lookahead hashes (EAGLE: 1 token, MTP: 2) make block 0's hash cover tokens 16 and 17 too,
    # so an image starting at token 16 keys block 0 as well: the same tokens with another image
    # there miss block 0 (without lookahead hashes they hit it).
    options = harness.Options(
        layout="full",
        eagle_tokens={"none": 0, "eagle": 1, "mtp": 2}[drafting],
        eagle_method="mtp" if drafting == "mtp" else "eagle3",
    )
    stock = harness.build_scheduler(options)
    ours = harness.build_scheduler(options, hkv.Scheduler)
    lookahead = stock.num_hash_lookahead_tokens
    assert lookahead == {"none": 0, "eagle": 1, "mtp": 2}[drafting]
    prompt = tuple(range(100, 116)) + (7,) * 16 + tuple(range(200, 220))
    hits = []
    for m in (stock.kv_cache_manager, ours.kv_cache_manager):
        got = []
        for i, image in enumerate(("img-a", "img-b")):
            spec = harness.RequestSpec(f"r{i}", prompt, 1, 0, mm=((image, 16, 16),))
            request = harness.make_request(spec, stock.hash_block_size, lookahead)
            blocks, num_hit, _ = m.get_computed_blocks(request)
            got.append(num_hit)
            m.allocate_slots(request, len(prompt) - num_hit, num_hit, blocks)
        hits.append(got)
    assert hits[1] == hits[0]
    assert hits[0] == [0, 0 if lookahead else 16]
