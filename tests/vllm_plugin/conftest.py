"""The vLLM plugin's tests need vLLM 0.33 (installed without its dependency tree, see .ci/run).

Without vLLM each module is skipped with that reason (`pytest.importorskip`), unless
HYBRID_KV_REQUIRE_VLLM=1 (CI's vLLM step), which turns a missing vLLM into a failure. vLLM picks
its platform once, at first use: on a machine without a GPU it is told here to use the CPU
platform before any test imports it.
"""

import importlib.util
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if os.environ.get("HYBRID_KV_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
    raise RuntimeError("HYBRID_KV_REQUIRE_VLLM=1 but vLLM is not installed")

NO_VLLM = "vLLM 0.33 is not installed (pip install --no-deps vllm==0.33.0; see .ci/run)"
