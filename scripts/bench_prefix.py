"""Prefix-cache benchmark: time to first token for a long shared prompt, cold versus warm.

    .venv/bin/python scripts/bench_prefix.py [--model PATH_OR_NAME] [--backend reference|cuda]
                                             [--prompt-tokens 4000] [--repeats 3]
    python3 scripts/bench_prefix.py --backend cuda --random smollm2-135m   # random weights, real shapes

Every request is the same ~4,000-token shared prefix (a system prompt and earlier turns) plus a
short question of its own, sent through the real engine (`open_engine`) one at a time:

- cold: each request has a fresh `cache_salt`, so it can reuse nothing and prefills everything;
- warm: requests share one salt, primed by one earlier request, so only the question (and the
  prefix's last page, copied on write) is computed.

TTFT is the engine's own `Timings.ttft_s` (admission to first token); the ratio printed is
cold / warm. A warm request's floor is one forward over its ~20 new tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import trio

from ninfer.sched.config import EngineConfig
from ninfer.sched.engine import open_engine
from ninfer.sched.request import GenerationRequest

PAGE_SIZE = 16
QUESTIONS = [
    "Summarise the notes above in one sentence.",
    "Which item in the notes was mentioned first?",
    "List three keywords from the notes.",
    "What is the most surprising fact in the notes?",
    "Rewrite the first note as a question.",
    "Which note is the longest?",
]


class TextPrompts:
    """A chat-shaped prefix of numbered notes and ChatML questions, through the model's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prefix(self, num_tokens: int) -> list[int]:
        text = "<|im_start|>system\nYou are a careful assistant. Answer from these notes only.\n"
        ids: list[int] = []
        index = 0
        while len(ids) < num_tokens:
            index += 1
            text += f"Note {index}: the archive entry {index * 37 % 1009} records item {index} of the inventory.\n"
            ids = self.tokenizer.encode(text)
        return ids[:num_tokens]

    def question(self, index: int) -> list[int]:
        text = f"<|im_end|>\n<|im_start|>user\n{QUESTIONS[index % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n"
        return self.tokenizer.encode(text)


class RandomPrompts:
    """Random token ids (for random-weight models, which have no tokenizer)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def prefix(self, num_tokens: int) -> list[int]:
        return np.random.default_rng(0).integers(300, self.vocab_size, size=num_tokens).tolist()

    def question(self, index: int) -> list[int]:
        return np.random.default_rng(1000 + index).integers(300, self.vocab_size, size=20).tolist()


def make_runner(model, backend: str, num_pages: int):
    if backend == "cuda":
        from ninfer.gpu.cuda.runner import CudaRunner

        return CudaRunner(model, num_pages=num_pages, page_size=PAGE_SIZE)
    from ninfer.gpu.blas import limit_blas_threads
    from ninfer.gpu.reference import ReferenceRunner

    limit_blas_threads()  # as `ninfer` does for the reference backend
    return ReferenceRunner(model, num_pages=num_pages, page_size=PAGE_SIZE)


async def ttft_s(engine, prompt_ids: list[int], salt: str) -> tuple[float, int]:
    """(TTFT in seconds, prompt tokens served from the cache) of one request."""
    request = GenerationRequest(prompt_ids=tuple(prompt_ids), max_tokens=1, cache_salt=salt, ignore_eos=True)
    async with engine.submit(request) as stream:
        completion = await stream.collect()
    return completion.finished.timings.ttft_s, completion.finished.usage.cached_tokens


async def bench(runner, tokenizer, prompts, args) -> tuple[list, list]:
    max_context = min(runner.spec.max_context, args.prompt_tokens + 256)
    config = EngineConfig(max_context=max_context, page_size=PAGE_SIZE, prefill_chunk=args.prefill_chunk)
    prefix = prompts.prefix(args.prompt_tokens)
    async with open_engine(config, runner, tokenizer) as engine:
        await ttft_s(engine, prefix[:64] + prompts.question(0), "warm-up")
        cold = [await ttft_s(engine, prefix + prompts.question(i), f"cold-{i}") for i in range(args.repeats)]
        await ttft_s(engine, prefix + prompts.question(99), "warm")  # primes the shared prefix
        warm = [await ttft_s(engine, prefix + prompts.question(i), "warm") for i in range(args.repeats)]
    return cold, warm


def report(cold: list[tuple[float, int]], warm: list[tuple[float, int]]) -> None:
    for name, runs in (("cold", cold), ("warm", warm)):
        times = ", ".join(f"{t * 1e3:.1f}" for t, _ in runs)
        print(f"{name} TTFT: median {statistics.median(t for t, _ in runs) * 1e3:.1f} ms over {len(runs)}"
              f" ({times} ms), cached tokens {[c for _, c in runs]}")  # fmt: skip
    ratio = statistics.median(t for t, _ in cold) / statistics.median(t for t, _ in warm)
    print(f"cold / warm: {ratio:.1f}x")


def load(args):
    """(model, tokenizer, prompts) for the arguments."""
    if args.random:
        from ninfer.gpu.cuda.random_model import random_model, random_spec
        from ninfer.sched.fake import ByteTokenizer

        spec, weights = random_model(random_spec(args.random, max_context=args.prompt_tokens + 256))
        return (spec, weights), ByteTokenizer(), RandomPrompts(spec.vocab_size)
    from ninfer.runtime import load as load_model

    model = load_model(args.model, progress=False)
    return model, model.tokenizer, TextPrompts(model.tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or path (default: the registry default)")
    parser.add_argument("--random", default=None, help="random weights of a known shape (e.g. smollm2-135m)")
    parser.add_argument("--backend", default="reference", choices=("reference", "cuda"))
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    start = time.perf_counter()
    model, tokenizer, prompts = load(args)
    spec = model[0] if isinstance(model, tuple) else model.spec
    num_pages = 2 * -(-(args.prompt_tokens + 256) // PAGE_SIZE)  # the warm prefix stays while a cold one runs
    runner = make_runner(model, args.backend, num_pages)
    name = args.random or model.name
    print(f"{name} ({spec.num_layers} layers, d {spec.d_model}) on {args.backend}, ready in"
          f" {time.perf_counter() - start:.1f} s; shared prefix {args.prompt_tokens} tokens, page {PAGE_SIZE},"
          f" prefill chunk {args.prefill_chunk}")  # fmt: skip
    try:
        cold, warm = trio.run(bench, runner, tokenizer, prompts, args)
    finally:
        runner.close()
    report(cold, warm)


if __name__ == "__main__":
    main()
