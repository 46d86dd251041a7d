"""Chat templates: the GGUF's tokenizer.chat_template rendered the way Hugging Face does.

Same environment as transformers' apply_chat_template: a jinja2 immutable
sandbox with trim_blocks and lstrip_blocks, loop controls, a `tojson` filter
that does not HTML-escape, `raise_exception`, `strftime_now`, the
`{% generation %}` tag, and the variables messages, tools, documents,
add_generation_prompt, bos_token and eos_token.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.tokenizer import Tokenizer

TEMPLATE_KEY = "tokenizer.chat_template"

# llama.cpp's built-in ChatML (llm_chat_apply_template, LLM_CHAT_TEMPLATE_CHATML),
# which llama.cpp falls back to when a GGUF has no template
_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")


class ChatTemplateMissing(ValueError):
    """The model has no chat template, so chat requests cannot be served."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _model_name(metadata: Mapping[str, Any]) -> str:
    for key in ("general.name", "general.basename", "general.architecture"):
        if metadata.get(key):
            return str(metadata[key])
    return "this model"


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may refer to."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 name: str = "chat template"):
        self.source = source
        self.name = name
        self._defaults: dict[str, Any] = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{name}: the chat template does not parse (line {exc.lineno}: "
                                    f"{exc.message}); pass a fixed template or use completions") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer) -> "ChatTemplate":
        model = _model_name(metadata)
        source = metadata.get(TEMPLATE_KEY)
        if not source:
            raise ChatTemplateMissing(
                f"model '{model}' has no chat template ({TEMPLATE_KEY} is not in its GGUF), so it cannot "
                "serve chat requests; send plain prompts to the completions endpoint, or give the "
                "server a template with --chat-template FILE")
        return cls(str(source), tokenizer.bos_text, tokenizer.eos_text, name=f"chat template of '{model}'")

    @classmethod
    def from_file(cls, path: str, tokenizer: Tokenizer | None = None) -> "ChatTemplate":
        """--chat-template: a Jinja file used instead of the GGUF's template."""
        with open(path, encoding="utf-8") as f:
            source = f.read()
        return cls(source, tokenizer.bos_text if tokenizer else None, tokenizer.eos_text if tokenizer else None,
                   name=f"chat template {path}")

    @classmethod
    def chatml(cls, tokenizer: Tokenizer | None = None) -> "ChatTemplate":
        """llama.cpp's ChatML fallback, for callers that choose it explicitly for a template-less model."""
        return cls(_CHATML, tokenizer.bos_text if tokenizer else None,
                   tokenizer.eos_text if tokenizer else None, name="ChatML")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`; extra variables (tools, documents, ...) go to the template."""
        variables = {"tools": None, "documents": None, **self._defaults, **extra}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except (jinja2.exceptions.TemplateError, TypeError) as exc:  # TypeError: e.g. None + str
            raise ChatTemplateError(f"{self.name}: {exc}") from None
