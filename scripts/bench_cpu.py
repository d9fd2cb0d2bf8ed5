"""CPU benchmark of the numpy reference runner: decode and prefill tokens/s, with the roofline.

    .venv/bin/python scripts/bench_cpu.py [--model PATH_OR_NAME] [--decode-steps 32]

Decode streams every float32 weight once per step, so its floor is `weight bytes / host memory
bandwidth` (measured here with a BLAS matrix-vector product over a large matrix). The ratio
printed is floor / measured step time (1.0 = at the bandwidth limit). Batched decode on a few
cores is compute-bound rather than memory-bound, which the falling ratio shows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ninfer.gpu.blas import available_cores, limit_blas_threads, num_blas_threads_in_use
from ninfer.gpu.reference import ReferenceRunner
from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow

GREEDY = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0)
PROMPT_TOKENS = 32  # prompt of each decoding sequence


def measure_read_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best-of bytes/s that BLAS streams a large float32 matrix through a matrix-vector product.

    That is the decode step's own access pattern (every weight read once, BLAS threads on), so
    it is the bandwidth the reference can actually reach, not a vendor's peak.
    """
    cols = 8192
    matrix = np.ones((num_bytes // 4 // cols, cols), dtype=np.float32)
    vector = np.ones(cols, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matrix @ vector
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best


def prompt_ids(vocab_size: int, num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, vocab_size, size=num_tokens).astype(np.int32)


def bench_decode(runner: ReferenceRunner, num_seqs: int, num_steps: int, num_warmup: int = 3) -> float:
    """Seconds per decode step with `num_seqs` sequences decoding together."""
    pages_per_seq = -(-(PROMPT_TOKENS + num_steps + num_warmup) // runner.page_size)
    tables = [np.arange(i * pages_per_seq, (i + 1) * pages_per_seq, dtype=np.int32) for i in range(num_seqs)]
    rows = [
        StepRow(seq_id=i, token_ids=prompt_ids(runner.spec.vocab_size, PROMPT_TOKENS, i), start_pos=0,
                page_table=tables[i], sample=GREEDY)
        for i in range(num_seqs)
    ]  # fmt: skip
    elapsed = 0.0
    for step in range(num_warmup + num_steps + 1):
        start = time.perf_counter()
        results = runner.step(rows)
        if step > num_warmup:  # step 0 is the prefill
            elapsed += time.perf_counter() - start
        rows = [
            StepRow(seq_id=row.seq_id, token_ids=np.array([res.token_id], dtype=np.int32),
                    start_pos=row.start_pos + len(row.token_ids), page_table=row.page_table, sample=GREEDY)
            for row, res in zip(rows, results, strict=True)
        ]  # fmt: skip
    return elapsed / num_steps


def bench_prefill(runner: ReferenceRunner, num_tokens: int, repeats: int = 3) -> float:
    """Best-of seconds to prefill one `num_tokens` prompt (after a warm-up run)."""
    table = np.arange(-(-num_tokens // runner.page_size), dtype=np.int32)
    row = StepRow(seq_id=0, token_ids=prompt_ids(runner.spec.vocab_size, num_tokens, 99), start_pos=0,
                  page_table=table, sample=GREEDY)  # fmt: skip
    runner.step([row])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.step([row])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the registry default)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()

    from ninfer.models.loader import load_model
    from ninfer.models.registry import ensure_model

    model = load_model(ensure_model(args.model, progress=True))
    max_seqs = max(args.batch)
    per_seq = -(-(PROMPT_TOKENS + args.decode_steps + 8) // 16)
    num_pages = max(max_seqs * per_seq, -(-args.prefill_tokens // 16))
    start = time.perf_counter()
    limit_blas_threads()  # as `ninfer` does for the reference backend (ninfer/gpu/blas.py)
    runner = ReferenceRunner(model, num_pages=num_pages, page_size=16)
    load_s = time.perf_counter() - start
    print(f"model {model.name}: stored weights {model.weights.nbytes / 1e6:.1f} MB, "
          f"float32 weights {runner.weight_nbytes / 1e6:.1f} MB (dequantized in {load_s:.1f} s)")  # fmt: skip
    print(f"{available_cores()} cores, BLAS threads {num_blas_threads_in_use()} (ninfer/gpu/blas.py; $NINFER_BLAS_THREADS)")
    bandwidth = measure_read_bandwidth()
    floor_s = runner.weight_nbytes / bandwidth
    print(f"host read bandwidth {bandwidth / 1e9:.1f} GB/s -> decode floor {floor_s * 1e3:.1f} ms/step "
          f"({1 / floor_s:.1f} steps/s)")  # fmt: skip
    for num_seqs in args.batch:
        step_s = bench_decode(runner, num_seqs, args.decode_steps)
        print(f"decode x{num_seqs}: {step_s * 1e3:.1f} ms/step, {num_seqs / step_s:.1f} tok/s, "
              f"floor/actual {floor_s / step_s:.2f}")  # fmt: skip
    prefill_s = bench_prefill(runner, args.prefill_tokens)
    print(f"prefill {args.prefill_tokens} tokens: {prefill_s:.2f} s, {args.prefill_tokens / prefill_s:.1f} tok/s")
    runner.close()


if __name__ == "__main__":
    main()
