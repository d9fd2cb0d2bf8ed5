"""Where a pipelined decode step's time goes (run on the GPU): one stream decoding with
lookahead (each step submitted fed by the one before, then the one before collected), its wall
per step, the GPU time between consecutive steps' events and the host's submit time, against
the fed and unfed graphs replayed alone.
    python scripts/lookahead_probe.py [--random SHAPE] [--qtype Q] [--steps N]"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

from ninfer.cli.bench import _greedy
from ninfer.gpu.cuda.runner import CudaRunner
from ninfer.gpu.cuda.random_model import random_model, random_spec
from ninfer.core.runner import StepRow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from tools.profile import _graph_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", default="smollm2-135m")
    ap.add_argument("--qtype", default="Q4_1")
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    model = random_model(random_spec(args.random), args.qtype)
    table = np.arange(-(-(args.steps + 140) // 16), dtype=np.int32)

    def rows(k, tok):
        return [StepRow(seq_id=0, token_ids=np.array([tok], np.int32), start_pos=k, page_table=table, sample=_greedy(k))]

    r = CudaRunner(model, num_pages=table.size + 1, page_size=16, max_batch_rows=1, max_context=args.steps + 140,
                   activations="q8")
    r.step([StepRow(seq_id=0, token_ids=np.arange(100, dtype=np.int32), start_pos=0, page_table=table,
                    sample=_greedy(0))])  # fmt: skip
    for rep in range(2):  # the first captures
        ev = [cuda.event() for _ in range(args.steps)]
        p = r.submit(rows(100, 1))
        sub_us, t0 = [], time.perf_counter()
        for k in range(args.steps):
            a = time.perf_counter()
            n = r.submit(rows(101 + k, 0), feed=True)
            ev[k].record(r.stream)
            sub_us.append(1e6 * (time.perf_counter() - a))
            r.collect(p)
            p = n
        r.collect(p)
        wall = 1e3 * (time.perf_counter() - t0) / (args.steps + 1)
    gaps = [cuda.event_elapsed_time(ev[k], ev[k + 1]) for k in range(args.steps - 1)]
    graph = [k for k in r._graphs.keys() if k[0] == "decode"][-1]  # fed or not, one graph
    print(f"{args.random} {args.qtype}: wall {wall:.3f} ms/step, event-to-event {statistics.median(gaps):.3f} ms, "
          f"submit {statistics.median(sub_us):.0f} us; the decode graph replayed alone: {_graph_time(r, graph):.3f} ms")
    r.close()


if __name__ == "__main__":
    main()
