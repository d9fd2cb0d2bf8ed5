"""Kernel-by-kernel timeline of a captured graph through CUPTI's activity API (cupti-python),
for GPU machines without Nsight Systems (GPU only; a diagnostic, not a dependency).

    python -m tools.profile --random llama3-8b --random-qtype Q8_0 --activations q8 \
        --streams 1 --trace 20      # each variant: 20 replays of its decode graph, kernel by kernel

What a kernel costs inside a step is not its duration: with programmatic dependent launch a
kernel starts while the one before still runs and waits inside (griddepcontrol.wait). So the
summary charges each kernel its *end-to-end increment*, the end of its node minus the end of
the node before it in stream order: the step's critical path, cut at kernel ends. Summed over
a step's kernels it is the step's device time from the first kernel's end.

`cupti-python` and its libcupti are not in the project's dependencies: a device run installs
them from carried wheels (scripts/device_run.sh `trace`), matched to the driver's CUDA.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import attrs


@attrs.frozen
class Kernel:
    name: str
    start: int  # ns, GPU timestamps
    end: int


_RECORDS: list = []  # what CUPTI's buffer-completed callback hands over, until taken
_REGISTERED = False


def _completed(activities) -> None:
    _RECORDS.extend((a.name, a.start, a.end) for a in activities if hasattr(a, "end") and hasattr(a, "name"))


def record_replays(replay, sync, reps: int) -> list[list[Kernel]]:
    """`reps` calls of `replay()` (one graph launch each, then `sync()`), each one's kernels in
    stream order (by start, ties by end)."""
    global _REGISTERED
    from cupti import cupti

    from ninfer.gpu.cuda.kernels import pdl

    if not _REGISTERED:  # once a process: CUPTI keeps the callbacks
        cupti.activity_register_callbacks(lambda: (8 << 20, 0), _completed)
        _REGISTERED = True
    _RECORDS.clear()
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    bounds = []
    try:
        for _ in range(reps):
            sync()
            t0 = cupti.get_timestamp()  # ns, the activity records' clock
            replay()
            sync()
            bounds.append((t0, cupti.get_timestamp()))
    finally:
        cupti.activity_flush_all(1)
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    kernels = sorted((Kernel(pdl.python_name(n) or n, a, b) for n, a, b in _RECORDS), key=lambda k: (k.start, k.end))
    _RECORDS.clear()
    return [[k for k in kernels if lo <= k.start <= hi] for lo, hi in bounds]


def summarize(steps: list[list[Kernel]]) -> dict:
    """Per kernel name: launches a step, and medians over steps of the summed end-to-end
    increments (us) and summed durations (us); the step's span; one step's per-node rows."""
    inc = defaultdict(list)
    dur = defaultdict(list)
    count = {}
    spans = []
    for ks in steps:
        i_sum = defaultdict(float)
        d_sum = defaultdict(float)
        c = defaultdict(int)
        for prev, k in zip([None] + ks[:-1], ks):
            i_sum[k.name] += (k.end - (prev.end if prev else k.start)) / 1e3
            d_sum[k.name] += (k.end - k.start) / 1e3
            c[k.name] += 1
        for n in c:
            inc[n].append(i_sum[n])
            dur[n].append(d_sum[n])
        count = dict(c)
        spans.append((ks[-1].end - ks[0].start) / 1e3 if ks else 0.0)
    mid = steps[len(steps) // 2] if steps else []
    rows = [(k.name, (k.end - (p.end if p else k.start)) / 1e3, (k.end - k.start) / 1e3,
             ((p.end - k.start) / 1e3) if p else 0.0) for p, k in zip([None] + mid[:-1], mid)]  # fmt: skip
    return {
        "span_us": statistics.median(spans) if spans else 0.0,
        "kernels": {n: {"per_step": count.get(n, 0), "increment_us": statistics.median(inc[n]),
                        "duration_us": statistics.median(dur[n])} for n in inc},  # fmt: skip
        "nodes": rows,
    }


def print_summary(label: str, s: dict, layer_window: tuple[int, int] | None = None) -> None:
    print(f"-- trace {label}: step span {s['span_us']:.1f} us (median over replays)")
    print(f"   {'kernel':<28} {'a step':>6} {'increment us':>13} {'per launch':>11} {'duration us':>12}")
    for n, k in sorted(s["kernels"].items(), key=lambda kv: -kv[1]["increment_us"]):
        per = k["increment_us"] / max(1, k["per_step"])
        print(f"   {n:<28} {k['per_step']:>6} {k['increment_us']:>13.1f} {per:>11.2f} {k['duration_us']:>12.1f}")
    if layer_window:
        lo, hi = layer_window
        print("   one step, nodes", lo, "to", hi - 1, "(increment / duration / started before the previous ended, us):")
        for n, i, d, early in s["nodes"][lo:hi]:
            print(f"     {n:<28} {i:8.2f} {d:8.2f} {early:8.2f}")
