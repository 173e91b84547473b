"""hybrid-kv inside vLLM 0.33: `vllm serve MODEL --scheduler-cls hybrid_kv.vllm.Scheduler`.

vLLM's own scheduler runs unchanged; its KV cache manager is hybrid-kv's. Importing this module
imports vLLM (`import hybrid_kv` alone never does), and fails with one message naming the
`vllm` extra when vLLM 0.33 is not installed. Install with `pip install 'hybrid-kv[vllm]'`.
"""

from hybrid_kv.vllm import _requirement  # noqa: F401  (first: a clear error without vLLM 0.33)
from hybrid_kv.vllm._manager import HybridKVCacheManager, KVCacheBlocks, Unsupported
from hybrid_kv.vllm._support import FALLBACKS, BuildContext, fallback_reason
from hybrid_kv.vllm.scheduler import AsyncScheduler, Scheduler, build_kv_cache_manager

__all__ = [
    "FALLBACKS",
    "AsyncScheduler",
    "BuildContext",
    "HybridKVCacheManager",
    "KVCacheBlocks",
    "Scheduler",
    "Unsupported",
    "build_kv_cache_manager",
    "fallback_reason",
]
