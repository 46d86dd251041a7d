"""The request bodies of the OpenAI-compatible endpoints as JSON Schema, for the served
/openapi.json (what clients' generators and schemathesis read). The handlers validate bodies
themselves (router/http_api.py, router/request_limits.py), with OpenAI's error shape; these
schemas describe what they accept."""
from __future__ import annotations

from shared.sampling_params import MAX_LOGPROBS

_SAMPLING = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": 2**31 - 1},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "minimum": 0.01, "maximum": 10},
    "seed": {"type": ["integer", "null"], "minimum": -2**63, "maximum": 2**63 - 1},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16},
                       {"type": "null"}]},
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": ["boolean", "null"]},
    "speculative": {"type": ["boolean", "null"]},
    "diffusion": {"type": ["object", "null"], "description": "text-diffusion models only", "properties": {
        "steps": {"type": "integer", "minimum": 1}, "block_length": {"type": "integer", "minimum": 1},
        "algorithm": {"type": "string", "enum": ["confidence", "entropy", "margin", "random", "origin",
                                                 "low_confidence", "entropy_bound"]},
        "threshold": {"type": "number"}, "gamma": {"type": "number"}}, "additionalProperties": False},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1},
    "user": {"type": ["string", "null"]},
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0},
                                                  "minItems": 1}]},
        "echo": {"type": ["boolean", "null"]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
    },
}

CHAT_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}, {"type": "null"}]},
                "name": {"type": "string"},
            }}},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
    },
}


def body(schema: dict) -> dict:
    """`openapi_extra` for a route that reads its JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
