"""The server's OpenAPI 3.1 document (`GET /openapi.json`), built from the pydantic models that
validate its requests and describe its answers (server/schemas.py), so the document cannot drift
from what the server checks. A fuzzer reads it (Schemathesis, tests/test_fuzz.py); clients can
generate from it."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server import schemas as s

_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _body(schema: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema if isinstance(schema, dict)
                                                                         else _ref(schema)}}}


def _json(model: type[BaseModel], what: str, ignored: bool = False) -> dict[str, Any]:
    out = {"description": what, "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
    return {**out, "headers": _IGNORED} if ignored else out


# on the answer to a request that held fields the server does not know and ignored (not with --strict)
_IGNORED = {s.IGNORED_HEADER: {"description": "the request's unknown fields, which the server ignored",
                             "required": False, "schema": {"type": "string"}}}
# the request bodies: their unknown fields are ignored, or refused under --strict
_REQUESTS = (s.CompletionRequest, s.ChatCompletionRequest, s.TokenizeCompletionRequest, s.TokenizeChatRequest,
             s.DetokenizeRequest)


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "the request names its problem", 401: "missing or invalid API key", 404: "unknown model",
            413: "request body too large", 415: "Content-Type is not application/json",
            429: "at capacity: retry after Retry-After", 503: "loading, shutting down, or a model is down"}
    return {str(c): _json(s.ErrorResponse, what[c]) for c in codes}


def _answer(whole: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """A JSON answer, or with "stream": true server-sent events: each event's data is a chunk, an
    error (the request failed after the stream began), or the closing "[DONE]"."""
    ref = {"$ref": _REF.format(model=whole.__name__)}
    data = {"anyOf": [{"const": "[DONE]"}, {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                                    {"$ref": _REF.format(model="ErrorResponse")}]}}]}
    return {"description": "the answer, whole or streamed", "headers": _IGNORED, "content": {
        "application/json": {"schema": ref},
        "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}}


def openapi_document(*, served_model_name: str, models: list[str], api_key: bool, version: str,
                     strict: bool = False) -> dict[str, Any]:
    """The document for one server: `model` takes the served name or one of the router's `models`
    (anything else is a 404), `api_key` adds the bearer scheme every path but /health needs, and
    `strict` (--strict) closes the request bodies to fields they do not declare."""
    _, defs = models_json_schema(
        [(m, "validation") for m in _REQUESTS]
        + [(m, "serialization") for m in (s.Completion, s.ChatCompletion, s.CompletionChunk,
                                          s.ChatCompletionChunk, s.ModelList, s.Health, s.PrefixCacheReset,
                                          s.TokenizeResponse, s.DetokenizeResponse, s.Version, s.ErrorResponse)],
        ref_template=_REF)
    for req in _REQUESTS:
        defs["$defs"][req.__name__]["properties"]["model"] = {
            "anyOf": [{"enum": [served_model_name, *models]}, {"type": "null"}]}
    for name in [m.__name__ for m in _REQUESTS] + ["StreamOptions", "ChatMessage"]:
        assert defs["$defs"][name]["additionalProperties"] is True, name  # pydantic's extra="allow"
        defs["$defs"][name]["additionalProperties"] = not strict
    generate = _errors(400, 404, 413, 415, 429, 503)

    def op(summary: str, responses: dict, body: type[BaseModel] | dict[str, Any] | None = None) -> dict[str, Any]:
        o: dict[str, Any] = {"summary": summary, "responses": responses}
        if body is not None:
            o["requestBody"] = _body(body)
        if api_key:
            o["responses"] = {**responses, **_errors(401)}
        return o

    paths = {
        "/v1/completions": {"post": op(
            "Complete a prompt (text, token ids); routed token by token across the models",
            {"200": _answer(s.Completion, s.CompletionChunk), **generate}, s.CompletionRequest)},
        "/v1/chat/completions": {"post": op(
            "Answer chat messages through the entry model's chat template",
            {"200": _answer(s.ChatCompletion, s.ChatCompletionChunk), **generate}, s.ChatCompletionRequest)},
        "/v1/models": {"get": op("The served model", {"200": _json(s.ModelList, "one model: the router")})},
        "/health": {"get": {"summary": "200 once every model is up; 503 naming a model that is down",
                            "security": [], "responses": {"200": _json(s.Health, "serving"), **_errors(503)}}},
        "/metrics": {"get": op("Prometheus metrics", {"200": {"description": "text exposition format",
                                                             "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        "/tokenize": {"post": op(
            "Token ids of a prompt (text, as /v1/completions tokenizes it) or of chat messages (as "
            "/v1/chat/completions renders them), as vLLM's",
            {"200": _json(s.TokenizeResponse, "the ids", ignored=True), **_errors(400, 404, 413, 415, 503)},
            {"anyOf": [_ref(s.TokenizeCompletionRequest), _ref(s.TokenizeChatRequest)]})},
        "/detokenize": {"post": op(
            "The text of token ids, as vLLM's",
            {"200": _json(s.DetokenizeResponse, "the text", ignored=True), **_errors(400, 404, 413, 415, 503)},
            s.DetokenizeRequest)},
        "/version": {"get": op("The aiorouter version serving", {"200": _json(s.Version, "the version")})},
        "/reset_prefix_cache": {"post": op("Give back the KV pages only the prefix cache holds",
                                           {"200": _json(s.PrefixCacheReset, "pages freed"), **_errors(503)})},
        "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": f"aiorouter ({served_model_name})", "version": version,
                 "description": "OpenAI-compatible serving of token-level routed LLM inference"},
        "paths": paths,
        "components": {"schemas": defs["$defs"]},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
