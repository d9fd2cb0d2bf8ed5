"""Lab: the served path's host cost, without a model's compute.

Starts `ninfer serve` on the default model's tokenizer and chat template, but with a runner
that samples instantly (or after `--step-ms`, a stand-in for the GPU step, slept off the event
loop as a real runner's wait would be). Drive it with `ninfer bench serve`: the tok/s it
reaches is the ceiling that the host work per token (delivery, detokenizing, JSON, SSE, the
socket write) leaves, the number the GPU's figures are then held against.

    python scripts/serve_host_path.py --port 8090 --step-ms 2 &
    ninfer bench serve --url http://127.0.0.1:8090 --concurrency 1,16,64 --output-tokens 256
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import numpy as np
import trio

from ninfer.core.runner import Pending, SampledToken, StepRow, check_feed, with_tokens
from ninfer.runtime import load
from ninfer.server.serve import serve
from ninfer.server.settings import ServerSettings


class InstantRunner:
    """Samples word-like tokens, never an end-of-sequence; no KV is computed (pages are ids only).

    `submit` returns at once and `collect` waits until `step_s` after the step began, as a
    GPU that runs one step at a time would (a step submitted while one runs starts after it)."""

    pipelined = True

    def __init__(self, spec, token_ids: list[int], *, num_pages: int, page_size: int, step_s: float):
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self._tokens = np.asarray(token_ids, np.int32)
        self._step_s = step_s
        self._busy_until = 0.0
        self._last = None
        self._lock = threading.Lock()

    @property
    def page_nbytes(self) -> int:
        return 1024

    def step(self, rows):
        return self.collect(self.submit(rows))

    def submit(self, rows, *, feed: bool = False) -> Pending:
        if feed:
            check_feed(self._last[0] if self._last else None, rows)
            rows = with_tokens(rows, self._last[1])
        out = []
        for row in rows:
            if row.sample is None:
                out.append(None)
                continue
            pos = row.start_pos + len(row.token_ids)
            out.append(SampledToken(token_id=int(self._tokens[(pos * 7 + row.seq_id) % len(self._tokens)]),
                                    logprob=-0.5))  # fmt: skip
        with self._lock:
            self._busy_until = max(self._busy_until, time.perf_counter()) + self._step_s
            done = self._busy_until
        self._last = (rows, out)
        return Pending(rows, (done, out))

    def collect(self, pending: Pending):
        done, out = pending.state
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return out

    def snapshot_pages(self, page_ids):
        from ninfer.core.runner import PageSnapshot

        return PageSnapshot((np.zeros(len(page_ids), np.uint8),))

    def restore_pages(self, page_ids, snapshot) -> None:
        pass

    def copy_pages(self, src_ids, dst_ids) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--step-ms", type=float, default=0.0, help="stand-in GPU time of one step")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--no-lookahead", action="store_true")
    parser.add_argument("--frame-gap-us", type=float, default=None,
                        help="as serve --frame-gap-us (default: the server's)")
    parser.add_argument("--no-gc-freeze", action="store_true", help="as serve --no-gc-freeze")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load(None)
    words = [t for t in (model.tokenizer.encode(" the of and a to in is you that it he was for on are as")) if t]
    page_size = 16
    runner = InstantRunner(model.spec, words, num_pages=64 * 4096 // page_size, page_size=page_size,
                           step_s=args.step_ms / 1e3)  # fmt: skip
    fields = dict(page_size=page_size, max_concurrency=args.max_concurrency, lookahead=not args.no_lookahead)
    try:
        from ninfer.sched.config import EngineConfig

        settings = ServerSettings(port=args.port, engine=EngineConfig(**fields))
    except TypeError:  # before ServerSettings composed an EngineConfig
        settings = ServerSettings(port=args.port, **fields)
    import attrs

    if args.frame_gap_us is not None:  # (the option is `serve --frame-gap-us`)
        settings = attrs.evolve(settings, frame_gap_us=args.frame_gap_us)
    if args.no_gc_freeze:
        settings = attrs.evolve(settings, gc_freeze=False)
    trio.run(lambda: serve(settings, model=model, runner=runner))


if __name__ == "__main__":
    main()
