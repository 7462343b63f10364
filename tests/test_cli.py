"""The `dllama` command as a user runs it (a subprocess): inference --json, plain streaming, chat on
piped input, perplexity, models list, and one-line errors for bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import jinja2
import numpy as np
import pytest
from gguf import GGUFWriter

from .engine_helpers import (NEAR_TIE, TEXT_FILE, bit_exact_expected, greedy_divergence, llama_greedy_run, log_softmax,
                             ref_logits, ref_logits_one_by_one)

DESIGN_KEYS = {"text", "tokens", "prompt_tokens", "nodes", "sync", "sync_dtype", "tokens_per_s",
               "prefill_tokens_per_s", "ms_per_token", "bytes_per_token", "peak_rss_mb"}
PROMPT = "The capital of France is"


def dllama(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DLLAMA_DEBUG"}
    return subprocess.run([sys.executable, "-m", "dllama", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, only_line: bool = True) -> str:
    """Non-zero exit, no traceback, exactly one line starting with 'error:' (and, with only_line,
    nothing else on stderr)."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    if only_line:
        assert lines == errors, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


# ------------------------------------------------------------------ inference


@pytest.fixture(scope="module")
def inference_json(model_path):
    result = dllama("inference", "--model", model_path, "--prompt", PROMPT, "--steps", "24", "--temperature", "0",
                    "--threads", "1", "--json")
    assert result.returncode == 0, result.stderr
    return result


def test_inference_json_report(inference_json, tokenizer):
    lines = inference_json.stdout.strip().splitlines()
    assert len(lines) == 1, inference_json.stdout  # one JSON object and nothing else on stdout
    report = json.loads(lines[0])
    assert set(report) == DESIGN_KEYS | {"finish_reason", "error", "workers", "sync_mode", "sync_choice",
                                         "decode_steps", "speculation"}
    assert report["workers"] == []  # one node: no worker figures
    assert report["nodes"] == 1 and report["error"] is None and report["finish_reason"] == "length"
    assert report["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert len(report["tokens"]) == 24 and report["text"] == tokenizer.decode(report["tokens"])
    assert set(report["ms_per_token"]) == {"total", "compute", "sync"}
    assert set(report["bytes_per_token"]) == {"sent", "recv"}
    assert report["tokens_per_s"] > 0 and report["prefill_tokens_per_s"] > 0 and report["peak_rss_mb"] > 50
    assert report["ms_per_token"]["total"] == pytest.approx(1000 / report["tokens_per_s"], rel=1e-6)
    assert isinstance(report["sync"], str) and isinstance(report["sync_dtype"], str)


def test_inference_temperature_0_is_llama_cpp_greedy(inference_json, tokenizer, model_path, llama_ref):
    report = json.loads(inference_json.stdout)
    llama = llama_ref(model_path, 1024)
    expected = llama_greedy_run(llama, tokenizer.encode(PROMPT), 24, tokenizer.is_eog)
    why = greedy_divergence(report["tokens"], expected)
    assert why is None, why
    if report["tokens"] == expected.tokens:
        assert report["text"] == llama.detokenize(expected.tokens).decode("utf-8")


def test_inference_streams_prompt_and_text(inference_json, model_path):
    report = json.loads(inference_json.stdout)
    result = dllama("inference", "-m", model_path, "-p", PROMPT, "-n", "24", "--temperature", "0", "-t", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + report["text"] + "\n"
    assert "tok/s" in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_stops_a_generation_and_keeps_its_text(model_path):
    """Ctrl-C mid-answer: exit 130 within a step or so, the text so far printed (the engine computes
    on the command's own loop, so the batching loop must give it a turn between steps)."""
    prompt = "The history of the city of Paris began"  # greedy: no end of text for well over 1500 tokens
    env = {k: v for k, v in os.environ.items() if k != "DLLAMA_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-m", "dllama", "inference", "-m", model_path, "-p", prompt, "-n", "1500",
                             "--temperature", "0", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        got = b""
        while len(got) < len(prompt) + 40:  # the answer is streaming
            chunk = proc.stdout.read1(4096)
            assert chunk, proc.stderr.read().decode()
            got += chunk
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert time.monotonic() - sent < 5, "Ctrl-C waited for the generation to end"
    assert (got + rest).decode().startswith(prompt) and b"Traceback" not in err, err.decode()


# ------------------------------------------------------------------ errors


def test_bad_model_path(tmp_path):
    result = dllama("inference", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert_one_line_error(result, "missing.gguf")
    assert result.stdout == ""


def test_unknown_model_name():
    assert_one_line_error(dllama("inference", "--model", "no-such-model", "--prompt", "hi"), "no-such-model", "smollm2")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model\n" * 10)
    assert_one_line_error(dllama("inference", "--model", str(path), "--prompt", "hi"), "magic")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(dllama("inference", "--model", str(path), "--prompt", "hi"), "'gpt2'", "architecture")


@pytest.mark.parametrize("extra, key, fragment", [
    ([("blk.0.attn_norm.bias", (64,))], None, "tensor blk.0.attn_norm.bias is not used"),
    ([], ("rope.scaling.type", "longrope"), "llama.rope.scaling.type = 'longrope'"),
], ids=["unused-bias", "longrope"])
def test_a_model_we_would_run_wrongly_is_refused(tmp_path, extra, key, fragment):
    """Never silently wrong, through the CLI: one error line naming the tensor or key."""
    from .test_gguf import _close, _tiny_tensors, _writer

    path = tmp_path / "m.gguf"
    w = _writer(path)
    if key is not None:
        w.add_string(f"llama.{key[0]}", key[1])
    _close(w, _tiny_tensors(extra))
    assert_one_line_error(dllama("inference", "--model", str(path), "--prompt", "hi"), fragment)


def _retype_tensor(path: str, name: str, new_type: int) -> None:
    """Change a tensor's type id in place (its header entry: name, n_dims, dims, type, offset)."""
    blob = bytearray(open(path, "rb").read(64 << 20))
    key = struct.pack("<Q", len(name)) + name.encode()
    at = blob.index(key) + len(key)
    n_dims = struct.unpack_from("<I", blob, at)[0]
    type_at = at + 4 + 8 * n_dims
    with open(path, "r+b") as f:
        f.seek(type_at)
        f.write(struct.pack("<I", new_type))


def test_unsupported_tensor_type(tmp_path, synthetic_model):
    """A tensor of a type we cannot convert (an F32 norm relabelled I32, same size)."""
    path = str(tmp_path / "i32.gguf")
    shutil.copy(synthetic_model("Q8_0"), path)
    _retype_tensor(path, "blk.0.attn_norm.weight", 26)  # GGML_TYPE_I32
    assert_one_line_error(dllama("inference", "--model", path, "--prompt", "hi", "--steps", "2"),
                          "blk.0.attn_norm.weight", "unsupported type I32")


def test_prompt_longer_than_the_context(model_path):
    long_prompt = TEXT_FILE.read_text()[:400]
    args = ("inference", "--model", model_path, "--prompt", long_prompt, "--ctx-size", "16", "--steps", "4")
    assert_one_line_error(dllama(*args, "--json"), "context", "16")
    # without --json the model line goes to stderr too; still exactly one error line
    assert_one_line_error(dllama(*args), "context", only_line=False)


@pytest.mark.parametrize("args, fragment", [(("--steps", "0"), "--steps"), (("--ctx-size", "4"), "--ctx-size"),
                                            (("--top-p", "2"), "--top-p"), (("--no-such-flag",), "--no-such-flag")])
def test_invalid_option_values(model_path, args, fragment):
    """click's own usage errors too: one line, not its usage block."""
    result = dllama("inference", "--model", model_path, "--prompt", "hi", *args)
    assert_one_line_error(result, fragment, "dllama inference --help")
    assert result.returncode == 2


@pytest.mark.parametrize("command", ["inference", "chat", "serve"])
@pytest.mark.parametrize("args, fragment", [(("--temperature", "nan"), "--temperature"),
                                            (("--temperature", "inf"), "--temperature"),
                                            (("--repeat-penalty", "1e-308"), "--repeat-penalty"),
                                            (("--top-p", "nan"), "--top-p")])
def test_sampling_options_outside_their_ranges(model_path, command, args, fragment):
    """click's ranges let NaN and infinities through, and a subnormal penalty sent logits to
    infinity: each is one error line naming the option, before anything loads."""
    extra = ("--prompt", "hi") if command == "inference" else ()
    assert_one_line_error(dllama(command, "--model", model_path, *extra, *args), fragment)


def test_a_prompt_that_is_not_utf8(model_path):
    """Bytes that are not UTF-8 reach Python as lone surrogates; the tokenizer could not encode them."""
    result = dllama("inference", "--model", model_path, "--prompt", os.fsdecode(b"a\xffb"), "--steps", "2")
    assert_one_line_error(result, "not valid UTF-8", "byte 0xff", only_line=False)


# ------------------------------------------------------------------ chat


def test_a_chat_line_that_is_not_utf8(model_path):
    """Whatever the locale makes of stdin (strict here), such a line is the same one error line."""
    env = {k: v for k, v in os.environ.items() if k != "DLLAMA_DEBUG"} | {"PYTHONIOENCODING": "utf-8:strict"}
    result = subprocess.run([sys.executable, "-m", "dllama", "chat", "--model", model_path], input=b"hi \xff there\n",
                            capture_output=True, timeout=300, env=env)
    result = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())
    assert_one_line_error(result, "not valid UTF-8", "byte 0xff", only_line=False)


def test_chat_answers_each_piped_line(model_path, gguf_model, tokenizer, llama_ref):
    questions = ["Hi!", "What is 2+2?"]
    result = dllama("chat", "--model", model_path, "--temperature", "0", "--max-tokens", "24", "--threads", "1",
                    stdin="".join(q + "\n" for q in questions))
    assert result.returncode == 0, result.stderr
    # the expected answers: llama.cpp's greedy continuation of the templated conversation; where
    # llama.cpp sums in another order than ours, a different pick is accepted at a near-tie (after
    # it the conversations differ, so the check ends there)
    template = jinja2.Environment().from_string(gguf_model.chat_template)
    llama = llama_ref(model_path, 1024)
    messages, rest = [], result.stdout.encode()
    for q in questions:
        messages.append({"role": "user", "content": q})
        prompt = template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        ids = tokenizer.encode(prompt, add_bos=False, special=True)
        run = llama_greedy_run(llama, ids, 24, tokenizer.is_eog)
        answer = llama.detokenize(run.tokens)
        if rest.startswith(answer + b"\n"):
            rest = rest[len(answer) + 1:]
            messages.append({"role": "assistant", "content": answer.decode()})
            continue
        assert not bit_exact_expected(), f"answer {result.stdout!r} differs from llama.cpp's {answer!r}"
        # the first of llama.cpp's tokens our text leaves; all of them: we went on past its end
        k = next((i for i in range(len(run.tokens)) if not rest.startswith(llama.detokenize(run.tokens[:i + 1]))),
                 len(run.tokens))
        assert k < len(run.margins) and run.margins[k] < NEAR_TIE, (k, run.margins, result.stdout, answer)
        break
    else:
        assert rest == b""


# ------------------------------------------------------------------ perplexity


def test_perplexity_of_a_file_that_is_not_text(tmp_path, model_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"ok \xf5\x80 not text")
    assert_one_line_error(dllama("perplexity", "--model", model_path, "--text-file", str(path)), "data.bin",
                          "not UTF-8", "offset 3")


def test_perplexity_within_llama_cpp_s_own_spread(model_path, tokenizer, llama_ref):
    """Our perplexity against llama.cpp's one-token-at-a-time evaluation (the order our kernels
    follow), within max(2x llama.cpp's own spread (its batched evaluation against that), 0.5%);
    equal up to float rounding where llama.cpp takes our kernels' path."""
    ctx, max_tokens = 128, 720  # the whole text: fewer tokens make both spreads noise
    result = dllama("perplexity", "--model", model_path, "--text-file", str(TEXT_FILE), "--ctx-size", str(ctx),
                    "--max-tokens", str(max_tokens), "--threads", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert math.isfinite(report["perplexity"]) and report["nodes"] == 1
    # llama.cpp on the same independent windows: each of ctx tokens predicts the next ctx
    ids = tokenizer.encode(TEXT_FILE.read_text())[:max_tokens]
    llama = llama_ref(model_path, 1024)
    logprobs = {"batched": [], "one_by_one": []}
    for start in range(0, len(ids) - 1, ctx):
        chunk = ids[start:start + ctx + 1]
        for way, evaluate in (("batched", ref_logits), ("one_by_one", ref_logits_one_by_one)):
            lp = log_softmax(evaluate(llama, chunk[:-1]))
            logprobs[way] += [lp[i, t] for i, t in enumerate(chunk[1:])]
    assert report["tokens"] == len(logprobs["batched"]) == max_tokens - 1
    ppl = {way: math.exp(-float(np.mean(lp))) for way, lp in logprobs.items()}
    reference = ppl["one_by_one"]
    own_spread = abs(ppl["batched"] - reference) / reference
    ours = abs(report["perplexity"] - reference) / reference
    print(f"\nperplexity: ours {report['perplexity']:.4f}, llama.cpp one by one {reference:.4f}, batched "
          f"{ppl['batched']:.4f} (own spread {own_spread:.3%}, ours {ours:.3%})")
    assert ours <= (1e-6 if bit_exact_expected() else max(2 * own_spread, 0.005))
    assert report["mean_logprob"] == pytest.approx(-math.log(report["perplexity"]), rel=1e-9)


# ------------------------------------------------------------------ models


def test_models_list(model_path):
    result = dllama("models", "list")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("smollm2"))
    assert " pulled " in line and os.path.basename(model_path) in line


@pytest.mark.parametrize("arch, flag, narrower", [
    ("qwen2", "attn_bias", []), ("qwen3", "qk_norm", []),
    ("qwen3moe", "n_experts", ["--dim", "512"]), ("gemma3", "post_norms", ["--dim", "512"]),  # (smaller files)
])
def test_models_synth_writes_other_architectures(tmp_path, model_path, arch, flag, narrower):
    from dllama.gguf_model import GGUFModel

    path = tmp_path / f"{arch}.gguf"
    result = dllama("models", "synth", "--arch", arch, "--layers", "1", *narrower, "--out", str(path))
    assert result.returncode == 0, result.stderr
    config = GGUFModel(path).config
    assert config.arch == arch and getattr(config, flag) and config.rope_neox and config.n_layers == 1
    assert_one_line_error(dllama("models", "synth", "--arch", arch, "--preset", "tiny", "--out", str(path)),
                          "--preset")
