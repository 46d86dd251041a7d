"""The `tensorserve` command line, run as a user runs it."""
import json
import subprocess
import sys

import pytest

from agreement import greedy_prefix_to_check
from conftest import load_fixture


def tensorserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorserve", *args], input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_models_lists_both_bundled_models():
    out = tensorserve("models")
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "gemma3-270m" in out.stdout


TOKENIZE_FLAGS = {"tokens": [], "tokens_parse_special": ["--parse-special"], "tokens_add_special": ["--add-special"]}


# The command's path is the same for both models, and test_tokenizer.py holds each model's tokenizer
# to llama.cpp's ids in all three modes: SmolLM2 runs every flag here, Gemma 3 (SentencePiece, a BOS
# to add) one of them.
@pytest.mark.parametrize("model,modes", [("smollm2-135m", list(TOKENIZE_FLAGS)),
                                         ("gemma3-270m", ["tokens_add_special"])])
def test_tokenize_prints_llama_cpp_ids(model, modes):
    # a case where parsing special tokens changes the result, so all three flags are exercised
    case = next(c for c in load_fixture(model)["tokenize"] if c["tokens"] != c["tokens_parse_special"])
    for mode in modes:
        out = tensorserve("tokenize", "--model", model, *TOKENIZE_FLAGS[mode], stdin=case["text"])
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == case[mode], mode


def test_score_prints_teacher_forced_top_k(tmp_path):
    case = load_fixture("smollm2-135m")["generate"][0]
    tokens = case["prompt_tokens"] + case["greedy_continuation"][:5]
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(tokens))
    out = tensorserve("score", "--model", "smollm2-135m", "--tokens-json", str(path), "--top-k", "4")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == len(tokens)
    for row, ref in zip(rows, case["teacher_forced"]):
        assert len(row["top_ids"]) == len(row["top_logprobs"]) == 4
        assert row["top_logprobs"] == sorted(row["top_logprobs"], reverse=True)
        if ref["top_logits"][0] - ref["top_logits"][1] >= 0.5:
            assert row["top_ids"][0] == ref["top_ids"][0]


def test_score_rejects_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text("[1, 2, 99999999]")
    out = tensorserve("score", "--model", "smollm2-135m", "--tokens-json", str(path))
    assert out.returncode != 0 and "outside the vocabulary" in out.stderr


def test_generate_streams_llama_cpp_greedy_text():
    from router.tokenizer import Tokenizer
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model
    case = load_fixture("smollm2-135m")["generate"][0]
    n = greedy_prefix_to_check(case)
    assert n > 0
    out = tensorserve("generate", "--model", "smollm2-135m", "--prompt", case["prompt_text"],
                      "--max-tokens", str(n))
    assert out.returncode == 0, out.stderr
    tokenizer = Tokenizer.from_metadata(GGUFFile(resolve_model("smollm2-135m")).metadata)
    assert out.stdout.rstrip("\n") == tokenizer.decode(case["greedy_continuation"][:n])


def test_generate_chat_on_a_model_without_template_fails_clearly():
    out = tensorserve("generate", "--model", "gemma3-270m", "--chat", "--prompt", "hi", "--max-tokens", "2")
    assert out.returncode != 0
    assert "chat template" in out.stderr


def test_generate_rejects_bad_sampling_values():
    out = tensorserve("generate", "--model", "smollm2-135m", "--prompt", "hi", "--temperature", "-1")
    assert out.returncode != 0 and "temperature" in out.stderr


def test_unknown_model_names_the_choices():
    out = tensorserve("tokenize", "--model", "no-such-model", stdin="hi")
    assert out.returncode != 0 and "smollm2-135m" in out.stderr


def test_generate_with_ngram_speculation_streams_the_same_greedy_text():
    from router.tokenizer import Tokenizer
    from shared.gguf_file import GGUFFile
    from shared.model_registry import resolve_model
    case = load_fixture("smollm2-135m")["generate"][0]
    n = greedy_prefix_to_check(case)
    out = tensorserve("generate", "--model", "smollm2-135m", "--prompt", case["prompt_text"],
                      "--max-tokens", str(n), "--speculative", "ngram", "--num-speculative-tokens", "4")
    assert out.returncode == 0, out.stderr
    tokenizer = Tokenizer.from_metadata(GGUFFile(resolve_model("smollm2-135m")).metadata)
    assert out.stdout.rstrip("\n") == tokenizer.decode(case["greedy_continuation"][:n])


@pytest.mark.parametrize("flags,message", [(["--speculative", "draft"], "needs a draft model"),
                                           (["--draft-model", "smollm2-135m"], "only used with --speculative draft"),
                                           (["--speculative", "draft", "--draft-model", "gemma3-270m"],
                                            "does not share the vocabulary"),
                                           (["--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
                                            "--prompt-lookup-min 5 (flag) is above")])
def test_generate_refuses_what_speculation_cannot_do_before_loading(flags, message):
    out = tensorserve("generate", "--model", "smollm2-135m", "--prompt", "hi", *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr
