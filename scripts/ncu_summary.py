"""Per-kernel totals of an `ncu --csv --metrics gpu__time_duration.sum` log (one captured step).

    python scripts/ncu_summary.py ncu.csv [--order N]

Prints each kernel (numba's mangled name cut to its Python function) with its launch count,
total and mean device time, the step's total, and with --order the first N launches in order.
"""

import csv
import re
import sys
from collections import defaultdict


def short(name: str) -> str:
    """`_ZN6cudapy5ninfer...10gemv_folds10gemv_fused...` -> `gemv_fused` (the last Python identifier)."""
    parts = re.findall(r"(\d+)([A-Za-z_][A-Za-z0-9_]*)", name)
    words = []
    for n, rest in parts:
        words.append(rest[: int(n)])
    words = [w for w in words if w and w not in ("cudapy", "ninfer", "gpu", "cuda", "kernels") and not w.startswith("_")]
    return words[-1] if words else name[:40]


def main(argv) -> int:
    path = argv[0]
    order = int(argv[argv.index("--order") + 1]) if "--order" in argv else 0
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    by = defaultdict(list)
    seq = []
    for r in rows:
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1e3 if r["Metric Unit"] in ("nsecond", "ns") else v * (1e3 if r["Metric Unit"] in ("msecond", "ms") else 1)
        k = f"{short(r['Kernel Name'])} {r['Grid Size']}x{r['Block Size']}"
        by[k].append(us)
        seq.append((k, us))
    total = sum(us for _, us in seq)
    print(f"{len(seq)} launches, {total:.1f} us of device time")
    for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(v):9.1f} us  {len(v):4d} x {sum(v) / len(v):7.2f} us  {k}")
    for k, us in seq[:order]:
        print(f"  {us:8.2f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
