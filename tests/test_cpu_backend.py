"""The cpu backend (`ninfer.cpu`): numba kernels over stored GGUF blocks, under the reference
runner's forward.

Each kernel against its numpy twin for every supported type, at several shapes and thread
counts; the runner against the reference backend on the real SmolLM2 GGUF (logits within the
q8-activation tolerance, greedy tokens); the scheduler's invariants (pause / resume, lookahead)
on a quantized tiny model; the runtime's backend choice.
"""

from __future__ import annotations

import attrs
import gguf.quants
import numba
import numpy as np
import pytest
import test_sched_reference as sched_tests
from gguf import GGMLQuantizationType
from heldout import HELDOUT_TEXT
from tiny_models import tiny_llama

from ninfer.cpu.blocks import BLOCK_BYTES, F16_TABLE, QTYPES
from ninfer.cpu.fused import add_norm_quant, rope_store, swiglu_quant
from ninfer.cpu.gemm import dequantize_rows, gemm_half, gemm_q8, part_list, quantize_rows, quantize_rows_ref
from ninfer.cpu.matrix import BLAS_FROM, QuantMatrix
from ninfer.cpu.runner import CpuRunner
from ninfer.cpu.sync import safe_layer
from ninfer.gpu import quality
from ninfer.gpu.reference import ReferenceRunner
from ninfer.models.weights import ModelWeights, StoredTensor

K_QUANTS = ("Q4_K", "Q6_K")  # gguf has no quantizer for them: blocks are written by hand


def stored(qtype: str, rows: int, cols: int, seed: int = 0) -> StoredTensor:
    """A random [rows, cols] weight in `qtype`: gguf's quantizer, or (K-quants, which gguf
    cannot quantize) random bytes with sane fp16 scales written into each super-block."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        weights = rng.standard_normal((rows, cols)).astype(np.float32)
        return StoredTensor(qtype, (rows, cols), gguf.quants.quantize(weights, GGMLQuantizationType[qtype]))
    blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)

    def scales():
        values = (rng.random(blocks.shape[:2]) * 0.01 + 1e-3).astype(np.float16)
        return values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if qtype == "Q4_K":  # d, dmin lead the super-block
        blocks[..., 0:2], blocks[..., 2:4] = scales(), scales()
    else:  # Q6_K: d closes it
        blocks[..., 208:210] = scales()
    return StoredTensor(qtype, (rows, cols), blocks.reshape(rows, -1))


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view, as `QuantMatrix` hands the kernels (one compiled specialization)."""
    view = a.view()
    view.flags.writeable = False
    return view


def q8_product(tensor: StoredTensor, x: np.ndarray, num_threads: int) -> np.ndarray:
    xq, xd, xs = quantize_rows_ref(x)
    out = np.full((x.shape[0], tensor.shape[0] + 3), np.nan, np.float32)
    gemm_q8(xq, xd, xs, part_list([tensor.data]), np.array([QTYPES[tensor.qtype]]), F16_TABLE, out, np.array([3]),
            num_threads, 0, 1)  # fmt: skip
    assert np.isnan(out[:, :3]).all(), "the kernel wrote outside its columns"
    return out[:, 3:]


# -- kernels --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_quantize_rows_matches_numpy(num_tokens):
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, 96)).astype(np.float32) * 3
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros with scale 0
    xq, xd, xs = (np.empty((num_tokens, 96), np.int8), *(np.empty((num_tokens, 3), np.float32) for _ in "ds"))
    quantize_rows(x, xq, xd, xs)
    want_q, want_d, want_s = quantize_rows_ref(x)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_allclose(xd, want_d, rtol=1e-6)
    np.testing.assert_allclose(xs, want_s, rtol=1e-5, atol=1e-6)
    assert np.abs(xq).max() <= 127 and (xd[0, 0], xs[0, 0]) == (0.0, 0.0)


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize(
    ("rows", "cols", "num_tokens", "num_threads"), [(5, 256, 1, 1), (33, 512, 3, 2), (64, 768, 9, 2)]
)
def test_q8_product_is_exactly_the_dequantized_product(qtype, rows, cols, num_tokens, num_threads):
    """The kernel computes dequantize(q8(x)) @ dequantize(W).T (float64 twin) to float32
    rounding, and stays within the q8 tolerance of the float product."""
    tensor = stored(qtype, rows, cols, seed=rows)
    x = np.random.default_rng(cols).standard_normal((num_tokens, cols)).astype(np.float32)
    got = q8_product(tensor, x, num_threads)
    weights = tensor.dequantize().astype(np.float64)
    xq, xd, _ = quantize_rows_ref(x)
    x_hat = (xq.reshape(num_tokens, -1, 32) * xd[..., None].astype(np.float64)).reshape(num_tokens, cols)
    exact = x_hat @ weights.T
    scale = np.abs(exact).max()
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * scale)
    assert np.abs(got - x @ weights.T).max() < 0.03 * scale


@pytest.mark.parametrize(("qtype", "cols"), [("Q4_1", 544), ("Q8_0", 512), ("Q6_K", 512)])
@pytest.mark.parametrize("num_tokens", [5, 6])
def test_a_batched_row_gets_what_it_gets_alone(qtype, cols, num_tokens):
    """Alone (the fused path) or in a batch of any size (decoded once, tokens in pairs and a
    last odd one): the same integer block dots summed in the same order, so bit for bit the
    same result; the scheduler's "same tokens alone or batched" rests on it. 544 columns: an
    odd number of blocks."""
    tensor = stored(qtype, 40, cols)
    x = np.random.default_rng(1).standard_normal((num_tokens, cols)).astype(np.float32)
    together = q8_product(tensor, x, 2)
    for t in range(num_tokens):
        np.testing.assert_array_equal(q8_product(tensor, x[t : t + 1], 1)[0], together[t])


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_rows_is_gguf_bit_for_bit(qtype):
    """The prefill path's dequantizer (chunks of rows for BLAS) against gguf's numpy one."""
    tensor = stored(qtype, 9, 512, seed=3)
    out = np.full((5, 512), np.nan, np.float32)
    dequantize_rows(readonly(tensor.data), QTYPES[qtype], F16_TABLE, out, 2, 7, 2)
    np.testing.assert_array_equal(out, tensor.dequantize()[2:7])


def test_fused_steps_match_the_reference_math():
    """add_norm_quant / rope_store / swiglu_quant against the reference forward's numpy."""
    from ninfer.gpu.reference import apply_rope, rms_norm, silu

    rng = np.random.default_rng(7)
    x, add = (rng.standard_normal((3, 64)).astype(np.float32) for _ in "xa")
    weight = rng.standard_normal(64).astype(np.float32)
    new_x, h = np.empty_like(x), np.empty_like(x)
    xq, xd, xs = np.empty((3, 64), np.int8), np.empty((3, 2), np.float32), np.empty((3, 2), np.float32)
    add_norm_quant(x, add, weight, np.float32(1e-5), new_x, h, xq, xd, xs)
    np.testing.assert_array_equal(new_x, x + add)
    np.testing.assert_allclose(h, rms_norm(x + add, weight, 1e-5), rtol=1e-5, atol=1e-6)
    want_q, want_d, _ = quantize_rows_ref(h)
    assert np.abs(xq.astype(int) - want_q).max() <= 1 and np.allclose(xd, want_d, rtol=1e-6)

    heads, kv_heads, head_dim, half = 4, 2, 16, 8
    qkv = rng.standard_normal((3, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    angles = rng.random((3, half)).astype(np.float32) * 6
    cos, sin = np.cos(angles), np.sin(angles)
    k_pool, v_pool = np.zeros((4, 2, kv_heads, head_dim), np.float32), np.zeros((4, 2, kv_heads, head_dim), np.float32)
    pages, slots = np.array([3, 0, 3]), np.array([1, 0, 0])
    q = np.empty((3, heads, head_dim), np.float32)
    kv_dim = kv_heads * head_dim
    rope_store(qkv, heads * head_dim, kv_dim, heads, kv_heads, head_dim, cos, sin, k_pool, v_pool, pages, slots, q)
    rope = (cos[:, None], sin[:, None])
    np.testing.assert_allclose(q, apply_rope(qkv[:, : heads * head_dim].reshape(3, heads, head_dim), *rope), atol=1e-6)
    k = apply_rope(qkv[:, heads * head_dim : heads * head_dim + kv_dim].reshape(3, kv_heads, head_dim), *rope)
    np.testing.assert_allclose(k_pool[pages, slots], k, atol=1e-6)
    np.testing.assert_array_equal(v_pool[pages, slots], qkv[:, heads * head_dim + kv_dim :].reshape(3, kv_heads, -1))

    gate_up = rng.standard_normal((3, 64)).astype(np.float32) * 30  # exp(-g) overflows for some
    act = np.empty((3, 32), np.float32)
    no_rows = np.empty((0, 32), np.int8), np.empty((0, 1), np.float32), np.empty((0, 1), np.float32)
    swiglu_quant(gate_up, 32, act, *no_rows)
    np.testing.assert_allclose(act, silu(gate_up[:, :32]) * gate_up[:, 32:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize(("rows", "cols", "num_tokens"), [(3, 8, 1), (21, 40, 4)])
def test_half_product_matches_numpy(qtype, rows, cols, num_tokens):
    rng = np.random.default_rng(rows)
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == "F16":
        bits = weights.astype(np.float16).view(np.uint16)
    else:  # bf16: the high half of each float32
        bits = (weights.view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    out = np.zeros((num_tokens, rows), np.float32)
    gemm_half(x, readonly(bits), qtype == "BF16", F16_TABLE, out, 0, 2)
    want = x @ StoredTensor(qtype, (rows, cols), bits if qtype == "BF16" else bits.view(np.float16)).dequantize().T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_a_stacked_matrix_of_mixed_types_multiplies_and_looks_up_rows():
    """q / k / v of different stored types (as in Q4_K_M files), an F32 part and an F16 part:
    `x @ m.T` and `m[rows]` agree with the dequantized stack."""
    parts = [stored("Q6_K", 8, 256, 1), stored("Q4_K", 5, 256, 2), stored("Q8_0", 3, 256, 3)]
    rng = np.random.default_rng(4)
    parts.append(StoredTensor("F32", (2, 256), rng.standard_normal((2, 256)).astype(np.float32)))
    parts.append(StoredTensor("F16", (4, 256), rng.standard_normal((4, 256)).astype(np.float16)))
    matrix = QuantMatrix(parts)
    dense = np.concatenate([p.dequantize() for p in parts])
    for num_tokens in (3, BLAS_FROM):  # the q8 kernels, and BLAS over dequantized chunks
        x = rng.standard_normal((num_tokens, 256)).astype(np.float32)
        got = x @ matrix.T
        assert got.shape == (num_tokens, 22) and matrix.shape == (22, 256)
        tolerance = 0.03 if num_tokens < BLAS_FROM else 1e-5
        assert np.abs(got - x @ dense.T).max() < tolerance * np.abs(x @ dense.T).max()
    rows = np.array([21, 0, 9, 14, 13])
    np.testing.assert_array_equal(matrix[rows], dense[rows])
    # one part or three, every product goes through one compiled signature of gemm_q8 (a
    # signature per part count compiled lazily, mid-serve, on the first layer of a new kind)
    q8_product(parts[0], rng.standard_normal((2, 256)).astype(np.float32), 1)
    assert len(gemm_q8.signatures) == 1, gemm_q8.signatures


def test_parts_back_to_back_in_one_buffer_become_one_part():
    """gate / up lie one after the other in a GGUF file: one view over both, no copy."""
    both = stored("Q4_1", 12, 256, 5)
    gate, up = (StoredTensor("Q4_1", (6, 256), both.data[rows]) for rows in (slice(0, 6), slice(6, 12)))
    matrix = QuantMatrix([gate, up])
    assert len(matrix.parts) == 1 and np.shares_memory(matrix.parts[0].data, both.data)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_array_equal(x @ matrix.T, x @ QuantMatrix([both]).T)


def test_paged_attention_matches_the_reference_runner():
    """With float32 weights (BLAS linears) the two runners differ only in attention: the numba
    kernel's logits match numpy's, for prefill rows spanning pages and a batch of decode rows."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    model = tiny_llama(vocab_size=50, max_context=64)
    made = [runner(model, num_pages=12, page_size=4) for runner in (CpuRunner, ReferenceRunner)]
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_logits=True)
    rng = np.random.default_rng(0)
    tables = [np.array([5, 1, 7, 3], np.int32), np.array([0, 2, 4, 6], np.int32), np.array([8, 9, 10, 11], np.int32)]
    steps = [
        [StepRow(seq_id=s, token_ids=rng.integers(0, 50, n).astype(np.int32), start_pos=0, page_table=tables[s],
                 sample=spec) for s, n in enumerate((7, 1, 10))],
        [StepRow(seq_id=s, token_ids=rng.integers(0, 50, 1).astype(np.int32), start_pos=p, page_table=tables[s],
                 sample=spec) for s, p in enumerate((7, 1, 10))],
        [StepRow(seq_id=0, token_ids=rng.integers(0, 50, 5).astype(np.int32), start_pos=8, page_table=tables[0],
                 sample=spec)],
    ]  # fmt: skip
    for rows in steps:
        got, want = (runner.step(rows) for runner in made)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logits, w.logits, rtol=1e-4, atol=1e-4)


# -- the runner on the real model -------------------------------------------------------------

NUM_PAGES, PAGE_SIZE = 16, 16
PROMPTS = ["The lighthouse keeper kept two notebooks.", "def fib(n):\n    return", "The capital of France is"]


@pytest.fixture(scope="module")
def runners(smollm2):
    return CpuRunner(smollm2, num_pages=NUM_PAGES, page_size=PAGE_SIZE), ReferenceRunner(
        smollm2, num_pages=NUM_PAGES, page_size=PAGE_SIZE
    )


def test_the_weights_stay_stored(runners, smollm2):
    cpu, reference = runners
    assert cpu.weight_nbytes == smollm2.weights.nbytes  # every tensor read in place, none widened
    assert reference.weight_nbytes > 5 * cpu.weight_nbytes


def test_logits_stay_within_the_q8_tolerance_of_the_reference(runners, smollm2):
    cpu, reference = runners
    ids = smollm2.tokenizer.encode(HELDOUT_TEXT)[:96]
    report = quality.compare(reference, cpu, ids)
    print(f"\ncpu vs reference: top-1 {report.top1_agreement:.4f}, mean KL {report.mean_kl:.5f}, "
          f"perplexity {report.perplexity_a:.3f} -> {report.perplexity_b:.3f}")  # fmt: skip
    assert report.top1_agreement >= 0.9
    assert report.mean_kl < 0.01
    assert abs(report.perplexity_ratio - 1) < 0.02


def test_greedy_tokens_follow_the_reference(runners, smollm2):
    """Along the reference's greedy continuation of each prompt, the cpu runner picks the same
    token wherever the reference's choice is clear (top-2 log-probability gap > 0.5 nats):
    4-bit weights leave near-ties, where q8 activations may flip a free-running string
    (MODELS.md, pitfall 6)."""
    cpu, reference = runners
    num_clear = 0
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.encode(prompt)
        path = ids + quality.greedy_tokens(reference, ids, 16)
        want = quality.teacher_forced_logprobs(reference, path)[len(ids) - 1 :]
        got = quality.teacher_forced_logprobs(cpu, path)[len(ids) - 1 :]
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.5
        np.testing.assert_array_equal(got.argmax(axis=1)[clear], want.argmax(axis=1)[clear])
        num_clear += int(clear.sum())
        print(f"\n{prompt!r}: free-running greedy agreement {quality.greedy_agreement(reference, cpu, ids, 16)} / 16,"
              f" {int(clear.sum())} clear positions of {len(clear)}")  # fmt: skip
    assert num_clear >= 24


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("model", ["smollm2", "tiny qwen2"])
def test_the_one_call_forward_is_the_per_layer_forward_bit_for_bit(model, num_threads, request):
    """A batch below BLAS_FROM tokens runs every layer in one numba call (`step.py`): its
    hidden states and the K / V it writes equal the per-layer path's bit for bit, for a batch
    mixing prompt rows and decode rows (qwen2's q / k / v biases included)."""
    from ninfer.core.runner import StepRow

    if model == "smollm2":
        weights = request.getfixturevalue("smollm2")
    else:
        spec, weights = quantized_tiny_llama(vocab_size=50, max_context=64)
        rng = np.random.default_rng(1)
        for i in range(spec.num_layers):
            for name, n in (("bq", spec.q_dim), ("bk", spec.kv_dim), ("bv", spec.kv_dim)):
                weights.tensors[f"layers.{i}.{name}"] = StoredTensor("F32", (n,), rng.standard_normal(n).astype(np.float32))
        weights = (attrs.evolve(spec, arch="qwen2", has_qkv_bias=True), weights)
    runner = CpuRunner(weights, num_pages=24, page_size=4, num_threads=num_threads)
    assert runner._layer_tables is not None
    if num_threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba's pool has {numba.config.NUMBA_NUM_THREADS} threads")
    numba.set_num_threads(num_threads)  # as `_step` does: the threads meet at barriers (`sync.py`)
    assert safe_layer()

    def rows():  # prompt rows spanning pages, decode rows at various lengths
        return [StepRow(seq_id=0, token_ids=np.array([3, 9, 4, 1, 7], np.int32), start_pos=0, page_table=np.arange(8)),
                StepRow(seq_id=1, token_ids=np.array([5], np.int32), start_pos=21, page_table=np.arange(8, 16)),
                StepRow(seq_id=2, token_ids=np.array([2, 8, 6], np.int32), start_pos=13, page_table=np.arange(16, 24))]  # fmt: skip

    runner._k[:] = np.random.default_rng(2).standard_normal(runner._k.shape)  # earlier context
    runner._v[:] = np.random.default_rng(3).standard_normal(runner._v.shape)
    before = runner._k.copy(), runner._v.copy()
    batch = runner._plan(rows())
    x = runner._embed[np.concatenate([row.token_ids for row in rows()]).astype(np.int64)]
    assert x.shape[0] < BLAS_FROM
    fused, _ = runner._layers_forward(x.copy(), rows(), batch, set())
    fused_kv = runner._k.copy(), runner._v.copy()
    runner._k[:], runner._v[:] = before
    per_layer, _ = ReferenceRunner._layers_forward(runner, x.copy(), rows(), batch, set())  # each layer: CpuRunner's
    np.testing.assert_array_equal(fused, per_layer)
    np.testing.assert_array_equal(fused_kv[0], runner._k)
    np.testing.assert_array_equal(fused_kv[1], runner._v)
    assert not np.array_equal(fused_kv[0], before[0])  # the layers wrote the new tokens' keys


def test_the_head_refines_its_contenders_to_the_float_logits(runners, smollm2):
    """A prompt in one step runs its layers on float activations (BLAS), so only the head's q8
    activations part the cpu runner from the reference; on this chat prompt they flipped the
    first token ('The' is 0.09 nats above 'L'). The head recomputes every logit near the top
    in float32: the contenders match the reference's, and so does the pick."""
    from ninfer.core.params import SamplingParams
    from ninfer.core.runner import SampleSpec, StepRow

    text = smollm2.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    ids = np.array(smollm2.tokenizer.encode(text), np.int32)
    assert ids.size >= BLAS_FROM
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_logits=True)
    cpu, reference = runners
    got, want = (runner.step([StepRow(seq_id=0, token_ids=ids, start_pos=0, page_table=np.arange(NUM_PAGES),
                                      sample=spec)])[0] for runner in runners)  # fmt: skip
    top = np.flatnonzero(want.logits >= want.logits.max() - 0.5)  # well inside REFINE_MARGIN
    assert top.size >= 3
    np.testing.assert_allclose(got.logits[top], want.logits[top], atol=1e-3)
    assert got.token_id == want.token_id
    assert np.abs(got.logits - want.logits).max() > 1e-3  # the rest stay q8's (the test would not see a float head)


# -- the scheduler on the cpu runner ----------------------------------------------------------


def quantized_tiny_llama(**kwargs):
    """test_sched_reference's tiny llama with every matrix stored as Q8_0 (embedding) or Q4_1."""
    spec, weights = tiny_llama(**kwargs)

    def quantize(name, tensor):
        if len(tensor.shape) == 1:
            return tensor
        qtype = "Q8_0" if name == "embed" else "Q4_1"
        return StoredTensor(qtype, tensor.shape, gguf.quants.quantize(tensor.data, GGMLQuantizationType[qtype]))

    return spec, ModelWeights({n: quantize(n, t) for n, t in weights.items()}, weights.num_layers)


@pytest.fixture
def on_cpu(monkeypatch):
    """test_sched_reference's tests, run on CpuRunners over a quantized tiny llama."""
    monkeypatch.setattr(sched_tests, "ReferenceRunner", CpuRunner)
    monkeypatch.setattr(sched_tests, "tiny_llama", quantized_tiny_llama)


async def test_pressure_on_the_cpu_runner_changes_no_token(on_cpu, smollm2):
    await sched_tests.test_pressure_on_the_reference_runner_changes_no_token(smollm2.tokenizer, smollm2)


async def test_lookahead_on_the_cpu_runner_changes_no_token(on_cpu, smollm2):
    await sched_tests.test_lookahead_on_the_reference_runner_changes_no_token(smollm2.tokenizer)


# -- the runtime ------------------------------------------------------------------------------


def test_without_a_gpu_auto_builds_the_cpu_backend_and_warms_it(smollm2, monkeypatch):
    import ninfer.gpu.cuda.available as available
    from ninfer.runtime import BACKENDS, RuntimeOptions, create_runner, resolve_backend, warm_up
    from ninfer.sched.config import EngineConfig

    monkeypatch.setattr(available, "cuda_available", lambda: False)
    assert "cpu" in BACKENDS and resolve_backend("auto") == "reference"  # no model: nothing to judge by
    config = EngineConfig(kv_capacity=64, max_context=64)
    runner, backend, config = create_runner(smollm2, RuntimeOptions(), config)
    assert backend == "cpu" and isinstance(runner, CpuRunner) and runner.num_pages == 4
    runner._k[:] = np.nan  # the warm-up runs real steps: a prompt (the per-layer path) and a decode token
    assert warm_up(runner, backend, config) is not None
    assert np.isfinite(runner._k[:, 0, :, :, :]).all() and np.isfinite(runner._k[:, 1, 0]).all()


async def test_a_slow_warm_up_says_so_on_stderr_and_a_quick_one_stays_silent(smollm2, capsys):
    """`ninfer generate` / `chat` on the cpu backend: a first run compiles for minutes, and says so."""
    from ninfer.runtime import COMPILE_NOTICE, warm_up_announced

    runner = CpuRunner(smollm2, num_pages=4, page_size=16)
    await warm_up_announced(runner, notice_after_s=600.0)
    assert capsys.readouterr().err == ""
    await warm_up_announced(runner, notice_after_s=0.0)  # "still running" at once
    err = capsys.readouterr().err
    assert COMPILE_NOTICE in err and "cpu backend: kernels ready in" in err
