"""Chat templates render like Hugging Face's apply_chat_template."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from router.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateMissing
from router.tokenizer import Tokenizer
from shared.errors import ModelNotFound
from shared.gguf_file import GGUFFile
from shared.model_registry import resolve_model

FIXTURES = Path(__file__).parent / "fixtures"


def _metadata(model: str) -> dict:
    try:
        return GGUFFile(resolve_model(model)).metadata
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2() -> tuple[dict, Tokenizer]:
    md = _metadata("smollm2-135m")
    return md, Tokenizer.from_metadata(md)


def test_smollm2_renders_like_the_reference(smollm2):
    md, tok = smollm2
    case = next(c for c in json.loads((FIXTURES / "smollm2-135m.json").read_text())["generate"] if "messages" in c)
    prompt = ChatTemplate.from_metadata(md, tok).render(case["messages"])
    assert prompt == case["rendered_prompt"]
    assert tok.encode(prompt, add_special=True, parse_special=True) == case["prompt_tokens"]


def test_smollm2_generation_prompt_and_system_message(smollm2):
    template = ChatTemplate.from_metadata(*smollm2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert template.render(messages).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_gemma3_base_has_no_template():
    md = _metadata("gemma3-270m")
    with pytest.raises(ChatTemplateMissing) as info:
        ChatTemplate.from_metadata(md, Tokenizer.from_metadata(md))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "Gemma 3 270m" in message and "completions" in message and "--chat-template" in message


def test_chatml_fallback_matches_llama_cpp_for_tiny_llada():
    md = GGUFFile(FIXTURES / "diffusion" / "tiny-llada.gguf").metadata
    tok = Tokenizer.from_metadata(md)
    with pytest.raises(ChatTemplateMissing):
        ChatTemplate.from_metadata(md, tok)
    run = json.loads((FIXTURES / "diffusion" / "tiny-llada.json").read_text())["cli"][0]
    prompt = ChatTemplate.chatml(tok).render([{"role": "user", "content": run["prompt_text"]}])
    assert prompt == run["rendered_prompt"]


def test_hf_environment():
    render = lambda src, **kw: ChatTemplate(src, "<s>", "</s>").render([], **kw)  # noqa: E731
    assert render("{{ bos_token }}{{ eos_token }}") == "<s></s>"
    assert render("{{ x | tojson }}", x={"a": "<b>é"}) == '{"a": "<b>é"}'
    assert render("{{ x | tojson(indent=2) }}", x=[1]) == "[\n  1\n]"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    assert render("  {% if true %}\nx\n  {% endif %}\ny") == "x\ny"  # trim_blocks, lstrip_blocks
    assert render("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "1"
    assert render("{% generation %}kept{% endgeneration %}") == "kept"
    assert render("{{ 'tools' if tools is none else 'x' }}") == "tools"
    assert render("{{ add_generation_prompt }}", add_generation_prompt=False) == "False"


def test_template_errors_are_value_errors():
    with pytest.raises(ChatTemplateError, match="only user and assistant"):
        ChatTemplate("{{ raise_exception('only user and assistant roles') }}").render([])
    with pytest.raises(ChatTemplateError):  # the sandbox is immutable
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + '!' }}").render([{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% if %}")
