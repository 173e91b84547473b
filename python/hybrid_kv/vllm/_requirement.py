"""The vLLM release the plugin needs, checked before anything imports vLLM's internals: without
vLLM, or under another release, `import hybrid_kv.vllm` fails with one message naming the
`vllm` extra instead of an error from deep inside vLLM (or a scheduler serving with another
release's semantics)."""

from __future__ import annotations

__all__ = ["VLLM_RELEASE", "check_vllm_version"]

VLLM_RELEASE = "0.33"
"""The vLLM release whose scheduler and KV cache manager the plugin follows."""

_INSTALL = "pip install 'hybrid-kv[vllm]' (vllm>=0.33,<0.34)"


def check_vllm_version(version: str) -> None:
    """Raise `ImportError` unless `version` is a 0.33 release (`0.33.0`, `0.33.1rc1`, ...)."""
    if version != VLLM_RELEASE and not version.startswith(VLLM_RELEASE + "."):
        raise ImportError(
            f"hybrid_kv.vllm follows vLLM {VLLM_RELEASE}, but vLLM {version} is installed: "
            f"{_INSTALL}",
            name="vllm",
        )


try:
    import vllm
except ImportError as error:
    raise ModuleNotFoundError(
        f"hybrid_kv.vllm needs vLLM {VLLM_RELEASE}: {_INSTALL}", name="vllm"
    ) from error

check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
