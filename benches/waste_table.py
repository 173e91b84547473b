"""Print the README table: KV-cache waste of vLLM 0.33's grouping vs ours (min-waste).

For every catalogue preset and both strategies: groups, attention block size and waste % of
one resident request at 4k and 128k tokens (memory budget large enough not to matter).

    PYTHONPATH=python python3 benches/waste_table.py
"""

from __future__ import annotations

from collections import Counter

from hybrid_kv.catalogue import list_presets, load_model
from hybrid_kv.planner import KVCachePlan, plan_kv_cache

LENGTHS = (4096, 131072)
MEMORY = 2**50
COMMAND = "PYTHONPATH=python python3 benches/waste_table.py"


def _describe(plan: KVCachePlan) -> tuple[str, str, str]:
    block = plan.attention_block_size
    return (
        str(plan.num_groups),
        "-" if block is None else str(block),
        f"{plan.waste.waste_percent:.2f}%",
    )


def _layers(name: str) -> str:
    kinds = Counter(spec.kind for spec in load_model(name).layers.values())
    short = {"sliding_window": "sw", "chunked_local": "local", "shared": "shared"}
    return " + ".join(f"{n} {short.get(k, k)}" for k, n in kinds.items())


def main() -> None:
    header = ["model", "layers", "strategy"]
    for length in LENGTHS:
        tag = f"{length // 1024}k"
        header += [f"groups @{tag}", f"attn block @{tag}", f"waste @{tag}"]
    rows = [header, ["---"] * len(header)]
    for name in list_presets():
        layers = load_model(name).layers
        for strategy in ("vllm", "min-waste"):
            row = [name, _layers(name), strategy]
            for length in LENGTHS:
                row += _describe(plan_kv_cache(layers, MEMORY, length, strategy=strategy))
            rows.append(row)
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print(f"Reproduce: `{COMMAND}`")


if __name__ == "__main__":
    main()
