"""The CUPTI timeline's arithmetic (tools/trace.py): each kernel is charged the end of its node
minus the end of the node before it, so overlapped starts (programmatic launch) are not
counted twice and the increments add up to the step's span from the first kernel's end."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("tools_trace", Path(__file__).resolve().parents[1] / "tools" / "trace.py")
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)  # tools/ is not an installed package
Kernel, summarize = trace.Kernel, trace.summarize


def _step(t0):
    # norm 0-3, gemv starts early at 2 (waits inside) and ends at 10, attn 9-14, combine 15-17
    return [Kernel("norm", t0 + 0, t0 + 3000), Kernel("gemv", t0 + 2000, t0 + 10000),
            Kernel("attn", t0 + 9000, t0 + 14000), Kernel("combine", t0 + 15000, t0 + 17000)]  # fmt: skip


def test_increments_charge_the_critical_path():
    s = summarize([_step(0), _step(100_000), _step(200_000)])
    k = s["kernels"]
    assert k["norm"]["increment_us"] == 3.0  # the first node: its own duration
    assert k["gemv"]["increment_us"] == 7.0  # 10 - 3, not its 8 us duration
    assert k["attn"]["increment_us"] == 4.0
    assert k["combine"]["increment_us"] == 3.0  # the gap before it is charged to it
    assert k["gemv"]["duration_us"] == 8.0
    assert s["span_us"] == 17.0
    assert sum(v["increment_us"] for v in k.values()) == s["span_us"]
    names = [n for n, *_ in s["nodes"]]
    assert names == ["norm", "gemv", "attn", "combine"]
    assert s["nodes"][1][3] == 1.0  # the gemv started 1 us before the norm ended


def test_repeated_kernels_sum_within_a_step_and_take_medians_across_steps():
    a = [Kernel("k", 0, 2000), Kernel("k", 2000, 5000)]
    b = [Kernel("k", 0, 4000), Kernel("k", 4000, 9000)]
    c = [Kernel("k", 0, 3000), Kernel("k", 3000, 6000)]
    s = summarize([a, b, c])
    assert s["kernels"]["k"]["per_step"] == 2
    assert s["kernels"]["k"]["increment_us"] == 6.0  # median of 5, 9, 6
