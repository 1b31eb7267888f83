"""The OpenAPI schema of `torpor serve`, made true to what the server sends: validation errors are
400 (never 422) in the OpenAI error shape, every operation declares the error statuses it can answer,
the generation endpoints declare their `text/event-stream` form, `/metrics` its Prometheus text.
The fuzz test (tests/cpu/test_server_fuzz.py) holds every response to this schema."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
ERROR_STATUSES = {
    "400": "invalid request: the message names the field (param)",
    "401": "missing or wrong bearer token (API key, or the admin token of the control plane)",
    "403": "wrong admin token, control plane off, or a path outside the allowed weights directory",
    "404": "unknown model",
    "409": "the engine's state forbids it now (e.g. reload_weights while the weights sleep)",
    "413": "the request body is larger than --max-body-bytes",
    "500": "the engine failed (the server goes on)",
    "503": "the engine is asleep past the asleep timeout, or its weights await reload_weights, or it stopped",
}
STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """A JSON object schema: `required` properties, `optional` ones, others allowed."""
    return {"type": "object", "required": list(required), "properties": {**required, **optional}}


BOOL, NUMBER, STRING, INT = {"type": "boolean"}, {"type": "number"}, {"type": "string"}, {"type": "integer"}
NULLABLE_INT = {"anyOf": [INT, {"type": "null"}]}
REPORT = {"anyOf": [_object({"kind": STRING, "seconds": NUMBER, "bytes_copied": INT, "bytes_released": INT,
                             "bytes_mapped": INT, "tags": {"type": "array"}}), {"type": "null"}]}
STATE = {"is_sleeping": BOOL, "serving": BOOL}
CHOICES = {"type": "array", "items": _object({"index": INT, "finish_reason": {"anyOf": [STRING, {"type": "null"}]},
                                              "logprobs": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
                                             stop_reason={"anyOf": [STRING, INT, {"type": "null"}]})}
USAGE = _object({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})
COMPLETION = _object({"id": STRING, "object": STRING, "created": INT, "model": STRING, "choices": CHOICES,
                      "usage": USAGE})
NULLABLE = {"anyOf": [{"type": "object"}, {"type": "null"}]}
GENERATE_ENTRY = _object({"text": STRING, "output_ids": {"type": "array", "items": INT}, "meta_info": _object({
    "id": STRING, "finish_reason": NULLABLE, "prompt_tokens": INT, "completion_tokens": INT, "cached_tokens": INT,
    "weight_version": STRING})})
# The JSON body of each operation's 200 (the routes return plain dicts: this is their contract).
OK_SCHEMAS = {
    "/v1/models": _object({"object": STRING, "data": {"type": "array", "items": _object(
        {"id": STRING, "object": STRING, "created": INT, "owned_by": STRING, "max_model_len": INT})}}),
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": COMPLETION,
    "/health": _object({"status": STRING}, is_sleeping=BOOL, serving=BOOL),
    "/generate": {"anyOf": [GENERATE_ENTRY, {"type": "array", "items": GENERATE_ENTRY}]},
    "/get_model_info": _object({"model_path": STRING, "tokenizer_path": STRING, "is_generation": BOOL,
                                "weight_version": STRING}),
    "/get_server_info": _object({"model_path": STRING, "context_length": INT, "weight_version": STRING,
                                 "version": STRING}),
    "/is_sleeping": _object({"is_sleeping": BOOL}),
    "/sleep": _object({"level": INT, **STATE, "seconds": NUMBER, "report": REPORT}),
    "/wake_up": _object({"woken": {"type": "array", "items": STRING}, **STATE, "seconds": NUMBER, "report": REPORT}),
    "/reload_weights": _object({**STATE, "seconds": NUMBER}),
    "/memory": _object({"level": NULLABLE_INT, "device_used_bytes": NULLABLE_INT, "weights_discarded": BOOL,
                        "tags": {"type": "object"}}),
    "/collective_rpc": _object({"results": {"type": "array", "minItems": 1, "maxItems": 1}}),
    "/release_memory_occupation": _object({"success": BOOL, "level": NULLABLE_INT, **STATE, "seconds": NUMBER,
                                           "report": REPORT}, released={"type": "array", "items": STRING}),
    "/resume_memory_occupation": _object({"success": BOOL, "woken": {"type": "array", "items": STRING}, **STATE,
                                          "seconds": NUMBER, "report": REPORT}),
    "/reset_prefix_cache": _object({"success": BOOL}),
    "/pause": _object({"status": STRING}),
    "/resume": _object({"status": STRING}),
    "/is_paused": _object({"is_paused": BOOL}),
    "/abort_requests": _object({"status": STRING, "aborted": INT}),
    "/get_world_size": _object({"world_size": INT}),
    "/weight_info": _object({"weight_version": STRING}),
    "/update_weight_version": _object({"success": BOOL, "message": STRING, "new_version": STRING}),
    "/pause_generation": _object({"message": STRING, "status": STRING}),
    "/continue_generation": _object({"message": STRING, "status": STRING}),
}
# vLLM's error body on its pause routes, `{"error": "..."}`, beside the OpenAI shape (validation, auth)
VLLM_ERRORS = {"/pause": ("400", "500"), "/resume": ("500",), "/abort_requests": ("500",)}
TEXT = {"text/plain": {"schema": STRING}}
# One server-sent event (the schema applies to each): `data` is a JSON chunk, the last one `[DONE]`.
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "description": "one event of the stream (with \"stream\": true): "
    "`data: {chunk}` per step, an error object if the engine fails, then `data: [DONE]`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's schema, built once with the corrections above."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                _correct(path, operation)
        _drop_unused_validation_schemas(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def _correct(path: str, operation: dict) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for status, description in ERROR_STATUSES.items():
        responses.setdefault(status, {"description": description, **error})
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if path in OK_SCHEMAS:
        ok["content"] = {"application/json": {"schema": OK_SCHEMAS[path]}}
    if path == "/health":
        responses["503"] = {"description": "the engine thread has stopped",
                            "content": {"application/json": {"schema": _object({"status": STRING})}}}
    if path == "/health_generate":  # SGLang's: the status alone, no body
        responses["200"] = {"description": "a one-token generation worked"}
        responses["503"] = {"description": "the engine does not serve (asleep, weights discarded, stopped) or did "
                                           "not answer within 20 s"}
    for status in VLLM_ERRORS.get(path, ()):
        responses[status] = {**responses[status], "content": {"application/json": {"schema": {"anyOf": [
            {"$ref": "#/components/schemas/ErrorResponse"}, _object({"error": STRING})]}}}}
    if path == "/flush_cache":  # SGLang's text, 200 flushed or 400 not
        ok["content"] = dict(TEXT)
        responses["400"] = {"description": "not flushed: requests still ran or waited (SGLang's text), or an invalid "
                                           "timeout", "content": {**TEXT, **error["content"]}}
    if path == "/abort_request":  # SGLang's: 200, empty
        ok.pop("content", None)
    if path in STREAMING_PATHS:
        ok.setdefault("content", {}).update(EVENT_STREAM)
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}


def _drop_unused_validation_schemas(schema: dict) -> None:
    schemas = schema["components"]["schemas"]
    text = str(schema["paths"])
    for name in ("HTTPValidationError", "ValidationError"):
        if f"#/components/schemas/{name}" not in text:
            schemas.pop(name, None)
