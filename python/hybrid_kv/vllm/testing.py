"""vLLM's real scheduler driven offline on CPU: the harness of the differential tests and of
`benches/vllm_scheduler.py`.

`build_scheduler` makes vLLM's `Scheduler` (or `hybrid_kv.vllm.Scheduler`) from a tiny local
`config.json` (no tokenizer, no weights), a hand-built `KVCacheConfig` for one of `LAYOUTS`, and
the scheduler options of a test. `Driver` feeds it a workload and plays the model runner: every
scheduled request samples one token per step (more with speculative decoding), chosen by a
deterministic rule so that two schedulers given the same decisions produce the same tokens.
`summarize` reduces a `SchedulerOutput` to plain values, so two runs compare step by step.

On a machine without a GPU, set `VLLM_TARGET_DEVICE=cpu` in the environment before vLLM is
imported (vLLM resolves its platform once).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.utils import strip_speculative_padding

BLOCK_SIZE = 16
VOCAB = 32000

_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 131072,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
}


def _config_dir(prefix: str, config: dict[str, Any]) -> str:
    """A new temporary directory holding `config` as `config.json`, removed when the process
    exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@cache
def model_dir() -> str:
    """A directory holding a tiny llama-like `config.json` (the scheduler reads no weights)."""
    return _config_dir("hybrid-kv-vllm-", _MODEL_CONFIG)


def _attention(block_size: int, num_kv_heads: int = 8) -> dict[str, Any]:
    return {
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_size": 128,
        "dtype": torch.float16,
    }


def _mamba(block_size: int, checkpoint_blocks: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((2, 64), (16, 64)),
        dtypes=(torch.float16, torch.float16),
        mamba_type="mamba2",
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=1 if checkpoint_blocks else None,
    )


# Layout -> the KV cache groups' specs (layers per group do not matter to the manager).
LAYOUTS: dict[str, Callable[[int], list[KVCacheSpec]]] = {
    # 32 full-attention layers: one group.
    "full": lambda bs: [FullAttentionSpec(**_attention(bs))],
    # DeepSeek-V2/V3-like: multi-head latent attention, one latent "head" of 576 (vLLM's
    # full-attention manager serves MLA groups).
    "deepseek": lambda bs: [
        MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.float16)
    ],
    # gpt-oss under `--disable-hybrid-kv-cache-manager`: vLLM's planner turns every layer into
    # full attention (window layers keep their window as an attribute) in one group.
    "gpt-oss-unified": lambda bs: [FullAttentionSpec(**_attention(bs), sliding_window=128)],
    # gpt-oss: sliding window 128 + full attention, 1:1.
    "gpt-oss": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(bs), sliding_window=128),
    ],
    # Gemma-3-27B: 10 full + 52 sliding-window (1024) layers in groups of 10: 1 + 6 groups.
    "gemma3": lambda bs: (
        [FullAttentionSpec(**_attention(bs))]
        + [SlidingWindowSpec(**_attention(bs), sliding_window=1024) for _ in range(6)]
    ),
    # A window that is not a multiple of the block size (as Phi-3's 2047): blocks leave it on
    # steps that fill none.
    "odd-window": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(bs), sliding_window=100),
    ],
    # Llama-4: chunked local attention (8192) 3 : 1 full.
    "llama4": lambda bs: (
        [FullAttentionSpec(**_attention(bs))]
        + [ChunkedLocalAttentionSpec(**_attention(bs), attention_chunk_size=8192) for _ in range(3)]
    ),
    # Sliding-window layers with half the KV heads of the full-attention ones (as in MiMo-V2):
    # vLLM's planner unifies page sizes by doubling the window groups' block size, so the
    # groups have block sizes 16 and 32 (scheduler block size 32, hashes every 16 tokens).
    "mixed-bs": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(2 * bs, num_kv_heads=4), sliding_window=128),
    ],
    # Jamba-like: Mamba + full attention.
    "jamba": lambda bs: [FullAttentionSpec(**_attention(bs)), _mamba(bs)],
    # Granite-4.0-H / Nemotron-H-like: vLLM 0.33's Mamba-2 mixer exports the prompt's state
    # from inside the final prefill chunk into one more block (`num_prefill_checkpoint_blocks`).
    "granite4": lambda bs: [FullAttentionSpec(**_attention(bs)), _mamba(bs, checkpoint_blocks=1)],
    # Jamba-like with Mamba blocks twice the attention block (scheduler block 2 * bs, hashes
    # every bs tokens unless `prefix_match_unit` says otherwise): vLLM's fine-grained partial
    # hash hits land inside the Mamba blocks.
    "jamba-2x": lambda bs: [FullAttentionSpec(**_attention(bs)), _mamba(2 * bs)],
    # Mistral-7B-v0.1-like: every layer a sliding window (64), one group.
    "window-only": lambda bs: [SlidingWindowSpec(**_attention(bs), sliding_window=64)],
    # Three full-attention groups of block sizes 16, 32 and 64 (layers with fewer KV heads get
    # larger blocks of the same page size): scheduler block 64, hashes every 16 tokens.
    "full-3bs": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        FullAttentionSpec(**_attention(2 * bs, num_kv_heads=4)),
        FullAttentionSpec(**_attention(4 * bs, num_kv_heads=2)),
    ],
    # A sliding window smaller than a block (8), and one equal to it.
    "small-window": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(bs), sliding_window=bs // 2),
    ],
    "block-window": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(bs), sliding_window=bs),
    ],
    # Chunked local attention with chunks not a multiple of the block (100), and smaller than
    # one (8).
    "odd-chunk": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        ChunkedLocalAttentionSpec(**_attention(bs), attention_chunk_size=100),
    ],
    "small-chunk": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        ChunkedLocalAttentionSpec(**_attention(bs), attention_chunk_size=bs // 2),
    ],
    # The Mamba group first: the drafter's full-attention layers join group 1.
    "mamba-first": lambda bs: [_mamba(bs), FullAttentionSpec(**_attention(bs))],
    # Two Mamba groups of different state shapes (as a model with two kinds of mixers).
    "two-mamba": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        _mamba(bs),
        dataclasses.replace(_mamba(bs), shapes=((4, 64), (16, 64))),
    ],
    # Full attention, sliding window (64) and Mamba: two attention groups whose new blocks the
    # worker zeroes (a layout with Mamba layers).
    "swa-mamba": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**_attention(bs), sliding_window=64),
        _mamba(bs),
    ],
    # gpt-oss with its sliding-window layers' cache in FP8: a cache of two precisions, whose new
    # attention blocks the worker zeroes (vLLM's `KVCacheConfig.needs_kv_cache_zeroing`).
    "mixed-precision": lambda bs: [
        FullAttentionSpec(**_attention(bs)),
        SlidingWindowSpec(**dict(_attention(bs), dtype=torch.float8_e4m3fn), sliding_window=128),
    ],
}

# Layouts with Mamba groups (vLLM then picks mamba_cache_mode "align" with prefix caching).
MAMBA_LAYOUTS = ("jamba", "granite4", "jamba-2x", "swa-mamba", "mamba-first", "two-mamba")


@dataclass(frozen=True)
class Options:
    """One scheduler configuration of the differential tests and the benchmark."""

    layout: str = "full"
    num_blocks: int = 2048
    prefix_caching: bool = True
    dense_retention: bool = True
    # vLLM's `prefix_cache_retention_interval` when retention is not dense: 0 (its default) or
    # a token interval (a multiple of the scheduler block size; sliding-window and Mamba
    # layouts only), which also keeps one window per interval.
    retention_interval: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    async_scheduling: bool = False
    ngram_tokens: int = 0
    # EAGLE-family speculative decoding with this many draft tokens: "eagle3" (a local draft
    # config.json) or "mtp" (the target becomes a GLM-4.5-like config with 2 MTP modules,
    # so with 2+ draft tokens the drafter reads that many prefill tokens ahead).
    eagle_tokens: int = 0
    eagle_method: str = "eagle3"
    # vLLM's default for EAGLE: block hashes cover the next token ("lookahead hashes"), so hits
    # drop no block. False: `disable_lookahead_block_hashes`, hits drop their last block in the
    # group that holds the drafter's layers (group 0, full attention, in every layout here).
    eagle_lookahead_hashes: bool = True
    # SpeculativeConfig.disable_eagle_block_drop (experimental in vLLM): EAGLE hits keep their
    # last block and hashes cover no lookahead; the drafter's group is not flagged.
    eagle_block_drop: bool = True
    # A separate draft model (vLLM's "draft_model" method; the tiny target itself) proposing
    # this many tokens: KV slots for every draft token, one more input slot per request
    # (`parallel_drafting`, PARD: one per draft token).
    draft_model_tokens: int = 0
    parallel_drafting: bool = False
    # SpeculativeConfig.num_speculative_tokens_per_batch_size (dynamic speculative decoding):
    # (first, last batch size, draft tokens) ranges; steps then propose that many.
    spec_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    # CacheConfig.enable_mamba_shared_prefix_checkpoint (acts only with partial hash hits).
    mamba_shared_prefix_checkpoint: bool = False
    # LoRA serving (at most 2 adapters per step), for workloads whose requests name adapters.
    lora: bool = False
    kv_events: bool = False
    log_stats: bool = True
    block_size: int = BLOCK_SIZE
    # CacheConfig.prefix_match_unit: hash requests every this many tokens (None: the gcd of
    # the groups' block sizes).
    prefix_match_unit: int | None = None
    # ModelConfig.enable_prompt_embeds, for workloads whose requests send embeddings.
    prompt_embeds: bool = False
    # SchedulerConfig knobs an operator sets: the share of blocks kept free at admission, the
    # whole-prompt fit check at admission (vLLM's default) and the per-step cap on a long
    # prefill's tokens (0: none).
    watermark: float = 0.0
    reserve_full_isl: bool = True
    long_prefill_token_threshold: int = 0
    # SchedulerConfig.enable_chunked_prefill. Off, a prompt is scheduled whole or not at all
    # (vLLM then needs max_num_batched_tokens >= max_model_len: the larger is used).
    chunked_prefill: bool = True
    # vLLM's scheduling policy: "fcfs" or "priority" (requests' `priority`, lower first;
    # preemption takes the lowest-priority running request).
    policy: str = "fcfs"
    # CacheConfig.prefix_caching_hash_algo: how vLLM's engine core hashes requests, and the
    # hash hybrid-kv keys its prefix cache with ("sha256", vLLM's default, or "sha256_cbor",
    # "xxhash", "xxhash_cbor").
    hash_algo: str = "sha256"
    # More SchedulerConfig knobs: the per-step token budget when below the batch's
    # (`max_num_scheduled_tokens`), the admission limit below `max_num_seqs`
    # (`max_num_active_seqs`), the long-prefill cap floored at a fair share of the budget
    # (`long_prefill_token_threshold_adaptive`) and prefill admitted once every N steps
    # (`prefill_schedule_interval`: applied by the scheduler itself, or, on the ranks of a
    # data-parallel MoE model, by the engine core's `schedule(throttle_prefills=...)`).
    max_num_scheduled_tokens: int | None = None
    max_num_active_seqs: int | None = None
    long_prefill_adaptive: bool = False
    prefill_schedule_interval: int = 1
    # ParallelConfig.pipeline_parallel_size: the engine keeps `VllmConfig.max_concurrent_batches`
    # batches in flight (PP of them; with async scheduling on Model Runner V2, one more), so
    # `schedule()` runs again before the outputs of the steps before it are in.
    pipeline_parallel_size: int = 1
    # Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER`; vLLM 0.33's default where Triton runs, V1
    # here): resumed requests are sent as new ones, an EAGLE or draft-model drafter skips
    # steps whose drafts go unused, and with async scheduling and PP a request decodes once
    # every PP steps.
    v2_model_runner: bool = False
    # This engine's rank among `data_parallel_size` (ParallelConfig; its KV events carry the
    # rank). Ranks of a dense model run independently (vLLM's engine core sets the size to 1
    # and keeps the rank as `data_parallel_index`); ranks of an MoE model are coordinated.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Tensor and context parallelism (ParallelConfig): decode context parallelism falls back
    # to vLLM's manager; vLLM 0.33's scheduler hands prefill context parallelism to no manager.
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    # Serve the GLM-4.5-like MoE target (the "mtp" method's) without drafting.
    moe: bool = False
    # An embedding model (ModelConfig runner "pooling", convert "embed"): it samples no token,
    # so a prompt may fill `max_model_len`; its requests are pooling requests.
    pooling_runner: bool = False


def _retention(options: Options) -> int | None:
    return None if options.dense_retention else options.retention_interval


def _speculative_tokens(options: Options) -> int:
    return options.ngram_tokens or options.eagle_tokens or options.draft_model_tokens


def kv_cache_config(options: Options, config: VllmConfig | None = None) -> KVCacheConfig:
    """The `KVCacheConfig` vLLM's planner would build for `options` (from `config`, the
    scheduler's `VllmConfig`, if given)."""
    if config is None:
        config = vllm_config(options)
    # vLLM's planner widens every sliding window by the tokens a multi-module drafter may
    # re-prefill (get_kv_cache_groups' extra_retained_tokens).
    extra_retained = max(0, config.num_prefill_lookahead_tokens - 1)
    specs = [
        # vLLM's Mamba managers prefix-cache in "align" mode only; with speculative decoding a
        # Mamba layer declares one state block per draft token (MambaBase.get_kv_cache_spec).
        dataclasses.replace(
            spec,
            mamba_cache_mode="align" if options.prefix_caching else "none",
            num_speculative_blocks=_speculative_tokens(options),
        )
        if isinstance(spec, MambaSpec)
        else dataclasses.replace(spec, extra_retained_tokens=extra_retained)
        if isinstance(spec, SlidingWindowSpec)
        else spec
        for spec in LAYOUTS[options.layout](options.block_size)
    ]
    groups = [KVCacheGroupSpec([f"layers.{g}"], spec) for g, spec in enumerate(specs)]
    speculative = config.speculative_config
    if speculative is not None and speculative.use_eagle_block_drop():
        # vLLM's planner flags the groups holding draft layers for every EAGLE-family drafter
        # that keeps the trailing-block drop (with or without lookahead hashes, with or
        # without prefix caching): the drafter's full-attention layers join the
        # full-attention group (the first one, whatever groups come before it).
        drafter = next(
            (g for g in groups if type(g.kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec)),
            groups[0],
        )
        drafter.is_eagle_group = True
    return KVCacheConfig(
        num_blocks=options.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=_retention(options),
    )


# A GLM-4.5-like target (grouped-query attention, not MLA, whose CPU path would turn prefix
# caching off) whose checkpoint carries 2 multi-token-prediction modules.
_MTP_MODEL_CONFIG = dict(
    _MODEL_CONFIG,
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    num_nextn_predict_layers=2,
    head_dim=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    rope_theta=10000,
    partial_rotary_factor=0.5,
    use_qk_norm=False,
)


@cache
def mtp_model_dir() -> str:
    """A directory holding `_MTP_MODEL_CONFIG` as `config.json`."""
    return _config_dir("hybrid-kv-mtp-", _MTP_MODEL_CONFIG)


@cache
def eagle_dir() -> str:
    """A directory holding a one-layer EAGLE-3 draft `config.json` for the tiny target model."""
    config = dict(_MODEL_CONFIG, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"])
    return _config_dir("hybrid-kv-eagle-", config)


_V2_MODEL_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


@contextlib.contextmanager
def model_runner(v2: bool) -> Iterator[None]:
    """`VLLM_USE_V2_MODEL_RUNNER` set as an engine serving with Model Runner V2 (or V1) has it,
    for the block: vLLM reads it whenever a config asks `use_v2_model_runner` (building the
    config and the scheduler, and `max_concurrent_batches`)."""
    old = os.environ.get(_V2_MODEL_RUNNER)
    os.environ[_V2_MODEL_RUNNER] = "1" if v2 else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[_V2_MODEL_RUNNER]
        else:
            os.environ[_V2_MODEL_RUNNER] = old


def max_concurrent_batches(scheduler: Any) -> int:
    """The batches vLLM's engine core keeps in flight around `scheduler` (its batch queue)."""
    with model_runner(scheduler.use_v2_model_runner):
        return int(scheduler.vllm_config.max_concurrent_batches)


def vllm_config(options: Options) -> VllmConfig:
    with model_runner(options.v2_model_runner):
        return _vllm_config(options)


def _vllm_config(options: Options) -> VllmConfig:
    mtp = bool(options.eagle_tokens) and options.eagle_method == "mtp"
    model = ModelConfig(
        model=mtp_model_dir() if mtp or options.moe else model_dir(),
        skip_tokenizer_init=True,
        max_model_len=options.max_model_len,
        dtype="float16",
        seed=0,
        enable_prompt_embeds=options.prompt_embeds,
        **({"runner": "pooling", "convert": "embed"} if options.pooling_runner else {}),
    )
    scheduler = SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens
        if options.chunked_prefill
        else max(options.max_num_batched_tokens, options.max_model_len),
        max_model_len=options.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=options.async_scheduling,
        enable_chunked_prefill=options.chunked_prefill,
        watermark=options.watermark,
        scheduler_reserve_full_isl=options.reserve_full_isl,
        long_prefill_token_threshold=options.long_prefill_token_threshold,
        policy=options.policy,
        max_num_scheduled_tokens=options.max_num_scheduled_tokens,
        max_num_active_seqs=options.max_num_active_seqs,
        long_prefill_token_threshold_adaptive=options.long_prefill_adaptive,
        prefill_schedule_interval=options.prefill_schedule_interval,
    )
    cache = CacheConfig(
        block_size=options.block_size,
        enable_prefix_caching=options.prefix_caching,
        prefix_cache_retention_interval=_retention(options),
        prefix_caching_hash_algo=options.hash_algo,
        enable_mamba_shared_prefix_checkpoint=options.mamba_shared_prefix_checkpoint,
        prefix_match_unit=options.prefix_match_unit,
        # vLLM derives this from the model's Mamba layers; the tiny model here has none.
        mamba_cache_mode="align"
        if options.prefix_caching and options.layout in MAMBA_LAYOUTS
        else "none",
    )
    cache.num_gpu_blocks = options.num_blocks
    speculative = None
    per_batch_size = (
        None
        if options.spec_tokens_per_batch_size is None
        else [tuple(r) for r in options.spec_tokens_per_batch_size]
    )
    if options.ngram_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=options.ngram_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=2,
            num_speculative_tokens_per_batch_size=per_batch_size,
        )
    elif options.eagle_tokens:
        speculative = SpeculativeConfig(
            method=options.eagle_method,
            model=None if mtp else eagle_dir(),
            num_speculative_tokens=options.eagle_tokens,
            disable_lookahead_block_hashes=not options.eagle_lookahead_hashes,
            disable_eagle_block_drop=not options.eagle_block_drop,
            num_speculative_tokens_per_batch_size=per_batch_size,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    elif options.draft_model_tokens:
        speculative = SpeculativeConfig(
            method="draft_model",
            model=model_dir(),
            num_speculative_tokens=options.draft_model_tokens,
            parallel_drafting=options.parallel_drafting,
            num_speculative_tokens_per_batch_size=per_batch_size,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    events = None
    if options.kv_events:
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    parallel = ParallelConfig(
        pipeline_parallel_size=options.pipeline_parallel_size,
        data_parallel_size=options.data_parallel_size,
        data_parallel_rank=options.data_parallel_rank,
        tensor_parallel_size=options.tensor_parallel_size,
        decode_context_parallel_size=options.decode_context_parallel_size,
        prefill_context_parallel_size=options.prefill_context_parallel_size,
    )
    config = VllmConfig(
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8) if options.lora else None,
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        speculative_config=speculative,
        kv_events_config=events,
        parallel_config=parallel,
    )
    # vLLM's CPU platform turns async scheduling off ("not required on CPU"); the scheduler
    # itself runs the same on any platform, so put it back as a GPU engine would have it.
    config.scheduler_config.async_scheduling = options.async_scheduling
    if options.data_parallel_size > 1:
        # As vLLM's engine core process (EngineCoreProc.run_engine_core) sets up a rank.
        config.parallel_config.data_parallel_index = options.data_parallel_rank
        if not config.model_config.is_moe:
            config.parallel_config.reconfigure_for_independent_dp_rank()
    return config


def build_scheduler(
    options: Options, scheduler_cls: type[Any] | None = None, config: Any = None
) -> Any:
    """`scheduler_cls` (default: the class vLLM picks, Scheduler or AsyncScheduler) built
    offline for `options`, from `config` if given (a `vllm_config(options)` the caller changed)."""
    if config is None:
        config = vllm_config(options)
    with model_runner(options.v2_model_runner):
        return _build_scheduler(options, scheduler_cls, config)


def _build_scheduler(options: Options, scheduler_cls: type[Any] | None, config: Any) -> Any:
    if scheduler_cls is None:
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
    kv_config = kv_cache_config(options, config)
    # As vLLM's EngineCore: the scheduler's block size is the lcm of the groups', hashes are
    # made every gcd of them, and the config carries both and where hits land (the hash block
    # with fine-grained partial hash hits, else the scheduler block) before the scheduler is
    # built.
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    kv_config.hash_block_size = hash_block_size
    kv_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_config, config, scheduler_block_size, hash_block_size
    )
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=options.log_stats,
        # An online data-parallel engine (internal load balancing, vLLM's default) reports
        # the requests that finished to its coordinator (EngineCoreProc).
        include_finished_set=options.data_parallel_size > 1,
    )


# ----------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output request's grammar, played offline (`FakeGrammar`): it compiles at
    step `ready_at` (the request waits for it meanwhile), or fails to then (`fails`: the request
    finishes with a validation error); once compiled it accepts a seeded prefix of every draft
    (all of it with `all_drafts`) and rejects the sampled token at output index `reject_at`
    (vLLM then finishes the request with an error)."""

    ready_at: int
    fails: bool = False
    all_drafts: bool = False
    reject_at: int | None = None


class FakeGrammar:
    """A compiled grammar (vLLM's `StructuredOutputGrammar`) as `GrammarSpec` says; its
    decisions depend only on the request id and the tokens it accepted, so two schedulers that
    agree so far get the same ones."""

    def __init__(self, request_id: str, spec: GrammarSpec) -> None:
        self.request_id = request_id
        self.spec = spec
        self.num_accepted = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        reject_at = self.spec.reject_at
        if reject_at is not None and self.num_accepted <= reject_at < self.num_accepted + len(
            tokens
        ):
            return False
        self.num_accepted += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        if self.spec.all_drafts:
            return tokens
        keep = _stable_hash(self.request_id, self.num_accepted, "grammar") % (len(tokens) + 1)
        return tokens[:keep]

    def rollback(self, num_tokens: int) -> None:
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.num_accepted = 0


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int
    cache_salt: str | None = None
    # vLLM's per-request `kv_cache_report_mode` (SamplingParams.extra_args): "full" also
    # publishes the blocks a prefix hit reuses.
    kv_cache_report_mode: str | None = None
    # A LoRA adapter: (name, id, path).
    lora: tuple[str, int, str] | None = None
    # Prompt logprobs: vLLM then reads no prefix-cache hit for the request (its blocks are still
    # cached).
    prompt_logprobs: int | None = None
    # Send the prompt as embeddings (a tensor derived from `prompt`, one row per token) instead
    # of token ids; the scheduler needs `Options.prompt_embeds`.
    embeds: bool = False
    # Multimodal inputs: (identifier, offset, length) per item, sorted by offset, each standing
    # for `length` placeholder tokens of the prompt (vLLM keys the blocks they overlap by the
    # identifier and the item's offset in the block).
    mm: tuple[tuple[str, int, int], ...] = ()
    # Scheduling priority (the "priority" policy; lower runs first).
    priority: int = 0
    # A pooling request (an embedding model's): no sampling parameters, one pooler output at
    # the end of its prompt, no token sampled.
    pooling: bool = False
    # Structured output (a JSON schema): the grammar the engine compiles for the request.
    grammar: GrammarSpec | None = None


def prompt_embeddings(prompt: Sequence[int]) -> torch.Tensor:
    """Embeddings standing for `prompt`: equal prompts (and prefixes) give equal rows."""
    ids = torch.tensor(prompt, dtype=torch.float32).unsqueeze(1)
    return torch.cat((ids, ids % 97, ids % 13, -ids), dim=1).to(torch.float16)


def chat_workload(
    num_requests: int,
    *,
    seed: int = 0,
    num_system_prompts: int = 4,
    system_len: tuple[int, int] = (200, 1200),
    user_len: tuple[int, int] = (20, 400),
    max_tokens: tuple[int, int] = (8, 96),
    arrivals_per_step: int = 4,
    salts: Sequence[str | None] = (None,),
) -> list[RequestSpec]:
    """Chat requests sharing a few system prompts (prefix hits), arriving a few per step."""
    rng = random.Random(seed)
    systems = [
        tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*system_len)))
        for _ in range(num_system_prompts)
    ]
    specs = []
    for i in range(num_requests):
        user = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*user_len)))
        specs.append(
            RequestSpec(
                request_id=f"req-{i}",
                prompt=rng.choice(systems) + user,
                max_tokens=rng.randint(*max_tokens),
                arrival_step=i // arrivals_per_step,
                cache_salt=rng.choice(list(salts)),
            )
        )
    return specs


def draw_grammars(
    rng: random.Random, workload: Sequence[RequestSpec], always: bool = False
) -> list[RequestSpec]:
    """`workload` with a share of its requests asking for structured output (from a generator
    of its own, so the draws before stay what they were for every seed), for about a third of
    the workloads (every one with `always`): each grammar compiles at arrival or a few steps
    later, or fails to (a validation error for that request alone); it accepts a seeded prefix
    of each draft, or every draft, and rarely rejects a sampled token (vLLM finishes the
    request with an error)."""
    if rng.random() >= 0.35 and not always:
        return list(workload)
    share = rng.choice([0.2, 0.5, 1.0])
    grammars = []
    for spec in workload:
        if spec.pooling or rng.random() >= share:
            grammars.append(spec)
            continue
        grammar = GrammarSpec(
            ready_at=spec.arrival_step + rng.choice([0, 0, 1, 3, 8]),
            fails=rng.random() < 0.08,
            all_drafts=rng.random() < 0.3,
            reject_at=rng.randrange(spec.max_tokens) if rng.random() < 0.08 else None,
        )
        grammars.append(dataclasses.replace(spec, grammar=grammar))
    return grammars


@cache
def _none_hash(hash_algo: str) -> Any:
    """vLLM's NONE_HASH (the parent of every prompt's first block) for `hash_algo`, drawn once
    per process as its engine core draws it (from a random seed for xxHash)."""
    init_none_hash(get_hash_fn_by_name(hash_algo))
    return kv_cache_utils.NONE_HASH


@cache
def _block_hasher(
    block_size: int, lookahead: int = 0, hash_algo: str = "sha256"
) -> Callable[[Request], list[Any]]:
    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name(hash_algo), lookahead)
    none_hash = _none_hash(hash_algo)

    def hash_request(request: Request) -> list[Any]:
        # vLLM reads NONE_HASH from a module global its engine core sets once; runs here use
        # several algorithms in one process, so each hashing call sets its own.
        kv_cache_utils.NONE_HASH = none_hash
        return hasher(request)

    return hash_request


def make_request(
    spec: RequestSpec, block_size: int = BLOCK_SIZE, lookahead: int = 0, hash_algo: str = "sha256"
) -> Request:
    """A vLLM request for `spec`, hashed as vLLM's engine core hashes it (`lookahead`: the
    config's `num_hash_lookahead_tokens`; `hash_algo`: its `prefix_caching_hash_algo`)."""
    return Request(
        request_id=spec.request_id,
        prompt_token_ids=None if spec.embeds else list(spec.prompt),
        prompt_embeds=prompt_embeddings(spec.prompt) if spec.embeds else None,
        sampling_params=None
        if spec.pooling
        else SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            prompt_logprobs=spec.prompt_logprobs,
            structured_outputs=None
            if spec.grammar is None
            else StructuredOutputsParams(json={"type": "object"}),
            extra_args=None
            if spec.kv_cache_report_mode is None
            else {"kv_cache_report_mode": spec.kv_cache_report_mode},
        ),
        pooling_params=PoolingParams() if spec.pooling else None,
        cache_salt=spec.cache_salt,
        lora_request=None if spec.lora is None else LoRARequest(*spec.lora),
        mm_features=[
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for identifier, offset, length in spec.mm
        ]
        or None,
        block_hasher=_block_hasher(block_size, lookahead, hash_algo),
        arrival_time=0.0,
        priority=spec.priority,
    )


def _stable_hash(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def block_ids(blocks: Any) -> tuple[list[int], ...] | None:
    """A manager's `KVCacheBlocks` (vLLM's or the adapter's) as block-id lists per group, for
    comparing; None stays None."""
    return None if blocks is None else tuple(list(g) for g in blocks.get_block_ids())


def with_pooling(workload: Sequence[RequestSpec]) -> list[RequestSpec]:
    """`workload` with every other request a pooling request (an embedding model's: no sampling
    parameters, one pooler output once its prompt is done) and every third asking for its
    prefix-cache hits to be published (`kv_cache_report_mode="full"`)."""
    return [
        dataclasses.replace(
            spec, pooling=i % 2 == 0, kv_cache_report_mode="full" if i % 3 == 0 else None
        )
        for i, spec in enumerate(workload)
    ]


class EventRecorder:
    """Stands in for vLLM's KV-event publisher: keeps every published batch, and their events in
    publication order."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def next_token(request_id: str, position: int) -> int:
    """The token the fake model samples for a request at a position (any scheduler)."""
    return _stable_hash(request_id, position) % VOCAB


# ----------------------------------------------------------------------------- fake execution


@dataclass
class Driver:
    """Plays the engine core loop around a scheduler: adds requests, executes steps."""

    scheduler: Any
    workload: list[RequestSpec]
    step: int = 0
    _next: int = 0
    _in_flight: deque[tuple[SchedulerOutput, set[str]]] = field(default_factory=deque)
    # The scheduler output of the last `timed_step`.
    last_output: SchedulerOutput | None = None
    # The data-parallel engine core's count of steps in the current wave, and whether the
    # wave runs (see `_end_step`).
    _wave_steps: int = 0
    _wave_running: bool = False
    # While the scheduler is paused (`pause`): the step to resume at and whether the caches
    # are still to be cleared.
    _pause: tuple[int, bool] | None = None
    # What `pause` and the steps since did: pauses, aborted requests, cache resets, resumes.
    pause_log: list[Any] = field(default_factory=list)
    # Grammars still compiling, by request id (see `GrammarSpec`).
    _grammars: dict[str, tuple[GrammarSpec, Future[Any]]] = field(default_factory=dict)

    def _admit(self) -> int:
        """Adds the requests that arrived by this step; returns the ns spent in the scheduler's
        `add_request` calls (making the requests, the engine core's work, not counted)."""
        elapsed = 0
        while (
            self._next < len(self.workload) and self.workload[self._next].arrival_step <= self.step
        ):
            spec = self.workload[self._next]
            request = self.make_request(spec)
            if spec.grammar is not None:
                # The engine core starts compiling the grammar before it adds the request.
                future: Future[Any] = Future()
                request.structured_output_request.grammar = future
                self._grammars[spec.request_id] = (spec.grammar, future)
            t0 = time.perf_counter_ns()
            self.scheduler.add_request(request)
            elapsed += time.perf_counter_ns() - t0
            self._next += 1
        for request_id, (grammar, future) in list(self._grammars.items()):
            if grammar.ready_at <= self.step:
                del self._grammars[request_id]
                if grammar.fails:
                    future.set_exception(ValueError("the grammar does not compile"))
                else:
                    future.set_result(FakeGrammar(request_id, grammar))
        return elapsed

    def make_request(self, spec: RequestSpec) -> Request:
        """The request for `spec`, hashed as vLLM's engine core hashes it for the scheduler."""
        return make_request(
            spec,
            # Requests are hashed every `hash_block_size` tokens (the gcd of the groups' block
            # sizes).
            self.scheduler.hash_block_size,
            self.scheduler.vllm_config.num_hash_lookahead_tokens,
            self.scheduler.vllm_config.cache_config.prefix_caching_hash_algo,
        )

    @property
    def done(self) -> bool:
        return (
            self._next == len(self.workload)
            and not self._in_flight
            and not self.scheduler.has_requests()
            and self._pause is None
        )

    def pause(self, mode: str, clear_cache: bool, resume_at: int) -> None:
        """An operator pauses the scheduler (EngineCoreProc.pause_scheduler): "abort" aborts
        every request and admits none, "wait" lets the running ones finish and admits none,
        "keep" schedules nothing. Once the engine is idle (no batch in flight, no request to
        step) the pause completes and, with `clear_cache`, resets the prefix cache, preempting
        the requests kept; from step `resume_at` on, the operator resumes (resume_scheduler)
        as soon as the pause completed. Arrivals meanwhile wait in the queue."""
        if mode == "abort":
            aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
            self.pause_log.append(("abort all", self.step, sorted(r.request_id for r in aborted)))
        self.scheduler.set_pause_state(
            PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        )
        self.pause_log.append(("pause", self.step, mode, clear_cache))
        self._pause = (resume_at, clear_cache)

    def _pause_step(self) -> None:
        if self._pause is None or self._in_flight or self.scheduler.has_requests():
            return
        resume_at, clear_cache = self._pause
        if clear_cache:
            reset = self.scheduler.reset_prefix_cache(reset_running_requests=True)
            self.pause_log.append(("cleared", self.step, reset))
            self._pause = (resume_at, False)
        elif self.step >= resume_at:
            self.scheduler.set_pause_state(PauseState.UNPAUSED)
            self.pause_log.append(("resume", self.step))
            self._pause = None

    @property
    def paused(self) -> bool:
        return self._pause is not None

    def _throttle_prefills(self) -> bool:
        """The engine core's `_should_throttle_prefills`: on the ranks of a data-parallel MoE
        model (DPEngineCoreProc; a dense model's ranks have data_parallel_size 1 here), prefills
        wait for every `prefill_schedule_interval`-th step of a wave."""
        interval = self.scheduler.scheduler_config.prefill_schedule_interval
        return (
            self.scheduler.parallel_config.data_parallel_size > 1
            and interval > 1
            and self._wave_steps % interval != 0
        )

    def _end_step(self, output: SchedulerOutput) -> None:
        """DPEngineCoreProc's busy loop after a step, the other ranks idle: a step that ran
        nothing with no request left does not count; every `dp_sync_interval` steps (and the
        first) the ranks agree whether the wave still runs; a wave that ended starts again at
        step 0."""
        unfinished = self.scheduler.has_unfinished_requests()
        if not (output.total_num_scheduled_tokens or unfinished or self._wave_running):
            return
        self._wave_steps += 1
        sync_interval = self.scheduler.parallel_config.dp_sync_interval
        if self._wave_steps == 1 or self._wave_steps % sync_interval == 0:
            self._wave_running = unfinished
        else:
            self._wave_running = True
        if not self._wave_running:
            self._wave_steps = 0

    def schedule(self) -> SchedulerOutput:
        self._pause_step()
        self._admit()
        self.step += 1
        output = self.scheduler.schedule(self._throttle_prefills())
        chunks = {
            rid
            for rid in output.num_scheduled_tokens
            if self.scheduler.requests[rid].is_prefill_chunk
        }
        self._in_flight.append((output, chunks))
        return output

    def finish_oldest(self) -> Any:
        """Runs the fake model on the oldest scheduled step and updates the scheduler."""
        output, chunks = self._in_flight.popleft()
        runner = self.fake_model_output(output, chunks)
        results = self.scheduler.update_from_output(output, runner)
        # Under async scheduling the drafts stay with the worker and the scheduler schedules
        # its placeholders (vLLM's engine core hands it no drafts then).
        if not self.scheduler.scheduler_config.async_scheduling:
            drafts = self.fake_drafts(output, chunks)
            if drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)
        return results

    def fake_model_output(self, output: SchedulerOutput, chunks: set[str]) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        # A pooling request's output: an embedding once its prompt is done, no token.
        pooled: list[torch.Tensor | None] = [None] * len(req_ids)
        for i, rid in enumerate(req_ids):
            request = self.scheduler.requests.get(rid)
            if request is not None and request.pooling_params is not None:
                sampled.append([])
                if rid not in chunks:
                    pooled[i] = torch.zeros(4)
                continue
            if rid in chunks:
                sampled.append([])
                continue
            position = request.num_tokens if request is not None else 0
            drafts = output.scheduled_spec_decode_tokens.get(rid, ())
            accepted = _stable_hash(rid, position, "accept") % (len(drafts) + 1)
            if (
                request is not None
                and request.use_structured_output
                and (
                    self.scheduler.use_v2_model_runner
                    or rid in (output.num_invalid_spec_tokens or {})
                )
            ):
                # The model accepts no draft the grammar rejected: the engine core padded
                # those with -1 once the grammar checked them (deferred sampling), and the
                # grammar's bitmask row at the first one rejects it. Model Runner V2 also
                # rejects every draft past the grammar-checked ones (`grammar_invalid_drafts`),
                # all of them when the step sampled without waiting (its drafts are -1
                # placeholders to the scheduler).
                accepted = min(accepted, len(strip_speculative_padding(list(drafts))))
            sampled.append([next_token(rid, position + k) for k in range(accepted + 1)])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            pooler_output=pooled if any(p is not None for p in pooled) else None,
        )

    def fake_drafts(self, output: SchedulerOutput, chunks: set[str]) -> DraftTokenIds | None:
        if not self.scheduler.num_spec_tokens:
            return None
        # As many drafts as the step asked for (dynamic speculative decoding picks them by
        # batch size), none when it said no request can use them (Model Runner V2).
        k = 0 if output.skip_drafts else output.num_spec_tokens_to_schedule
        req_ids = [
            rid
            for rid in output.num_scheduled_tokens
            if rid not in chunks and rid in self.scheduler.requests
        ]
        drafts = [
            [next_token(rid, self.scheduler.requests[rid].num_tokens + j) for j in range(k)]
            for rid in req_ids
        ]
        return DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts)

    def _validate_deferred_drafts(self, output: SchedulerOutput) -> None:
        """The engine core's deferred sampling (async scheduling): a step whose structured-output
        requests wait for the tokens of the step before samples once that step's output is in,
        after the grammars have checked the drafts the worker made meanwhile
        (`update_draft_token_ids_in_output`: rejected ones become -1)."""
        if not (output.pending_structured_output_tokens and self.scheduler.num_spec_tokens):
            return
        req_ids = [
            rid for rid in output.scheduled_spec_decode_tokens if rid in self.scheduler.requests
        ]
        drafts = [
            [
                next_token(rid, self.scheduler.requests[rid].num_tokens + j)
                for j in range(len(output.scheduled_spec_decode_tokens[rid]))
            ]
            for rid in req_ids
        ]
        self.scheduler.update_draft_token_ids_in_output(
            DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts), output
        )

    def timed_step(self) -> tuple[int, int, int]:
        """One synchronous step: (ns in the scheduler's `add_request` calls of the requests
        that arrived for it and in schedule(), ns in update_from_output(), requests running).
        Making the arrived requests and playing the model are not timed."""
        admitted = self._admit()
        self.step += 1
        t0 = time.perf_counter_ns() - admitted
        output = self.scheduler.schedule()
        t1 = time.perf_counter_ns()
        self.last_output = output
        chunks = {
            rid
            for rid in output.num_scheduled_tokens
            if self.scheduler.requests[rid].is_prefill_chunk
        }
        runner = self.fake_model_output(output, chunks)
        running = len(self.scheduler.running)
        t2 = time.perf_counter_ns()
        self.scheduler.update_from_output(output, runner)
        t3 = time.perf_counter_ns()
        return t1 - t0, t3 - t2, running

    def run(self, max_steps: int = 100_000) -> Iterator[tuple[SchedulerOutput, Any]]:
        """Yields (scheduler output, engine-core outputs of the step it completes)."""
        depth = max_concurrent_batches(self.scheduler)
        while not self.done:
            if self.step >= max_steps:
                raise RuntimeError(f"workload not finished after {max_steps} steps")
            output = self.schedule()
            results = []
            if output.pending_structured_output_tokens and len(self._in_flight) > 1:
                # The engine core defers this step's sampling and waits for the oldest batch
                # in flight, however few there are (`step_with_batch_queue`).
                results.append(self.finish_oldest())
                self._validate_deferred_drafts(output)
            while self._in_flight and (
                len(self._in_flight) >= depth or not self.scheduler.has_requests()
            ):
                results.append(self.finish_oldest())
            self._end_step(output)
            yield output, results


def _ids(block_ids: Any) -> Any:
    return None if block_ids is None else tuple(list(g) for g in block_ids)


def summarize(output: SchedulerOutput) -> dict[str, Any]:
    """A scheduler output as plain values: what two schedulers must agree on."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [
            (r.req_id, _ids(r.block_ids), r.num_computed_tokens) for r in output.scheduled_new_reqs
        ],
        "cached": [
            (rid, _ids(ids), n, rid in cached.resumed_req_ids, o)
            for rid, ids, n, o in zip(
                cached.req_ids,
                cached.new_block_ids,
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ],
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "total": output.total_num_scheduled_tokens,
        "spec": {k: list(v) for k, v in output.scheduled_spec_decode_tokens.items()},
        "finished": sorted(output.finished_req_ids),
        "preempted": sorted(output.preempted_req_ids or ()),
        "zero": output.new_block_ids_to_zero,
        "copies": output.kv_cache_block_copies,
        # Tokens sent back to the first pipeline stage (pipeline parallelism without async
        # scheduling), the drafts the step asks for and whether it skips them.
        "new_token_ids": [list(t) for t in cached.new_token_ids],
        "drafting": (output.num_spec_tokens_to_schedule, output.skip_drafts),
        # Structured output: whether the step samples under a grammar, whether that waits for
        # the step before (async scheduling), and the drafts the grammars rejected.
        "structured": (
            output.has_structured_output_requests,
            output.pending_structured_output_tokens,
            output.num_invalid_spec_tokens,
        ),
    }


def summarize_results(results: list[Any]) -> list[Any]:
    """Engine-core outputs of completed steps: per-request outputs, stats, usage."""
    summary = []
    for per_client in results:
        for client, outputs in sorted(per_client.items()):
            stats = outputs.scheduler_stats
            summary.append(
                (
                    client,
                    [
                        (o.request_id, list(o.new_token_ids), o.finish_reason, o.prefill_stats)
                        for o in outputs.outputs
                    ],
                    sorted(outputs.finished_requests or ()),
                    None
                    if stats is None
                    else (
                        stats.num_running_reqs,
                        stats.num_waiting_reqs,
                        stats.kv_cache_usage,
                        stats.prefix_cache_stats,
                    ),
                )
            )
    return summary
