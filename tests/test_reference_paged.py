"""Paged KV in the reference runner: layout, batching, snapshots and page copies change nothing."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from ninfer.core.params import SamplingParams
from ninfer.core.runner import Runner, SampleSpec, StepRow
from ninfer.gpu.reference import ReferenceRunner
from ninfer.models.spec import ModelSpec
from ninfer.models.weights import ModelWeights, StoredTensor

GREEDY = SamplingParams(temperature=0.0)


def sample_spec(params=GREEDY, seed=0, index=0) -> SampleSpec:
    return SampleSpec(params=params, seed=seed, token_index=index, want_logits=True)


def generate(runner, prompts, tables, num_tokens, *, params=GREEDY, seeds=None, chunk=13):
    """Decode every prompt together; prefill goes in `chunk`-token pieces, so one step mixes
    prefill chunks of some rows with decode tokens of others. Returns tokens and last logits."""
    seeds = seeds or [0] * len(prompts)
    pending = [list(p) for p in prompts]  # tokens still to feed per sequence
    positions, outputs, last_logits = [0] * len(prompts), [[] for _ in prompts], [None] * len(prompts)
    while any(len(out) < num_tokens for out in outputs):
        rows, active = [], []
        for i, feed in enumerate(pending):
            if len(outputs[i]) >= num_tokens:
                continue
            piece = feed[:chunk]
            is_last = len(piece) == len(feed)
            spec = sample_spec(params, seeds[i], len(outputs[i])) if is_last else None
            rows.append(StepRow(seq_id=i, token_ids=np.array(piece, dtype=np.int32), start_pos=positions[i],
                                page_table=tables[i], sample=spec))  # fmt: skip
            active.append(i)
        for i, row, result in zip(active, rows, runner.step(rows), strict=True):
            positions[i] += len(row.token_ids)
            pending[i] = pending[i][len(row.token_ids) :]
            if result is not None:
                outputs[i].append(result.token_id)
                last_logits[i] = result.logits
                pending[i] = [result.token_id]
    return outputs, last_logits


# -- the real model ---------------------------------------------------------------------------

CHATS = [
    "Tell me a short story about a robot.",
    "What is 12 times 7?",
    "Name a famous painting.",
    "How do I boil an egg? Answer step by step, with care and in detail.",
]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def float_model(smollm2):
    """SmolLM2's spec with weights dequantized once, so each runner only lays them out."""
    tensors = {name: StoredTensor("F32", t.shape, t.dequantize()) for name, t in smollm2.weights.items()}
    return smollm2.spec, ModelWeights(tensors, smollm2.spec.num_layers)


@pytest.fixture(scope="module")
def prompts(smollm2):
    render = smollm2.chat_template.render
    return [smollm2.tokenizer.encode(render([{"role": "user", "content": chat}])) for chat in CHATS]


def test_reference_runner_satisfies_the_protocol(float_model):
    runner = ReferenceRunner(float_model, num_pages=4, page_size=16)
    assert isinstance(runner, Runner)
    spec = float_model[0]
    assert runner.page_nbytes == 16 * 2 * spec.num_layers * spec.kv_dim * 4
    assert runner.snapshot_pages([1, 3]).nbytes == 2 * runner.page_nbytes


def test_page_size_and_page_order_do_not_change_greedy_tokens(float_model, prompts):
    prompt = prompts[0]
    num_positions = len(prompt) + NUM_TOKENS
    contiguous = ReferenceRunner(float_model, num_pages=1, page_size=num_positions)
    want_tokens, want_logits = generate(contiguous, [prompt], [np.array([0], dtype=np.int32)], NUM_TOKENS)
    rng = np.random.default_rng(0)
    for page_size in (1, 4, 16):
        num_pages = -(-num_positions // page_size)
        runner = ReferenceRunner(float_model, num_pages=2 * num_pages, page_size=page_size)
        identity = np.arange(num_pages, dtype=np.int32)
        scrambled = rng.permutation(2 * num_pages)[:num_pages].astype(np.int32)
        for table in (identity, scrambled):
            tokens, logits = generate(runner, [prompt], [table], NUM_TOKENS)
            assert tokens == want_tokens, (page_size, table)
            np.testing.assert_allclose(logits[0], want_logits[0], rtol=0, atol=1e-4 * np.abs(want_logits[0]).max())


def test_a_batch_of_four_equals_each_prompt_alone(float_model, prompts):
    runner = ReferenceRunner(float_model, num_pages=4 * 8, page_size=16)
    tables = [np.arange(i * 8, (i + 1) * 8, dtype=np.int32)[::-1].copy() for i in range(4)]
    batched, _ = generate(runner, prompts, tables, NUM_TOKENS)
    alone = [generate(runner, [p], [tables[0]], NUM_TOKENS)[0][0] for p in prompts]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == 4  # four prompts, four different answers


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(float_model, prompts):
    runner = ReferenceRunner(float_model, num_pages=4 * 8, page_size=16)
    tables = [np.arange(i * 8, (i + 1) * 8, dtype=np.int32) for i in range(4)]
    params = SamplingParams(temperature=0.9, top_p=0.95)
    seeds = [11, 12, 13, 14]
    batched, _ = generate(runner, prompts, tables, 12, params=params, seeds=seeds)
    alone = [generate(runner, [p], [tables[0]], 12, params=params, seeds=[s])[0][0] for p, s in zip(prompts, seeds)]
    assert batched == alone
    reseeded, _ = generate(runner, prompts, tables, 12, params=params, seeds=[21, 22, 23, 24])
    assert reseeded != batched


# -- a tiny random model (no file, no torch) -------------------------------------------------


def random_model(arch: str = "qwen2", seed: int = 0) -> tuple[ModelSpec, ModelWeights]:
    spec = ModelSpec(arch=arch, num_layers=2, d_model=32, d_ffn=64, num_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=97, max_context=128, rope_theta=1000.0, has_qkv_bias=arch == "qwen2",
                     has_qk_norm=arch == "qwen3")  # fmt: skip
    from ninfer.models.hf_dir import expected_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(spec).items():
        # Matrices ~ N(0, 0.3^2); norm weights and biases ~ 1 + N(0, 1), far from trivial.
        values = rng.standard_normal(shape) * 0.3 if len(shape) == 2 else 1.0 + rng.standard_normal(shape)
        tensors[name] = StoredTensor("F32", shape, values.astype(np.float32))
    return spec, ModelWeights(tensors, spec.num_layers)


PROMPT = [5, 17, 60, 3, 81, 42, 7, 8, 90, 11]


def test_rows_without_sample_return_none_and_chunking_matches_one_shot():
    model = random_model()
    runner = ReferenceRunner(model, num_pages=8, page_size=4)
    table = np.arange(3, dtype=np.int32)
    first = runner.step([StepRow(seq_id=0, token_ids=np.array(PROMPT[:6], dtype=np.int32), start_pos=0,
                                 page_table=table)])  # fmt: skip
    assert first == [None]
    rest = runner.step([StepRow(seq_id=0, token_ids=np.array(PROMPT[6:], dtype=np.int32), start_pos=6,
                                page_table=table, sample=sample_spec())])  # fmt: skip
    one_shot = runner.step([StepRow(seq_id=1, token_ids=np.array(PROMPT, dtype=np.int32), start_pos=0,
                                    page_table=table + 4, sample=sample_spec())])  # fmt: skip
    np.testing.assert_allclose(rest[0].logits, one_shot[0].logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_snapshot_then_restore_into_other_pages_resumes_exactly(arch):
    model = random_model(arch)
    runner = ReferenceRunner(model, num_pages=8, page_size=4)
    reference = ReferenceRunner(model, num_pages=8, page_size=4)
    want, _ = generate(reference, [PROMPT], [np.array([0, 1, 2, 3], dtype=np.int32)], 6)
    # Generate three tokens in pages 0-3, snapshot, let another sequence overwrite them.
    first, _ = generate(runner, [PROMPT], [np.array([0, 1, 2, 3], dtype=np.int32)], 3)
    snapshot = runner.snapshot_pages([0, 1, 2])
    generate(runner, [[9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]], [np.array([0, 1, 2, 3], dtype=np.int32)], 2)
    runner.restore_pages([6, 4, 5], snapshot)
    # Resume at position len(PROMPT) + 2 (the third token was sampled, not yet fed).
    table = np.array([6, 4, 5, 7], dtype=np.int32)
    tokens = list(first[0])
    for step in range(3):
        row = StepRow(seq_id=0, token_ids=np.array([tokens[-1]], dtype=np.int32), start_pos=len(PROMPT) + 2 + step,
                      page_table=table, sample=sample_spec())  # fmt: skip
        tokens.append(runner.step([row])[0].token_id)
    assert tokens == want[0]


def test_copy_pages_forks_a_shared_tail_page():
    model = random_model()
    runner = ReferenceRunner(model, num_pages=8, page_size=4)
    base = np.array([0, 1, 2, 3], dtype=np.int32)
    runner.step([StepRow(seq_id=0, token_ids=np.array(PROMPT, dtype=np.int32), start_pos=0, page_table=base)])
    runner.copy_pages([2], [5])  # positions 8-9 live in the partly filled tail page 2
    fork = np.array([0, 1, 5, 6], dtype=np.int32)
    a = runner.step([StepRow(seq_id=0, token_ids=np.array([20], dtype=np.int32), start_pos=10, page_table=base,
                             sample=sample_spec())])[0]  # fmt: skip
    b = runner.step([StepRow(seq_id=1, token_ids=np.array([30], dtype=np.int32), start_pos=10, page_table=fork,
                             sample=sample_spec())])[0]  # fmt: skip
    fresh = ReferenceRunner(model, num_pages=8, page_size=4)
    for token, result in ((20, a), (30, b)):
        want = fresh.step([StepRow(seq_id=2, token_ids=np.array(PROMPT + [token], dtype=np.int32), start_pos=0,
                                   page_table=base, sample=sample_spec())])[0]  # fmt: skip
        np.testing.assert_allclose(result.logits, want.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2 sources and 1 destinations"):
        runner.copy_pages([1, 2], [3])


def test_step_rejects_page_tables_too_short_and_positions_past_the_context():
    runner = ReferenceRunner(random_model(), num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="2 pages cannot hold 10 positions"):
        runner.step([StepRow(seq_id=0, token_ids=np.array(PROMPT, dtype=np.int32), start_pos=0,
                             page_table=np.array([0, 1], dtype=np.int32))])  # fmt: skip
    with pytest.raises(ValueError, match="past the context limit 128"):
        runner.step([StepRow(seq_id=0, token_ids=np.array([1], dtype=np.int32), start_pos=128,
                             page_table=np.zeros(33, dtype=np.int32))])  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_step_weight_bytes_leave_out_the_embedding_table_unless_it_is_the_head(tied):
    """The bench's bandwidth floor counts what a decode step reads: a step gathers a few rows
    of the embedding table, so an untied model's table is not part of the floor's bytes."""
    spec, weights = random_model("llama")
    if tied:
        spec = attrs.evolve(spec, tie_embeddings=True)
        weights = ModelWeights({k: v for k, v in weights.tensors.items() if k != "lm_head"}, spec.num_layers)
    runner = ReferenceRunner((spec, weights), num_pages=8, page_size=4)
    table = spec.vocab_size * spec.d_model * 4  # float32
    assert runner.step_weight_nbytes == runner.weight_nbytes - (0 if tied else table)


def test_feed_continues_the_step_before_or_says_why_not():
    """submit(feed=True) takes each row's token from the step before's sample (after `step` or
    `submit`): the logits equal a host-fed step's; rows that do not continue it are refused."""
    model = random_model()
    runner = ReferenceRunner(model, num_pages=8, page_size=4)
    table = np.arange(4, dtype=np.int32)
    prompt = StepRow(seq_id=0, token_ids=np.array(PROMPT, dtype=np.int32), start_pos=0, page_table=table,
                     sample=sample_spec())  # fmt: skip
    (first,) = runner.step([prompt])
    nxt = StepRow(seq_id=0, token_ids=np.zeros(1, np.int32), start_pos=len(PROMPT), page_table=table,
                  sample=sample_spec(index=1))  # fmt: skip
    (fed,) = runner.collect(runner.submit([nxt], feed=True))
    host = ReferenceRunner(model, num_pages=8, page_size=4)
    host.step([prompt])
    (want,) = host.step([attrs.evolve(nxt, token_ids=np.array([first.token_id], np.int32))])
    np.testing.assert_array_equal(fed.logits, want.logits)
    bad = {
        "no sample": (attrs.evolve(prompt, sample=None), nxt),
        "position": (prompt, attrs.evolve(nxt, start_pos=len(PROMPT) + 1)),
        "sequence": (prompt, attrs.evolve(nxt, seq_id=1)),
        "tokens": (prompt, attrs.evolve(nxt, token_ids=np.zeros(2, np.int32))),
    }
    for before, after in bad.values():
        runner = ReferenceRunner(model, num_pages=8, page_size=4)
        runner.step([before])
        with pytest.raises(ValueError, match="feed needs"):
            runner.submit([after], feed=True)
    with pytest.raises(ValueError, match="feed needs a step submitted before it"):
        ReferenceRunner(model, num_pages=8, page_size=4).submit([nxt], feed=True)
