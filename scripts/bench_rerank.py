"""Rerank benchmark: one query against N documents of ~T tokens, through a running server.

    .venv/bin/ninfer serve &                      # or any server with Jina's /v1/rerank shape
    .venv/bin/python scripts/bench_rerank.py --url http://127.0.0.1:8080 [--documents 256]
                                             [--doc-words 150] [--repeats 3] [--json FILE]

Each document is made of seeded pseudo-sentences (a different seed per document, so no two
share more than the prompt's framing); the query is fixed. Every call sends all N documents in
one `POST /v1/rerank`; the figures are per call: documents/s, and prefill tok/s from the
response's `usage.total_tokens` (every prompt token the call prefilled or read from the cache),
the wall time measured at the client. The first call after start is shown apart (the server may
still compile or capture shapes it had not seen); the summary is the median of the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import numpy as np

QUERY = "Which notes describe repairs to a railway bridge after a flood?"
WORDS = (
    "bridge railway flood repair river engineer steel timber crew winter report council budget "
    "train station signal track storm archive ledger harbour ferry road tunnel survey mayor "
    "inspection delay cargo passenger museum letter photograph village market school canal "
    "lock mill quarry stone brick paint roof window garden orchard festival choir library"
).split()


def document(index: int, num_words: int) -> str:
    rng = np.random.default_rng(index)
    sentences, words = [], 0
    while words < num_words:
        n = int(rng.integers(8, 16))
        sentence = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=n))
        sentences.append(sentence.capitalize() + ".")
        words += n
    return f"Note {index}: " + " ".join(sentences)


def run(url: str, documents: list[str], api_key: str | None, timeout: float) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"query": QUERY, "documents": documents, "return_documents": False}
    t0 = time.perf_counter()
    r = httpx.post(url.rstrip("/") + "/v1/rerank", json=body, headers=headers, timeout=timeout)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    tokens = int(out["usage"]["total_tokens"])
    return {"wall_s": wall, "documents": len(documents), "tokens": tokens,
            "docs_per_s": len(documents) / wall, "prefill_tok_per_s": tokens / wall,
            "top": [res["index"] for res in out["results"][:3]]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--documents", type=int, default=256)
    ap.add_argument("--doc-words", type=int, default=150, help="words a document (~1.3 tokens a word)")
    ap.add_argument("--repeats", type=int, default=3, help="calls after the first")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None, help="write the runs here")
    args = ap.parse_args()

    docs = [document(i, args.doc_words) for i in range(args.documents)]
    runs = [run(args.url, docs, args.api_key, args.timeout) for _ in range(1 + args.repeats)]
    first, rest = runs[0], runs[1:] or runs[:1]
    print(f"{args.documents} documents, {first['tokens']} prompt tokens a call "
          f"(~{first['tokens'] // args.documents} a document, query and framing included)")  # fmt: skip
    print(f"{'call':>10} {'wall s':>8} {'docs/s':>9} {'prefill tok/s':>14}  top-3")
    for label, r in [("first", first)] + [(f"#{i + 1}", r) for i, r in enumerate(rest)]:
        print(f"{label:>10} {r['wall_s']:8.2f} {r['docs_per_s']:9.1f} {r['prefill_tok_per_s']:14,.0f}  {r['top']}")
    med = statistics.median(r["wall_s"] for r in rest)
    print(f"{'median':>10} {med:8.2f} {args.documents / med:9.1f} {first['tokens'] / med:14,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"documents": args.documents, "doc_words": args.doc_words, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
