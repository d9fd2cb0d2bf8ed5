"""Where one captured step's time goes on the GPU's own clock, from an Nsight Systems trace.

    nsys profile --cuda-graph-trace=node --capture-range=cudaProfilerApi -o step \
        python3 -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 --ncu --streams 1
    nsys stats --report cuda_gpu_trace --format csv --output step step.nsys-rep
    python scripts/timeline_summary.py step_cuda_gpu_trace.csv

Unlike ncu (one kernel at a time, caches flushed or not), the trace keeps the step's overlaps:
under programmatic edges a kernel starts before the one ahead of it ends. Per kernel (its
Python name and grid) it prints the launches, the mean duration, and the mean time from the
end of the kernel before to this one's end: what the kernel adds to the step's span. The sum of
that last column over the step is the step's span.
"""

import csv
import sys
from collections import defaultdict

from ncu_summary import short


def kernel_name(name: str) -> str:
    """The Python function of a numba kernel, from a demangled name (`cudapy::...::gemv_split
    [abi:...](...)`) or a mangled one (ncu_summary.short)."""
    if "::" in name:
        return name.split("[", 1)[0].split("(", 1)[0].split("::")[-1]
    return short(name)


def _col(header, *names):
    for i, h in enumerate(header):
        if any(h.startswith(n) for n in names):
            return i
    raise SystemExit(f"no column {names} in {header}")


def main(argv) -> int:
    with open(argv[0], newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    i_start, i_dur, i_name = _col(header, "Start"), _col(header, "Duration"), _col(header, "Name")
    i_grid = [_col(header, g) for g in ("GrdX", "GrdY", "GrdZ")] if "GrdX" in header else []
    kernels = []
    for r in body:
        name = r[i_name]
        if name.startswith("[CUDA mem"):  # the step's input / output copies count as steps too
            kind = name
        else:
            kind = kernel_name(name) + ("" if not i_grid else " " + "x".join(r[i] for i in i_grid))
        start, dur = float(r[i_start]), float(r[i_dur])
        kernels.append((start, start + dur, kind))
    kernels.sort()
    by = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = kernels[0][0] if kernels else 0.0
    for start, end, kind in kernels:
        added = max(0.0, end - max(prev_end, start)) + max(0.0, start - prev_end)
        b = by[kind]
        b[0] += 1
        b[1] += end - start
        b[2] += added
        prev_end = max(prev_end, end)
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    print(f"{len(kernels)} entries, span {span:.1f} us")
    print(f"{'adds':>10} {'n':>5} {'mean':>8} {'adds/n':>8}  kernel")
    for kind, (n, dur, added) in sorted(by.items(), key=lambda kv: -kv[1][2]):
        print(f"{added / 1e3:10.1f} {n:5d} {dur / n / 1e3:8.2f} {added / n / 1e3:8.2f}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
