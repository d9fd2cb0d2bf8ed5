"""The runner alone, driven the way serving drives it: lanes end and join while the rest decode.

`ninfer bench` decodes a fixed batch; a server's batch churns. Here ROWS lanes decode, and every
CHURN steps the oldest ends and a new one joins with a PROMPT-token prompt: a mixed step (the
decode rows plus the new prompt), a host-fed step, then fed steps (each submitted before the
one before it is collected, its tokens that step's samples on the device), as the engine's step
task does. Random weights of a named shape: no model file needed. Prints ms a step and tok/s.

    python scripts/bench_churn.py [--random smollm2-135m] [--rows 64] [--churn 4] [--steps 600]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict

import numpy as np

from ninfer.cli import bench
from ninfer.core.runner import StepRow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", default="smollm2-135m", help="model shape (random weights)")
    ap.add_argument("--random-qtype", default="Q4_1")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--activations", default="q8")
    ap.add_argument("--rows", type=int, default=64, help="lanes decoding at once")
    ap.add_argument("--churn", type=int, default=4, help="steps between a lane ending and a new one joining")
    ap.add_argument("--prompt", type=int, default=166, help="prompt tokens of a joining lane")
    ap.add_argument("--steps", type=int, default=600)
    a = ap.parse_args()
    ns = argparse.Namespace(random=a.random, random_qtype=a.random_qtype, backend=a.backend, streams=[a.rows],
                            prompt_lens=[2 * a.prompt], decode_prompt=1, decode_tokens=a.steps, page_size=16,
                            max_context=None, activations=a.activations, kernel_cache=None, no_graphs=False,
                            model=None)  # fmt: skip
    model, name = bench._model(ns)
    runner, backend = bench._runner(model, ns)
    if hasattr(runner, "warm_up"):
        runner.warm_up(max_rows=a.rows)
    vocab = runner.spec.vocab_size
    rng = np.random.default_rng(0)
    pages = -(-(a.prompt + a.steps + 2) // 16)
    free = [np.arange(pages, dtype=np.int32) + i * pages for i in range(a.rows + 1)]
    lanes: OrderedDict[int, list] = OrderedDict()  # seq id -> [page table, position, last token]
    ids = iter(range(1 << 30))

    def join() -> StepRow:
        sid = next(ids)
        lanes[sid] = [free.pop(), 0, None]
        prompt = rng.integers(0, vocab, a.prompt).astype(np.int32)
        return StepRow(seq_id=sid, token_ids=prompt, start_pos=0, page_table=lanes[sid][0], sample=bench._greedy(0))

    def decode(ahead: int = 0, skip=None) -> list[StepRow]:
        """A decode row per lane: its last token (ahead 0), or the step's position + 1 (a fed row)."""
        return [StepRow(seq_id=s, token_ids=np.array([0 if ahead else t], np.int32), start_pos=p + ahead, page_table=tab,
                        sample=bench._greedy(p + ahead)) for s, (tab, p, t) in lanes.items() if s != skip]  # fmt: skip

    def commit(rows, results) -> None:
        for row, res in zip(rows, results):
            lane = lanes.get(row.seq_id)
            if lane is not None and res is not None:
                lane[1], lane[2] = row.start_pos + len(row.token_ids), res.token_id

    for _ in range(a.rows):  # every lane prefilled, one at a time
        row = join()
        commit([row], runner.step([row]))
    pipelined = bool(getattr(runner, "pipelined", False))
    pending, prev, n = None, None, 0
    t0 = time.perf_counter()
    while n < a.steps:
        if n % a.churn == 0:  # the oldest lane ends and a new one joins: a mixed step, then a host-fed one
            if pending is not None:
                commit(prev, runner.collect(pending))
            free.insert(0, lanes.popitem(last=False)[1][0])
            new = join()
            rows = decode(skip=new.seq_id) + [new]
            commit(rows, runner.step(rows))
            prev = decode()
            pending = runner.submit(prev)
            n += 2
        elif pipelined:  # submitted before the step before is collected; tokens fed on the device
            rows = decode(ahead=1)
            ahead = runner.submit(rows, feed=True)
            commit(prev, runner.collect(pending))
            prev, pending = rows, ahead
            n += 1
        else:
            commit(prev, runner.collect(pending))
            prev = decode()
            pending = runner.submit(prev)
            n += 1
    commit(prev, runner.collect(pending))
    dt = time.perf_counter() - t0
    print(f"{name} backend {backend} rows {a.rows} churn {a.churn}: {dt / n * 1e3:.3f} ms a step, "
          f"{a.rows * n / dt:.0f} tok/s")


if __name__ == "__main__":
    main()
