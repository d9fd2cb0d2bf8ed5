"""The reference runner against Hugging Face `transformers` (CPU torch, float32).

Tiny random llama / qwen2 / qwen3 models: logits agree to fp32 precision through chunked
prefill and paged decode. The real SmolLM2 GGUF: greedy tokens equal transformers' own
GGUF-loaded model (it dequantizes the same bytes, so the weights are identical).
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow
from ninfer.gpu.reference import ReferenceRunner
from ninfer.models.hf_dir import load_hf_dir
from tiny_models import build_tiny_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GREEDY_LOGITS = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_logits=True)
# Each prompt is prefilled in these chunk sizes (the last chunk takes the rest), then decoded.
PROMPTS = {
    "long": (list(range(7, 200, 3)), (5, 17, 1000)),  # 65 tokens: positions well past one page
    "short": ([250, 4, 99], (1000,)),
    "single": ([42], (1000,)),
    "ragged": ([5, 17, 200, 3, 99, 42, 7, 8, 150, 11, 12, 13, 299], (1, 4, 1000)),
}
NUM_DECODE = 5
PAGE_SIZE = 4


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def chunks(tokens: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    out, start = [], 0
    for size in sizes:
        if start < len(tokens):
            out.append(tokens[start : start + size])
            start += size
    return out


def schedule(rng: np.random.Generator):
    """Per prompt: full token list (prompt + decode tokens) and its list of steps' tokens."""
    plans = {}
    for name, (prompt, sizes) in PROMPTS.items():
        decode = rng.integers(4, 300, size=NUM_DECODE).tolist()
        plans[name] = (prompt + decode, chunks(prompt, sizes) + [[t] for t in decode])
    return plans


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_logits_match_transformers_through_chunks_and_pages(tmp_path, arch):
    model = build_tiny_dir(tmp_path, arch, seed=3)
    runner = ReferenceRunner(load_hf_dir(tmp_path), num_pages=80, page_size=PAGE_SIZE)
    plans = schedule(np.random.default_rng(0))
    # Disjoint, scrambled page tables: every row's positions land in pages far apart.
    free = np.random.default_rng(1).permutation(80).astype(np.int32)
    tables = {name: free[i * 20 : (i + 1) * 20] for i, name in enumerate(plans)}
    with torch.no_grad():
        expected = {name: model(torch.tensor([full])).logits[0].numpy() for name, (full, _) in plans.items()}
    positions = dict.fromkeys(plans, 0)
    num_steps = max(len(steps) for _, steps in plans.values())
    for step in range(num_steps):
        active = [name for name, (_, steps) in plans.items() if step < len(steps)]
        rows = [
            StepRow(seq_id=i, token_ids=np.array(plans[name][1][step], dtype=np.int32),
                    start_pos=positions[name], page_table=tables[name], sample=GREEDY_LOGITS)
            for i, name in enumerate(active)
        ]  # fmt: skip
        results = runner.step(rows)
        for name, row, result in zip(active, rows, results, strict=True):
            positions[name] += len(row.token_ids)
            want = expected[name][positions[name] - 1]
            assert relative_error(result.logits, want) < 1e-4, (arch, name, step)
            assert result.token_id == int(np.argmax(want)) or np.sort(want)[-2] > want.max() - 1e-4


# -- the real model ---------------------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 50.",
]
NUM_GREEDY = 32
NEAR_TIE = 1e-3  # top-2 logit gap below which the two engines may disagree on the argmax


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation (no stop tokens) and its logits at every step."""
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            row = out.logits[0, -1].numpy().copy()
            logits.append(row)
            tokens.append(int(np.argmax(row)))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def test_smollm2_greedy_tokens_match_transformers_gguf(smollm2, hf_smollm2):
    prompts = [
        smollm2.tokenizer.encode(smollm2.chat_template.render([{"role": "user", "content": c}])) for c in CHATS
    ]
    runner = ReferenceRunner(smollm2, num_pages=4 * 8, page_size=16)
    tables = [np.arange(i * 8, (i + 1) * 8, dtype=np.int32) for i in range(len(prompts))]
    expected = [hf_greedy(hf_smollm2, p, NUM_GREEDY) for p in prompts]
    # All four prompts prefill in one batch, then decode together, fed transformers' tokens
    # (teacher forcing) so one near-tie cannot derail the rest of the comparison.
    rows = [StepRow(seq_id=i, token_ids=np.array(p, dtype=np.int32), start_pos=0, page_table=tables[i],
                    sample=GREEDY_LOGITS) for i, p in enumerate(prompts)]  # fmt: skip
    disagreements = []
    for step in range(NUM_GREEDY):
        results = runner.step(rows)
        for i, result in enumerate(results):
            want_tokens, want_logits = expected[i]
            want = want_logits[step]
            assert relative_error(result.logits, want) < 1e-3, (i, step)
            if result.token_id != want_tokens[step]:
                top2 = np.sort(want)[-2:]
                assert top2[1] - top2[0] < NEAR_TIE, (i, step, result.token_id, want_tokens[step])
                disagreements.append((i, step))
        rows = [
            StepRow(seq_id=i, token_ids=np.array([expected[i][0][step]], dtype=np.int32),
                    start_pos=row.start_pos + len(row.token_ids), page_table=tables[i], sample=GREEDY_LOGITS)
            for i, row in enumerate(rows)
        ]  # fmt: skip
    # At most one near-tie step in the whole run; every other token is identical.
    assert len(disagreements) <= 1, disagreements
