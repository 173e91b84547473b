"""Print the README table: vLLM 0.33's plan beside min-waste's for every catalogue preset.

For each preset at `max_model_len` 4k and 128k with a 40 GiB budget: groups, attention block
size, expected waste over the default length distribution (log-uniform 128..max_model_len),
waste of one max_model_len request, and max concurrency (vLLM's figure: requests of
max_model_len the pool admits at once). min-waste is shown in the default layer-compact layout
(LBNHC) and in a block-outermost one (BLNHC), where a Mamba state may span several attention
pages.

    PYTHONPATH=python python3 benches/waste_table.py [--differences]

`--differences` prints only the presets where some min-waste plan differs from vLLM's.
"""

from __future__ import annotations

import sys
from collections import Counter

from hybrid_kv.catalogue import list_presets, load_model
from hybrid_kv.planner import InsufficientMemoryError, KVCachePlan, plan_kv_cache

LENGTHS = (4096, 131072)
MEMORY = 40 * 2**30
COMMAND = "PYTHONPATH=python python3 benches/waste_table.py"
VARIANTS = (("vllm", "LBNHC"), ("min-waste", "LBNHC"), ("min-waste", "BLNHC"))


def _describe(plan: KVCachePlan) -> list[str]:
    block = plan.attention_block_size
    return [
        str(plan.num_groups),
        "-" if block is None else str(block),
        f"{plan.waste.waste_percent:.2f}%",
        f"{plan.waste_at(plan.max_model_len).waste_percent:.2f}%",
        f"{plan.max_concurrency or 0:.1f}",
    ]


def _layers(name: str) -> str:
    kinds = Counter(spec.kind for spec in load_model(name).layers.values())
    short = {"sliding_window": "sw", "chunked_local": "local", "shared": "shared"}
    return " + ".join(f"{n} {short.get(k, k)}" for k, n in kinds.items())


def main(argv: list[str]) -> None:
    differences = "--differences" in argv
    for length in LENGTHS:
        tag = f"{length // 1024}k"
        print(f"max_model_len {length} ({tag}), 40 GiB:")
        print()
        header = ["model", "layers", "plan", "groups", "attn block", "expected waste"]
        header += [f"waste @{tag}", "max concurrency"]
        rows = [header, ["---"] * len(header)]
        same = []
        for name in list_presets():
            layers = load_model(name).layers
            preset_rows = []
            for strategy, layout in VARIANTS:
                label = strategy if strategy == "vllm" else f"{strategy} {layout}"
                try:
                    plan = plan_kv_cache(
                        layers, MEMORY, length, strategy=strategy, kv_cache_layout=layout
                    )
                    cells = _describe(plan)
                except InsufficientMemoryError:
                    cells = ["does not fit"] + [""] * 4
                preset_rows.append([name, _layers(name), label, *cells])
            if differences and all(r[3:] == preset_rows[0][3:] for r in preset_rows):
                same.append(name)
                continue
            rows.extend(preset_rows)
        for row in rows:
            print("| " + " | ".join(row) + " |")
        if same:
            print()
            print(f"Identical in all three plans: {', '.join(same)}.")
        print()
    print(f"Reproduce: `{COMMAND}{' --differences' if differences else ''}`")


if __name__ == "__main__":
    main(sys.argv[1:])
