"""`ninfer score` and `ninfer export-hidden` on the reference backend with the real SmolLM2 GGUF.

Each figure is checked against an independent computation: log-probabilities by
teacher-forcing a ReferenceRunner one token a step (the decode path, `quality`), windows by
running each window's tokens alone, hidden rows against `want_hidden` of the last position and
against transformers' own model loaded from the same GGUF (with the perplexity), KL against
numpy on the saved logits.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from heldout import HELDOUT_TEXT

from ninfer.cli import offline
from ninfer.cli.main import main
from ninfer.core.params import SamplingParams
from ninfer.core.runner import SampleSpec, StepRow
from ninfer.gpu import quality
from ninfer.gpu.reference import ReferenceRunner, rms_norm

SHORT = "The lighthouse keeper kept two notebooks, one for the weather and one for the ships."
DOCS = [
    "In the first he wrote the weather every four hours: wind from the north-west, a falling barometer, rain "
    "arriving just after the evening lamp was lit.",
    "Ships sailed past.",
    "Once a small boat with a red sail circled the rocks twice.",
]
REF = ["--backend", "reference", "--kv-capacity", "8192", "--no-progress"]


@pytest.fixture(autouse=True)
def loaded_once(smollm2, monkeypatch):
    """The commands load the session's model instead of reading the GGUF again."""
    import ninfer.runtime

    monkeypatch.setattr(ninfer.runtime, "load", lambda *args, **kwargs: smollm2)


@pytest.fixture(scope="module")
def runner(smollm2):
    return ReferenceRunner(smollm2, num_pages=64, page_size=16)


def ids_of(smollm2, text: str) -> np.ndarray:
    return np.asarray(smollm2.tokenizer.encode(text, add_special_tokens=True), np.int32)


def teacher_forced(runner, ids) -> np.ndarray:
    """float64 [len(ids) - 1]: log p(ids[t] | ids[:t]) by feeding one token a step."""
    lp = quality.teacher_forced_logprobs(runner, list(ids))
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def score_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["score", *args, *REF, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def jsonl(tmp_path, docs) -> str:
    return write(tmp_path, "docs.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs))


# -- ninfer score ----------------------------------------------------------------------------


def test_score_equals_the_teacher_forced_log_likelihood(smollm2, runner, tmp_path, capsys):
    ids = ids_of(smollm2, SHORT)
    want = teacher_forced(runner, ids)
    out = score_json(capsys, write(tmp_path, "short.txt", SHORT), "--logprobs-out", str(tmp_path / "lp.jsonl"),
                     "--chunk", "7")  # fmt: skip
    total = out["total"]
    assert total["tokens"] == len(ids) and total["scored_tokens"] == len(ids) - 1
    assert total["nll"] == pytest.approx(-want.sum(), rel=1e-4)
    assert total["perplexity"] == pytest.approx(math.exp(-want.mean()), rel=1e-4)
    assert out["documents"][0]["nll"] == total["nll"]
    (line,) = [json.loads(s) for s in (tmp_path / "lp.jsonl").read_text().splitlines()]
    assert line["token_ids"] == ids.tolist() and line["logprobs"][0] is None
    np.testing.assert_allclose(line["logprobs"][1:], want, atol=2e-3)


def window_starts(n: int, window: int, stride: int) -> list[tuple[int, int]]:
    """(start, end) of the windows the docs describe: the first ends at W, each next one S later."""
    ends = [min(n, window)]
    while ends[-1] < n:
        ends.append(min(ends[-1] + stride, n))
    return [(max(0, e - window), e) for e in ends]


def test_jsonl_documents_and_long_ones_in_windows(smollm2, runner, tmp_path, capsys):
    window, stride = 16, 6
    docs = [ids_of(smollm2, d) for d in DOCS]
    assert len(docs[0]) > 2 * window and len(docs[1]) < window
    out = score_json(capsys, jsonl(tmp_path, DOCS), "--max-context", str(window), "--stride", str(stride),
                     "--chunk", "5", "--batch-tokens", "12", "--logprobs-out", str(tmp_path / "lp.npy"))  # fmt: skip
    got = np.load(tmp_path / "lp.npy")
    assert got.shape == (sum(len(d) for d in docs),)
    offset = 0
    for i, ids in enumerate(docs):
        # each target t, independently: the first window (start, end) with t < end, fed alone
        want = np.full(len(ids), np.nan)
        for start, end in window_starts(len(ids), window, stride):
            lp = teacher_forced(runner, ids[start:end])
            for t in range(max(1, start + 1), end):
                if np.isnan(want[t]):
                    want[t] = lp[t - start - 1]
                    assert t - start >= window - stride or start == 0  # the context the docs promise
        doc_lp = got[offset : offset + len(ids)]
        assert np.isnan(doc_lp[0]) and not np.isnan(doc_lp[1:]).any()
        np.testing.assert_allclose(doc_lp[1:], want[1:], atol=2e-3)
        assert out["documents"][i]["nll"] == pytest.approx(-want[1:].sum(), rel=1e-4)
        assert out["documents"][i]["scored_tokens"] == len(ids) - 1
        offset += len(ids)
    total = out["total"]
    assert total["documents"] == 3 and total["scored_tokens"] == sum(len(d) - 1 for d in docs)
    assert total["nll"] == pytest.approx(sum(d["nll"] for d in out["documents"]))
    # windowing re-reads context: more tokens fed than the corpus holds
    assert out["tokens_fed"] > total["tokens"] - 3


def test_saved_logits_round_trip_and_kl(smollm2, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    text = write(tmp_path, "held.txt", HELDOUT_TEXT[:300])
    saved = str(tmp_path / "ref.safetensors")
    first = score_json(capsys, text, "--save-logits", saved)
    tensors = load_file(saved)
    ids = ids_of(smollm2, HELDOUT_TEXT[:300])
    assert tensors["logits"].shape == (len(ids) - 1, smollm2.spec.vocab_size)
    assert tensors["targets"].tolist() == ids[1:].tolist() and tensors["doc_offsets"].tolist() == [0, len(ids) - 1]
    lp = quality.token_logprobs(tensors["logits"], ids[1:])
    assert first["total"]["nll"] == pytest.approx(-lp.sum(), rel=1e-9)

    same = score_json(capsys, text, "--reference-logits", saved)["total"]
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-9) and same["top1_agreement"] == 1.0
    assert same["reference_perplexity"] == pytest.approx(first["total"]["perplexity"], rel=1e-9)

    # a setting that changes the logits: a short window (less context for most tokens)
    short = score_json(capsys, text, "--reference-logits", saved, "--max-context", "8", "--stride", "4")["total"]
    assert short["mean_kl"] > 0.05 and short["perplexity"] > first["total"]["perplexity"]
    assert short["reference_perplexity"] == pytest.approx(first["total"]["perplexity"], rel=1e-9)

    # a perturbed reference: the KL is numpy's, computed here from the two logits arrays
    noisy = tensors["logits"] + np.random.default_rng(0).normal(0, 0.5, tensors["logits"].shape).astype(np.float32)
    perturbed = str(tmp_path / "noisy.safetensors")
    save_file({**tensors, "logits": noisy}, perturbed)
    got = score_json(capsys, text, "--reference-logits", perturbed)["total"]
    lp_ref, lp_run = quality.log_softmax_rows(noisy), quality.log_softmax_rows(tensors["logits"])
    want_kl = (np.exp(lp_ref) * (lp_ref - lp_run)).sum(axis=1)
    assert got["mean_kl"] == pytest.approx(want_kl.mean(), rel=1e-6) and got["mean_kl"] > 0.01
    assert got["max_kl"] == pytest.approx(want_kl.max(), rel=1e-6)
    assert got["top1_agreement"] == pytest.approx(np.mean(lp_ref.argmax(1) == lp_run.argmax(1)))

    # a reference of other tokens is refused
    other = write(tmp_path, "other.txt", SHORT)
    assert main(["score", other, *REF, "--reference-logits", saved]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ninfer score: error: reference logits") and "other tokens" in err[-1]


def test_decode_path_gives_the_prefill_figures(tmp_path, capsys):
    text = write(tmp_path, "short.txt", SHORT)
    prefill = score_json(capsys, text)["total"]
    decode = score_json(capsys, text, "--decode-path", "--max-context", "12", "--stride", "5")
    windowed = score_json(capsys, text, "--max-context", "12", "--stride", "5")
    assert decode["decode_path"] and decode["total"]["nll"] == pytest.approx(windowed["total"]["nll"], rel=1e-4)
    assert decode["total"]["scored_tokens"] == prefill["scored_tokens"]


# -- ninfer export-hidden --------------------------------------------------------------------


def last_hidden(runner, ids) -> np.ndarray:
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_hidden=True)
    table = np.arange(-(-len(ids) // runner.page_size), dtype=np.int32)
    [out] = runner.step([StepRow(seq_id=0, token_ids=np.asarray(ids, np.int32), start_pos=0, page_table=table, sample=spec)])
    return out.hidden


def test_export_hidden_rows_and_layout(smollm2, runner, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    last = smollm2.spec.num_layers - 1
    text = write(tmp_path, "short.txt", SHORT)
    out = str(tmp_path / "h.safetensors")
    assert main(["export-hidden", text, "--layers", f"0,{last},-1", "-o", out, *REF]) == 0
    assert "wrote layers" in capsys.readouterr().err
    ids = ids_of(smollm2, SHORT)
    rows = load_file(out)
    d = smollm2.spec.d_model
    assert set(rows) == {"doc0.tokens", "doc0.layer0", f"doc0.layer{last}", "doc0.final"}
    assert rows["doc0.tokens"].tolist() == ids.tolist()
    for name in ("doc0.layer0", f"doc0.layer{last}", "doc0.final"):
        assert rows[name].shape == (len(ids), d) and rows[name].dtype == np.float32
    with safe_open(out, framework="numpy") as f:
        assert f.metadata()["layers"] == f"0,{last},-1" and f.metadata()["model"] == smollm2.name
    # the final rows: want_hidden of the last position, of the whole text and of a prefix
    np.testing.assert_allclose(rows["doc0.final"][-1], last_hidden(runner, ids), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rows["doc0.final"][5], last_hidden(runner, ids[:6]), rtol=1e-4, atol=1e-4)
    # -1 is the last block's output through the final norm
    final_norm = smollm2.weights["final_norm"].dequantize().astype(np.float32)
    np.testing.assert_allclose(rms_norm(rows[f"doc0.layer{last}"], final_norm, smollm2.spec.rms_eps), rows["doc0.final"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip

    # the same rows as .npy files, and a manifest
    npy = tmp_path / "npy"
    assert main(["export-hidden", text, "--layers", f"0,{last},-1", "-o", str(npy), *REF]) == 0
    manifest = json.loads((npy / "manifest.json").read_text())
    assert manifest["layers"] == [0, last, -1] and manifest["documents"][0]["tokens"] == len(ids)
    for name, want in rows.items():
        np.testing.assert_array_equal(np.load(npy / f"{name}.npy"), want)


def test_export_hidden_windows(smollm2, runner, tmp_path, capsys):
    window, stride = 8, 3
    out = str(tmp_path / "w.safetensors")
    assert main(["export-hidden", jsonl(tmp_path, DOCS[1:]), "-o", out, "--max-context", str(window),
                 "--stride", str(stride), "--chunk", "3", *REF]) == 0  # fmt: skip
    from safetensors.numpy import load_file

    rows = load_file(out)
    for i, text in enumerate(DOCS[1:]):
        ids = ids_of(smollm2, text)
        final = rows[f"doc{i}.final"]
        assert final.shape == (len(ids), smollm2.spec.d_model)
        # every token's row comes from the first window holding it (fed alone here)
        seen = 0
        for start, end in window_starts(len(ids), window, stride):
            for t in range(seen, end):
                np.testing.assert_allclose(final[t], last_hidden(runner, ids[start : t + 1]), rtol=1e-4, atol=1e-4)
            seen = end


# -- against transformers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


def test_perplexity_matches_transformers_within_half_a_percent(smollm2, hf_model, tmp_path, capsys):
    import torch

    ids = ids_of(smollm2, HELDOUT_TEXT)
    with torch.no_grad():
        loss = hf_model(torch.tensor([ids.tolist()]), labels=torch.tensor([ids.tolist()])).loss.item()
    hf_ppl = math.exp(loss)
    got = score_json(capsys, write(tmp_path, "held.txt", HELDOUT_TEXT))["total"]
    assert got["scored_tokens"] == len(ids) - 1
    # measured: 37.0884 (ninfer) and 37.0878 (transformers), docs/performance.md
    assert got["perplexity"] == pytest.approx(hf_ppl, rel=5e-3)
    assert got["perplexity"] == pytest.approx(hf_ppl, rel=1e-4)  # float32 both: far inside the 0.5 %


def test_exported_layers_match_transformers_hidden_states(smollm2, hf_model, tmp_path):
    import torch
    from safetensors.numpy import load_file

    ids = ids_of(smollm2, SHORT)
    out = str(tmp_path / "h.safetensors")
    assert main(["export-hidden", write(tmp_path, "s.txt", SHORT), "--layers", "0,7,-1", "-o", out, *REF]) == 0
    rows = load_file(out)
    with torch.no_grad():
        states = hf_model(torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
    # transformers: states[k] is the input of block k, states[-1] the final norm's output
    for name, want in (("doc0.layer0", states[1]), ("doc0.layer7", states[8]), ("doc0.final", states[-1])):
        want = want[0].numpy()
        assert float(np.abs(rows[name] - want).max() / np.abs(want).max()) < 1e-3, name


# -- windows, runner outputs, errors ---------------------------------------------------------------


@pytest.mark.parametrize("n, window, stride", [(5, 8, 4), (40, 16, 6), (40, 16, 15), (33, 8, 1), (17, 16, 8)])
def test_windows_cover_each_token_once_with_the_promised_context(n, window, stride):
    ws = offline.windows(0, n, window, stride)
    covered = []
    for w in ws:
        assert w.end - w.start == min(window, n) and w.start <= w.new_from < w.end
        assert w.new_from == 0 or w.new_from - w.start >= window - stride
        covered += range(w.new_from, w.end)
    assert covered == list(range(n))


def test_reference_runner_every_position_outputs(smollm2, runner):
    ids = ids_of(smollm2, SHORT)[:12]
    spec = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, want_all_logits=True,
                      hidden_layers=(3, -1), want_logits=True, want_hidden=True)  # fmt: skip
    table = np.arange(4, dtype=np.int32)
    [whole] = runner.step([StepRow(seq_id=0, token_ids=ids, start_pos=0, page_table=table, sample=spec)])
    assert whole.all_logits.shape == (12, smollm2.spec.vocab_size)
    assert whole.layer_hidden.shape == (2, 12, smollm2.spec.d_model)
    np.testing.assert_allclose(whole.all_logits[-1], whole.logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(whole.layer_hidden[1, -1], whole.hidden, rtol=1e-5, atol=1e-5)
    # in two chunks, beside a row that asks for nothing: the same rows
    plain = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0)
    first, _ = runner.step([StepRow(seq_id=0, token_ids=ids[:5], start_pos=0, page_table=table, sample=spec),
                            StepRow(seq_id=1, token_ids=ids[:3], start_pos=0, page_table=table + 4, sample=plain)])  # fmt: skip
    [second] = runner.step([StepRow(seq_id=0, token_ids=ids[5:], start_pos=5, page_table=table, sample=spec)])
    np.testing.assert_allclose(np.concatenate([first.all_logits, second.all_logits]), whole.all_logits, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.concatenate([first.layer_hidden, second.layer_hidden], axis=1), whole.layer_hidden,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    bad = SampleSpec(params=SamplingParams(temperature=0.0), seed=0, token_index=0, hidden_layers=(smollm2.spec.num_layers,))
    with pytest.raises(ValueError, match="hidden layer"):
        runner.step([StepRow(seq_id=0, token_ids=ids, start_pos=0, page_table=table, sample=bad)])


@pytest.mark.parametrize(
    "command, make_args, needle",
    [
        ("score", lambda p: [str(p / "missing.txt")], "missing.txt: no such file"),
        ("score", lambda p: [write(p, "empty.txt", " \n")], "holds no text"),
        ("score", lambda p: [write(p, "bad.jsonl", '{"text": "a b"}\nnot json\n')], "line 2 is not valid JSON"),
        ("score", lambda p: [write(p, "notext.jsonl", '{"body": "a"}\n')], 'string "text" field'),
        ("score", lambda p: [write(p, "blank.jsonl", '{"text": "  "}\n')], "line 1 has an empty text"),
        ("score", lambda p: [write(p, "one.txt", "Hi")], "document 0 has 1 token"),
        ("score", lambda p: [write(p, "s.txt", SHORT), "--max-context", "8", "--stride", "8"], "--stride"),
        ("score", lambda p: [write(p, "s.txt", SHORT), "--save-logits", str(p / "no" / "x.safetensors")], "no directory"),
        ("score", lambda p: [write(p, "s.txt", SHORT), "--reference-logits", write(p, "junk.safetensors", "junk")],
         "cannot read reference logits"),
        ("export-hidden", lambda p: [str(p / "missing.txt"), "-o", str(p / "o.safetensors")], "no such file"),
        ("export-hidden", lambda p: [write(p, "s.txt", SHORT), "--layers", "0,30", "-o", str(p / "o")], "layer 30 is out of range"),
        ("export-hidden", lambda p: [write(p, "s.txt", SHORT), "--layers", "-2", "-o", str(p / "o")], "layer -2"),
        ("export-hidden", lambda p: [write(p, "s.txt", SHORT), "-o", write(p, "f.bin", "x")], "it is a file"),
    ],
)  # fmt: skip
def test_bad_input_is_a_one_line_error_with_exit_2(command, make_args, needle, tmp_path, capsys):
    assert main([command, *make_args(tmp_path), *REF]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ninfer {command}: error:") and needle in err[-1], err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("layers", ["x", "0,0", ""])
def test_bad_layers_syntax_is_a_usage_error(layers, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export-hidden", write(tmp_path, "s.txt", SHORT), "--layers", layers, "-o", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert "--layers" in capsys.readouterr().err


def test_score_reads_stdin(tmp_path, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"text": SHORT}) + "\n"))
    from_stdin = score_json(capsys, "-", "--jsonl")["total"]
    # the same text from a file, with the text report
    assert main(["score", write(tmp_path, "short.txt", SHORT), *REF]) == 0
    report = capsys.readouterr().out
    assert f"1 document, {from_stdin['tokens']} tokens, {from_stdin['scored_tokens']} scored" in report
    assert f"NLL {from_stdin['nll']:.3f} nats" in report and f"perplexity {from_stdin['perplexity']:.4f}" in report
    assert "on reference" in report and "window 8192, stride 4096" in report
