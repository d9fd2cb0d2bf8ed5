"""Qwen3.5 hybrids (Gated DeltaNet + gated full attention) on the reference backend, against
transformers' Qwen3_5ForCausalLM as the independent oracle."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow
from ninfer.gpu import gdn
from ninfer.gpu.reference import ReferenceRunner
from ninfer.models.loader import load_model

torch = pytest.importorskip("torch")
from hybrid_models import hybrid, model  # noqa: E402, F401 (fixtures)

GREEDY = SamplingParams(temperature=0.0)
PAGE = 16
NUM_DECODE = 32


def hf_logits(hybrid, ids) -> np.ndarray:
    """transformers' logits at every position of `ids` (one uncached forward: its chunked form)."""
    with torch.no_grad():
        return hybrid.model(torch.tensor(np.asarray(ids)[None], dtype=torch.long)).logits[0].numpy()


def runner_for(model, num_pages=32) -> ReferenceRunner:
    return ReferenceRunner(model, num_pages=num_pages, page_size=PAGE)


def row(seq_id, tokens, start, *, sample=True, all_logits=False, first_page=0):
    spec = SampleSpec(params=GREEDY, seed=0, token_index=0, want_logits=True, want_all_logits=all_logits)
    table = np.arange(first_page, first_page + 16, dtype=np.int32)
    return StepRow(seq_id=seq_id, token_ids=np.asarray(tokens, dtype=np.int32), start_pos=start,
                   page_table=table, sample=spec if sample else None)  # fmt: skip


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


def assert_close_logits(ours, ref):
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * max(scale, 1.0))


def assert_same_state(a: gdn.SequenceState, b: gdn.SequenceState, atol=1e-5):
    assert a.num_tokens == b.num_tokens
    for la, lb in zip(a.layers, b.layers, strict=True):
        np.testing.assert_allclose(la.ssm, lb.ssm, rtol=0, atol=atol)
        np.testing.assert_allclose(la.conv, lb.conv, rtol=0, atol=atol * 10)


# -- loading ----------------------------------------------------------------------------------


def test_hf_dir_and_gguf_load_the_same_model(hybrid, model):
    from_hf = load_model(hybrid.hf_dir)
    assert from_hf.spec == model.spec
    assert model.spec.is_hybrid and model.spec.gdn_layers == (0, 1, 2) and model.spec.attention_layers == (3,)
    assert model.spec.rotary_dim == 4 and model.spec.has_attn_gate
    assert set(from_hf.weights) == set(model.weights)
    for name in model.weights:
        np.testing.assert_array_equal(from_hf.weights[name].dequantize(), model.weights[name].dequantize(), name)
    assert from_hf.tokenizer.encode("hello") == model.tokenizer.encode("hello")


def test_kv_pool_holds_only_the_full_attention_layers(model):
    runner = runner_for(model, num_pages=4)
    spec = model.spec
    assert runner.page_nbytes == PAGE * 2 * 1 * spec.kv_dim * 4  # one attention layer of four
    assert spec.recurrent_state_nbytes(4) == 3 * 4 * (3 * spec.gdn.conv_dim + 4 * 8 * 8)


# -- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_prefill_logits_match_transformers(hybrid, model, source):
    loaded = model if source == "gguf" else load_model(hybrid.hf_dir)
    ids = prompt(90)  # longer than one GDN chunk (64 tokens)
    out = runner_for(loaded).step([row(0, ids, 0, all_logits=True)])[0]
    assert_close_logits(out.all_logits, hf_logits(hybrid, ids))


def test_decode_matches_transformers_for_32_greedy_steps(hybrid, model):
    ids = prompt(11, seed=1)
    runner = runner_for(model)
    result = runner.step([row(0, ids, 0)])[0]
    tokens, logits = [result.token_id], [result.logits]
    for step in range(NUM_DECODE - 1):
        result = runner.step([row(0, [tokens[-1]], len(ids) + step)])[0]
        tokens.append(result.token_id)
        logits.append(result.logits)
    with torch.no_grad():  # transformers' own greedy decode: its cached, recurrent form
        generated = hybrid.model.generate(torch.tensor(ids[None], dtype=torch.long), max_new_tokens=NUM_DECODE,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert tokens == generated[0, len(ids) :].tolist()
    full = hf_logits(hybrid, np.concatenate([ids, tokens]))
    assert_close_logits(np.stack(logits), full[len(ids) - 1 : -1])


def test_transformers_recurrent_state_matches(hybrid, model):
    """The state itself, against transformers' cache (value heads back in HF's grouped order)."""
    ids = prompt(40, seed=2)
    runner = runner_for(model)
    runner.step([row(0, ids, 0)])
    with torch.no_grad():
        cache = hybrid.model(torch.tensor(ids[None], dtype=torch.long), use_cache=True).past_key_values
    g = model.spec.gdn
    tiled = np.arange(g.num_v_heads).reshape(g.num_k_heads, -1).T.reshape(-1)  # HF head of tiled head p
    for slot, layer in enumerate(model.spec.gdn_layers):
        theirs = cache.layers[layer].recurrent_states[0][0].numpy()  # [nv, dk, dv], grouped heads
        ours = runner.recurrent_state(0).layers[slot].ssm
        np.testing.assert_allclose(ours, theirs[tiled], rtol=0, atol=1e-5)


# -- prefill chunking, batching, decode: one state ----------------------------------------------


def test_one_chunk_many_chunks_and_token_by_token_reach_the_same_state(model):
    ids = prompt(50, seed=3)
    whole = runner_for(model)
    last_whole = whole.step([row(0, ids, 0)])[0].logits
    chunked = runner_for(model)
    for lo in range(0, len(ids), 7):
        piece = ids[lo : lo + 7]
        out = chunked.step([row(0, piece, lo, sample=lo + len(piece) == len(ids))])[0]
    last_chunked = out.logits
    single = runner_for(model)
    for pos, token in enumerate(ids):
        out = single.step([row(0, [token], pos)])[0]
    assert_same_state(whole.recurrent_state(0), chunked.recurrent_state(0))
    assert_same_state(whole.recurrent_state(0), single.recurrent_state(0))
    assert whole.recurrent_state(0).num_tokens == len(ids)
    np.testing.assert_allclose(last_chunked, last_whole, atol=1e-4)
    np.testing.assert_allclose(out.logits, last_whole, atol=1e-4)


def test_rows_of_several_sequences_in_one_step_match_each_alone(model):
    a, b, c = prompt(20, seed=4), prompt(9, seed=5), prompt(3, seed=6)
    alone = []
    for ids in (a, b, c):
        runner = runner_for(model)
        first = runner.step([row(0, ids, 0)])[0]
        alone.append((first, runner.step([row(0, [first.token_id], len(ids))])[0]))
    together = runner_for(model, num_pages=48)
    rows = [row(i, ids, 0, first_page=16 * i) for i, ids in enumerate((a, b))]
    firsts = together.step(rows)
    # decode rows of a and b batched with the prefill of c
    step2 = together.step([row(0, [firsts[0].token_id], len(a)), row(1, [firsts[1].token_id], len(b), first_page=16),
                           row(2, c, 0, first_page=32)])  # fmt: skip
    third = together.step([row(2, [step2[2].token_id], len(c), first_page=32)])[0]
    got = [(firsts[0], step2[0]), (firsts[1], step2[1]), (step2[2], third)]
    for (want1, want2), (got1, got2) in zip(alone, got, strict=True):
        assert (got1.token_id, got2.token_id) == (want1.token_id, want2.token_id)
        np.testing.assert_allclose(got2.logits, want2.logits, atol=1e-4)


def test_chunked_delta_rule_equals_the_recurrence():
    rng = np.random.default_rng(7)
    n, h, dk, dv = 23, 3, 5, 4
    q, k = (gdn.l2norm(rng.standard_normal((n, h, dk)).astype(np.float32)) for _ in range(2))
    v = rng.standard_normal((n, h, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, (n, h)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, h)).astype(np.float32)
    state = rng.standard_normal((h, dk, dv)).astype(np.float32)
    out_chunked, state_chunked = gdn.delta_rule_chunked(q, k, v, g, beta, state, chunk=6)
    s, outs = state, []
    for t in range(n):
        o, s = gdn.delta_rule_step(q[t], k[t], v[t], g[t], beta[t], s)
        outs.append(o)
    np.testing.assert_allclose(out_chunked, np.stack(outs), atol=1e-5)
    np.testing.assert_allclose(state_chunked, s, atol=1e-5)


# -- the state's life -------------------------------------------------------------------------


def test_state_is_created_checked_and_released(model):
    runner = runner_for(model)
    assert runner.num_recurrent_states == 0
    ids = prompt(10, seed=8)
    runner.step([row(5, ids, 0)])
    assert runner.num_recurrent_states == 1
    with pytest.raises(ValueError, match="recurrent state"):  # a gap: position 12 after 10 tokens
        runner.step([row(5, [1], 12)])
    with pytest.raises(ValueError, match="recurrent state"):  # a sequence it never saw
        runner.step([row(6, [1], 3)])
    assert runner.recurrent_state(5).num_tokens == 10  # a failed step commits nothing
    runner.release_sequence(5)
    assert runner.num_recurrent_states == 0
    with pytest.raises(ValueError, match="recurrent state"):
        runner.step([row(5, [1], 10)])
    again = runner.step([row(5, ids, 0)])[0]  # a replay from position 0 starts over
    fresh = runner_for(model).step([row(5, ids, 0)])[0]
    np.testing.assert_array_equal(again.logits, fresh.logits)


def test_a_state_snapshot_restores_into_the_same_or_another_sequence(model):
    runner = runner_for(model)
    ids = prompt(12, seed=9)
    runner.step([row(1, ids[:8], 0, sample=False)])
    snapshot = runner.snapshot_state(1)
    assert snapshot.num_tokens == 8 and snapshot.nbytes == runner.state_nbytes == model.spec.recurrent_state_nbytes(4)
    want = runner.step([row(1, ids[8:], 8)])[0]  # sequence 1 goes on past the snapshot
    runner.restore_state(1, snapshot)  # ... and is rewound to it
    again = runner.step([row(1, ids[8:], 8)])[0]
    runner.restore_state(2, snapshot)  # a new sequence starts at position 8 from it (its own pages)
    other = runner.step([row(2, ids[8:], 8, first_page=0)])[0]
    np.testing.assert_array_equal(again.logits, want.logits)
    np.testing.assert_array_equal(other.logits, want.logits)
    assert runner.num_recurrent_states == 2
    runner.step([row(2, [other.token_id], 12)])  # a copy: sequence 2's steps leave the snapshot as it was
    runner.restore_state(3, snapshot)
    np.testing.assert_array_equal(runner.step([row(3, ids[8:], 8)])[0].logits, want.logits)
    with pytest.raises(ValueError, match="no recurrent state"):
        runner.snapshot_state(9)


def test_checkpoint_slots_save_restore_demote_and_release(model):
    """The runner's own checkpoint slots (the prefix cache's device tier): a saved state
    restores exactly (and stays in its slot), its demoted host copy equals a host snapshot and
    restores the same, a freed slot's snapshot is refused, and a full set of slots refuses more."""
    runner = ReferenceRunner(model, num_pages=32, page_size=PAGE, checkpoint_slots=1)
    ids = prompt(12, seed=5)
    runner.step([row(1, ids[:8], 0, sample=False)])
    saved, host = runner.save_checkpoint(1), runner.snapshot_state(1)
    assert saved.on_device and saved.slot == 0 and saved.nbytes == 0 and saved.slot_nbytes == runner.state_nbytes
    assert runner.num_checkpoint_slots == 1 and runner.num_free_checkpoint_slots == 0
    want = runner.step([row(1, ids[8:], 8)])[0]  # sequence 1 goes on past the checkpoint
    with pytest.raises(ValueError, match="no free checkpoint slot"):
        runner.save_checkpoint(1)
    for seq_id in (2, 3):  # restored twice from the slot: it stays there
        runner.restore_state(seq_id, saved)
        np.testing.assert_array_equal(runner.step([row(seq_id, ids[8:], 8)])[0].logits, want.logits)
    demoted = runner.demote_checkpoint(saved)
    assert not demoted.on_device and runner.num_free_checkpoint_slots == 1
    for got, expected in zip(demoted.arrays, host.arrays, strict=True):
        np.testing.assert_array_equal(got, expected)
    runner.restore_state(4, demoted)
    np.testing.assert_array_equal(runner.step([row(4, ids[8:], 8)])[0].logits, want.logits)
    with pytest.raises(ValueError, match="no longer holds"):
        runner.restore_state(5, saved)  # its slot was freed by the demotion
    again = runner.save_checkpoint(2)
    runner.release_checkpoint(again)
    assert runner.num_free_checkpoint_slots == 1
    with pytest.raises(ValueError, match="no longer holds"):
        runner.release_checkpoint(again)
