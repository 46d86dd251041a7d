"""What an HTTP request body may be before any field is read: its content type, size, JSON
syntax, nesting depth, numbers and strings. Each limit gives a 4xx in OpenAI's error shape
that says what is wrong and what to do; none lets a client's body reach a 500.

The numbers are generous for real clients (a chat of long messages is a few levels deep and a
few hundred KB) and small enough that no body costs the router more than a few milliseconds.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from router.frontend import FrontendError

MAX_BODY_BYTES = 16 * 2**20          # a 8k-token prompt as token ids is ~60 KB; as text ~40 KB
MAX_DEPTH = 32                       # messages[i].content[j].text is 5 levels
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _bad(message: str, status: int = 400, code: str = "invalid_request", param: str | None = None) -> FrontendError:
    return FrontendError(message, status, code=code, param=param)


def check_content_type(value: str | None) -> None:
    """No header (curl -d without -H) is taken as JSON; anything else but JSON is refused."""
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise _bad(f"Content-Type {media!r} is not supported: send the body as JSON with "
                   "'Content-Type: application/json'", 415, code="unsupported_media_type")


def check_size(length: int) -> None:
    if length > MAX_BODY_BYTES:
        raise _bad(f"the request body is {length} bytes; this server takes at most {MAX_BODY_BYTES} "
                   "(shorten the prompt or send token ids)", 413, code="request_too_large")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, with every string valid Unicode and every number finite."""
    check_size(len(raw))
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError as exc:
        raise _bad(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", code="invalid_json")
    check_values(body)
    return body


def check_values(body: dict) -> None:
    """Walks the body without recursion: depth, lone surrogates (which no text encoding can
    carry: "\\ud800"), and numbers too large for a float (1e400)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels (at {path or 'the top'})",
                       code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{path}.{key}" if path else "a key")
                stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise _bad(f"{path} is not a finite number", param=path.split(".")[0].split("[")[0] or None,
                       code="invalid_value")


def _check_text(text: str, path: str) -> None:
    m = _SURROGATE.search(text)
    if m:
        raise _bad(f"{path} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character {m.start()}), "
                   "which is not valid Unicode; send the text as UTF-8", param=path.split(".")[0].split("[")[0],
                   code="invalid_value")


def check_role(role: Any, index: int) -> str:
    if role not in ROLES:
        raise _bad(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}",
                   param="messages", code="invalid_value")
    return role


def check_stop(stop: list[str]) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop",
                   code="invalid_value")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(s)}", param="stop",
                       code="invalid_value")
    return stop
