"""The `ninfer` command as a user runs it: a real subprocess on the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

NINFER = [sys.executable, "-m", "ninfer.cli.main"]
COMMANDS = ("serve", "generate", "chat", "pull", "models", "bench", "simulate", "score", "export-hidden")


def ninfer(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*NINFER, *args], input=stdin, capture_output=True, text=True, timeout=900,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    last = lines[-1]
    for needle in needles:
        assert needle in last, result.stderr


def test_help_lists_every_command():
    result = ninfer("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = ninfer(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: ninfer " + command in result.stdout


def test_generate_answers_paris(smollm2_path):
    result = ninfer("generate", str(smollm2_path), "-p", "What is the capital of France?",
                    "--temperature", "0", "--max-tokens", "24")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    report = result.stderr.strip().splitlines()[-1]
    assert "prompt" in report and "generated" in report and "tok/s" in report


def test_generate_json_reports_tokens_usage_and_timings(smollm2_path):
    result = ninfer("generate", str(smollm2_path), "-p", "Count: one, two,", "--raw",
                    "--temperature", "0", "--max-tokens", "5", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 5
    assert out["usage"]["prompt_tokens"] > 0
    assert out["timings"]["ttft_s"] <= out["timings"]["total_s"]
    from ninfer.models.loader import load_model

    tokenizer = load_model(smollm2_path).tokenizer
    assert tokenizer.decode(out["token_ids"], skip_special_tokens=True).startswith(out["text"])


def test_chat_reads_turns_from_a_pipe(smollm2_path):
    turns = "What is the capital of France?\n/system You answer in one word.\n/bogus\n/exit\n"
    result = ninfer("chat", str(smollm2_path), "--temperature", "0", "--max-tokens", "16", stdin=turns)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "system message set" in result.stdout
    assert "unknown command /bogus" in result.stdout


def test_missing_model_file_is_one_line():
    assert_one_line_error(ninfer("generate", "/nonexistent/model.gguf", "-p", "hi"), "/nonexistent/model.gguf")


def test_truncated_model_file_is_one_line(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(5_000_000))
    assert_one_line_error(ninfer("generate", str(cut), "-p", "hi"), "cut.gguf")


def test_unsupported_architecture_is_one_line(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(ninfer("generate", str(path), "-p", "hi"), "mamba")


def test_unsupported_tensor_type_and_rope_scaling_are_one_line(tmp_path):
    import gguf
    import numpy as np
    from tiny_models import tiny_gguf_tensors, write_tiny_gguf

    tensors = tiny_gguf_tensors("llama", np.random.default_rng(0))
    tensors["blk.0.ffn_up.weight"] = np.zeros((24, 16), np.float64)
    f64 = write_tiny_gguf(tmp_path / "f64.gguf", tensors=tensors)
    assert_one_line_error(ninfer("generate", str(f64), "--raw", "-p", "hi"), "f64.gguf", "F64")
    yarn = write_tiny_gguf(tmp_path / "yarn.gguf", tensors=tiny_gguf_tensors("llama", np.random.default_rng(0)),
                           metadata={"rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)})  # fmt: skip
    assert_one_line_error(ninfer("generate", str(yarn), "--raw", "-p", "hi"), "yarn.gguf", "RoPE scaling 'yarn'")


def test_prompt_longer_than_context_is_one_line(smollm2_path):
    result = ninfer("generate", str(smollm2_path), "--raw", "-p", "word " * 300, "--max-context", "128")
    assert_one_line_error(result, "128")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--kv-capacity", "lots"], "--kv-capacity"),
        (["--backend", "tpu"], "--backend"),
    ],
)
def test_invalid_flag_values_are_one_line(flags, needle):
    result = ninfer("generate", "-p", "hi", *flags)
    assert result.returncode == 2
    assert_one_line_error(result, needle)


BAD_FLAG_COMMANDS = {"serve": [], "generate": ["-p", "hi"], "chat": [], "pull": [], "models": [], "bench": [],
                     "simulate": [], "score": ["text.txt"], "export-hidden": ["text.txt", "-o", "out"]}  # fmt: skip


@pytest.mark.parametrize("command", BAD_FLAG_COMMANDS)
def test_an_unknown_flag_shows_the_commands_own_usage_and_error(command):
    result = ninfer(command, *BAD_FLAG_COMMANDS[command], "--bad-flag")
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: ninfer {command} "), result.stderr
    assert_one_line_error(result, f"ninfer {command}: error: unrecognized arguments: --bad-flag")


def test_an_unknown_flag_before_the_command_is_the_top_level_error():
    result = ninfer("--bad-flag", "serve")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: ninfer [-h]"), result.stderr
    assert_one_line_error(result, "ninfer: error: unrecognized arguments: --bad-flag")


def test_bench_on_the_reference_backend_claims_no_lookahead_and_no_gpu_floor(smollm2_path):
    result = ninfer("bench", str(smollm2_path), "--backend", "reference", "--streams", "1", "--prompt-lens", "8",
                    "--decode-prompt", "4", "--decode-tokens", "2", "--repeats", "1", "--json", "-")  # fmt: skip
    assert result.returncode == 0, result.stderr
    header, table = result.stdout.split("\n", 1)
    assert "backend reference" in header and "lookahead off" in header
    assert "H200" not in result.stdout and "floor at" not in header and "of floor" not in table
    out = json.loads(table[table.index("\n{") :])
    assert out["lookahead"] is False and out["copy_gb_s"] is None
    (decode,) = out["decode"]
    assert "floor_tok_s" not in decode and "fraction_of_floor" not in decode and decode["achieved_gb_s"] > 0


def test_messages_file_must_be_a_list(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text('{"role": "user"}')
    assert_one_line_error(ninfer("generate", "--messages", str(bad)), "m.json")


# ---- --activations on generate, chat and serve --------------------------------------------

ACTIVATION_COMMANDS = {"generate": ["-p", "hi"], "chat": [], "serve": []}


@pytest.mark.parametrize("command", ACTIVATION_COMMANDS)
def test_bad_activations_value_is_one_line_exit_2(command):
    result = ninfer(command, *ACTIVATION_COMMANDS[command], "--activations", "q4")
    assert result.returncode == 2
    assert_one_line_error(result, f"ninfer {command}: error:", "--activations", "'q4'", "'f32'", "'q8'")


@pytest.mark.parametrize("command", ACTIVATION_COMMANDS)
def test_activations_help_explains_the_choice(command):
    result = ninfer(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--activations {f32,q8}" in text
    assert "float32 activations" in text and "1e-3" in text and "fast path" in text and "(default: q8)" in " ".join(text.split()) and "reference backend" in text and "ignores it" in text


@pytest.mark.parametrize("command", ACTIVATION_COMMANDS)
@pytest.mark.parametrize("flags, expected", [([], "q8"), (["--activations", "q8"], "q8"), (["--activations", "f32"], "f32")])
def test_activations_flag_reaches_the_runtime_options(command, flags, expected):
    from ninfer.cli.common import runtime_options
    from ninfer.cli.main import build_parser
    from ninfer.cli.serve import settings_from_args

    args = build_parser().parse_args([command, *ACTIVATION_COMMANDS[command], *flags])
    assert args.activations == expected
    if command == "serve":
        settings = settings_from_args(args)
        options = settings.runtime
    else:
        options = runtime_options(args)
    assert options.activations == expected


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_hand_activations_to_create_runner(command, smollm2, monkeypatch):
    # Run the command in-process up to the runner: create_runner records what it was given.
    import io

    import ninfer.runtime
    from ninfer.cli.main import build_parser
    from ninfer.runtime import ConfigError

    seen = []

    def fake_create_runner(model, options, config):
        seen.append(options)
        raise ConfigError("stopped before building a runner")

    monkeypatch.setattr(ninfer.runtime, "load", lambda *args, **kwargs: smollm2)
    monkeypatch.setattr(ninfer.runtime, "create_runner", fake_create_runner)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # chat reads turns from a (non-tty) stdin
    args = build_parser().parse_args([command, *ACTIVATION_COMMANDS[command], "--backend", "reference",
                                      "--activations", "q8"])  # fmt: skip
    with pytest.raises(ConfigError, match="stopped before building a runner"):
        args.run(args)
    assert [(o.backend, o.activations) for o in seen] == [("reference", "q8")]


def test_reference_backend_accepts_q8_activations(smollm2_path):
    result = ninfer("generate", str(smollm2_path), "-p", "Count: one, two,", "--raw", "--backend", "reference",
                    "--activations", "q8", "--temperature", "0", "--max-tokens", "3", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["backend"] == "reference"
    assert 1 <= out["usage"]["completion_tokens"] <= 3
