"""The OpenAI-compatible HTTP front end (aiohttp) over one `Router`."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from aiohttp import web
from pydantic import ValidationError

from aiorouter import Router, RouterError, RouterUnavailable
from policies import BUILTIN, PolicyArgumentError, make_policy
from server.openapi import openapi_document
from server.prom import render_metrics
from server.sampling import SamplingDefaults
from server.schemas import (IGNORED_HEADER, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                            TokenizeChatRequest, TokenizeCompletionRequest, unknown_fields)

log = logging.getLogger("aiorouter.server")

_IGNORED = web.RequestKey("ignored_fields", list)
# A client can send any number of field names: the header names the first few, and the log stops
# naming new ones past a bound, so that neither grows with what a client sends.
HEADER_NAMES_MAX = 16
LOGGED_NAMES_MAX = 256
NAME_CHARS_MAX = 64


def _version() -> str:
    try:
        return importlib.metadata.version("aiorouter")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = "aiorouter"
    api_key: str | None = None
    max_concurrency: int = 64
    max_queue: int = 64  # requests waiting for a slot before 429
    max_body_bytes: int = 4 * 2**20
    default_max_tokens: int = 256  # when neither the request nor the generation config sets one
    # where omitted sampling fields come from: "auto" (the entry model's generation_config.json),
    # "neutral" (OpenAI's values), or a directory holding a generation_config.json (server/sampling.py)
    generation_config: str = "auto"
    # refuse a request holding a field the server does not know (400 naming it); by default such a
    # field is ignored with a logged warning and a response header, as vLLM does
    strict: bool = False


_PUBLIC = frozenset({"/health", "/openapi.json"})  # answered without the API key, as vLLM's


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _field_name(path: tuple) -> str:
    """A field's name for the log and the header: list positions folded ("messages[].x", so that
    the same field in every message is one name), and escaped to printable ASCII, shortened."""
    name = ".".join("[]" if isinstance(p, int) else str(p) for p in path).replace(".[]", "[]")
    name = json.dumps(name)[1:-1]  # control and non-ASCII characters escaped: a header must hold it
    return name if len(name) <= NAME_CHARS_MAX else name[:NAME_CHARS_MAX] + "..."


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Server:
    def __init__(self, router: Router, config: ServerConfig = ServerConfig()):
        self.router, self.cfg = router, config
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._waiting = 0
        # the entry model's file: it tokenizes the prompt, and its authors' sampling is the one asked for
        self.sampling_defaults = SamplingDefaults.load(config.generation_config, router.specs[router.entry].path)
        self.created = int(time.time())  # /v1/models' `created`: when this server started
        self._ignored_logged: set[str] = set()  # unknown field names already warned about (once each)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.on_response_prepare.append(self._ignored_header)
        return app

    @staticmethod
    async def _ignored_header(request: web.Request, response: web.StreamResponse) -> None:
        # every answer to a request that held unknown fields says so, streamed and refused ones too
        if names := request.get(_IGNORED):
            more = f", and {len(names) - HEADER_NAMES_MAX} more" if len(names) > HEADER_NAMES_MAX else ""
            response.headers[IGNORED_HEADER] = ", ".join(names[:HEADER_NAMES_MAX]) + more

    # -- middlewares ---------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return self._refused(request, e.status, e.message, e.type, e.param, e.headers)
        except web.HTTPRequestEntityTooLarge:
            return self._refused(request, 413, f"request body exceeds {self.cfg.max_body_bytes} bytes")
        except web.HTTPException as e:
            if e.status >= 400:
                return self._refused(request, e.status, e.reason or "error")
            raise

    @staticmethod
    def _refused(request: web.Request, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None) -> web.Response:
        # one line per refused request, so that the server's log says why a client fails (the client
        # may show the status alone); the body is not logged
        log.log(logging.WARNING if status >= 500 else logging.INFO, "refused %s %s from %s: %d %s", request.method,
                _one_line(request.path, 100), request.remote or "a unix socket", status, _one_line(message))
        return error_response(status, message, type_, param, headers)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.cfg.api_key and request.path not in _PUBLIC:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.cfg.api_key}".encode()):
                raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                               "authentication_error")
        return await handler(request)

    # -- plain endpoints -----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        # A dead model is named first, even while draining: the server drains *because* of it, and an
        # orchestrator's log should say why rather than just "shutting down".
        down = self.router.health() if self.ready else {}
        if down:  # a model's subserver died: restarting, or (router.dead) down until the process restarts
            return error_response(503, "; ".join(f"model {m!r} is down: {why}" for m, why in down.items()),
                                  "unavailable")
        if not self.ready or self.draining:
            return error_response(503, "not ready" if not self.ready else "shutting down", "unavailable")
        return web.json_response({"status": "ok"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(served_model_name=self.cfg.served_model_name,
                                                  models=list(self.router.names), api_key=bool(self.cfg.api_key),
                                                  version=_version(), strict=self.cfg.strict))

    async def models(self, request: web.Request) -> web.Response:
        entry = self.router.names[self.router.entry]
        # vLLM's fields: `root` the checkpoint behind the name, `max_model_len` the context (unknown
        # until the models are loaded)
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.served_model_name, "object": "model", "created": self.created, "owned_by": "aiorouter",
             "root": str(self.router.specs[self.router.entry].path or entry), "parent": None,
             "max_model_len": self.router.max_model_len if self.ready else None,
             "aiorouter": {"models": self.router.names, "entry": entry,
                           "policy": self.router.policy.name, "mode": self.router.mode}}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        body, ctype = render_metrics(self.router, self)
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Give back the KV pages only the prefix cache holds (as vLLM's endpoint of this name):
        what is still in use afterwards is held by requests, or leaked."""
        if not self.ready:
            raise ApiError(503, "not ready", "unavailable")
        return web.json_response({"pages_freed": self.router.reset_prefix_cache()})

    # -- tokenization (vLLM's endpoints) ------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        """The token ids a prompt is, as the generation endpoints see them by default: text as
        /v1/completions tokenizes it, messages as /v1/chat/completions renders them."""
        data = await self._json(request)
        if "prompt" in data and "messages" in data:
            raise ApiError(400, "give either prompt (text) or messages (chat), not both", param="messages")
        if "prompt" not in data and "messages" not in data:
            raise ApiError(400, "give prompt (text) or messages (chat)", param="prompt")
        body = self._validate(request, data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
        self._require_ready()
        self._check_model(body.model)
        tok = self.router.tokenizer
        if tok is None:
            raise ApiError(400, "the entry model has no tokenizer: it serves token ids only", param="prompt")
        try:
            ids = self._tokenize(body)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if "messages" in data else "prompt") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.router.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return web.json_response(out)

    def _tokenize(self, body) -> list[int]:
        # the generation endpoints' own tokenizing (Router.prompt_ids), with vLLM's switches
        if isinstance(body, TokenizeChatRequest):
            return self.router.prompt_ids(self._messages(body), add_generation_prompt=body.add_generation_prompt,
                                          add_special_tokens=body.add_special_tokens)
        if not body.prompt:  # (an empty text is a prompt generation refuses, but it has ids)
            return list(self.router.tokenizer.encode("", add_special_tokens=body.add_special_tokens))
        return self.router.prompt_ids(body.prompt, add_special_tokens=body.add_special_tokens)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = self._validate(request, await self._json(request), DetokenizeRequest)
        self._require_ready()
        self._check_model(body.model)
        tok = self.router.tokenizer
        if tok is None:
            raise ApiError(400, "the entry model has no tokenizer: it cannot turn ids into text", param="tokens")
        vocab = len(tok)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            shown = ", ".join(map(str, bad[:8])) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            raise ApiError(400, f"tokens: {shown} outside the vocabulary [0, {vocab})", param="tokens")
        return web.json_response({"prompt": tok.decode(body.tokens)})

    # -- generation ----------------------------------------------------------------------------
    async def _body(self, request: web.Request, schema):
        return self._validate(request, await self._json(request), schema)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        ctype = request.headers.get("Content-Type", "")
        if not ctype.split(";")[0].strip().lower() == "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        raw = await request.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except RecursionError:  # the parser recurses per level: 100,000 nested arrays overflow it
            raise ApiError(400, "request body nests too deeply to parse") from None
        except ValueError as e:  # JSON that parses but Python will not hold, e.g. an integer of 5,000 digits
            raise ApiError(400, f"request body holds a number too large to read ({str(e).split(':')[0]})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def _validate(self, request: web.Request, data: dict[str, Any], schema):
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or None
            # our validators' own words, without pydantic's "Value error, " in front
            msg = str(err.get("ctx", {}).get("error", err["msg"])) if err["type"] == "value_error" else err["msg"]
            # a message that names its field already ("tools is not supported ...") is not prefixed again
            raise ApiError(400, f"{loc}: {msg}" if loc and not msg.startswith(f"{loc} ") else msg, param=loc) from None
        unknown = list(unknown_fields(body))
        if unknown and self.cfg.strict:
            where = ".".join(map(str, unknown[0]))
            raise ApiError(400, f"{_one_line(where, NAME_CHARS_MAX)}: unknown field (this server runs with --strict, "
                                "which refuses fields it does not implement)", param=where)
        if unknown:
            request[_IGNORED] = names = list(dict.fromkeys(_field_name(p) for p in unknown))
            self._warn_ignored(names)
        return body

    def _warn_ignored(self, names: list[str]) -> None:
        """A warning the first time each name is ignored (a client sends the same fields with every
        request: once is enough to say it), up to LOGGED_NAMES_MAX names."""
        for name in names:
            if name in self._ignored_logged or len(self._ignored_logged) > LOGGED_NAMES_MAX:
                continue
            self._ignored_logged.add(name)
            if len(self._ignored_logged) <= LOGGED_NAMES_MAX:
                log.warning("ignoring request field '%s' (not an aiorouter/OpenAI/vLLM field it implements); "
                            "start with --strict to refuse such requests", name)
            else:
                log.warning("more than %d distinct unknown request fields ignored; the log names no more of them "
                            "(each answer still does, in %s)", LOGGED_NAMES_MAX, IGNORED_HEADER)

    def _require_ready(self) -> None:
        if not self.ready:  # the port is open while the models load; the tokenizer is not there yet
            raise ApiError(503, "the models are still loading; GET /health answers 200 once they are ready",
                           "unavailable", headers={"Retry-After": "1"})

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.served_model_name and name not in self.router.names:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.cfg.served_model_name!r}",
                           "not_found_error", "model")

    def _sampling(self, body, max_tokens: int | None, prompt_len: int) -> dict[str, Any]:
        ctx = self.router.max_model_len
        if prompt_len >= ctx:
            raise ApiError(400, f"prompt has {prompt_len} tokens; the context is {ctx} tokens", param="prompt")
        d = self.sampling_defaults
        if max_tokens is None:
            max_tokens = min(d.max_tokens or self.cfg.default_max_tokens, ctx - prompt_len)
        elif prompt_len + max_tokens > ctx:
            raise ApiError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                                f"context of {ctx} tokens", param="max_tokens")
        def pick(name: str):  # the request's value, else the default (vLLM's order)
            value = getattr(body, name)
            return getattr(d, name) if value is None else value
        kw = dict(max_tokens=max_tokens, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
                  min_p=pick("min_p"), seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
        if body.routing is not None:
            kw["policy"] = self._routing_override(body.routing)
        return kw

    def _routing_override(self, spec: dict[str, Any]):
        args = dict(spec)
        name = args.pop("policy", self.router.policy.name)
        if not isinstance(name, str):
            raise ApiError(400, "routing.policy must be a policy name", param="routing.policy")
        if name in BUILTIN and not BUILTIN[name].allows_per_request(args):  # before it reads any file
            raise ApiError(400, f"routing: policy {name!r} cannot be chosen per request with these arguments "
                                "(it loads a trained network or code); the server's own policy can be", param="routing")
        try:
            policy = make_policy(name, args)
            policy.bind(self.router.names)
        except PolicyArgumentError as e:  # the policy's argument schema: name the field as the client wrote it
            where = f"routing.{e.field}" if e.field else "routing"
            raise ApiError(400, f"{where}: {e.reason}", param=where) from None
        except Exception as e:  # a policy's constructor is user input's first reader: whatever it raises, it said no
            raise ApiError(400, f"routing: {e}", param="routing") from None
        return policy

    async def _admit(self) -> None:
        if self.draining:
            raise ApiError(503, "server is shutting down", "unavailable")
        if self._slots.locked() and self._waiting >= self.cfg.max_queue:
            raise ApiError(429, f"server is at capacity ({self.cfg.max_concurrency} running, "
                                f"{self._waiting} queued); retry later", "rate_limit_error",
                           headers={"Retry-After": "1"})
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, CompletionRequest)
        return await self._generate(request, body, body.prompt, body.max_tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, ChatCompletionRequest)
        return await self._generate(request, body, self._messages(body), body.limit(), chat=True)

    @staticmethod
    def _messages(body) -> list[dict[str, str]]:
        try:
            return [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None

    async def _generate(self, request: web.Request, body, prompt, max_tokens: int | None, chat: bool):
        self._require_ready()
        self._check_model(body.model)
        try:
            ids = self.router.prompt_ids(prompt)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        kw = self._sampling(body, max_tokens, len(ids))
        await self._admit()
        self.in_flight += 1
        try:
            try:
                req = self.router.submit(ids, **kw)
            except ValueError as e:
                raise ApiError(400, str(e)) from None
            except RouterUnavailable as e:  # a model restarting after its subserver died: retry shortly
                raise ApiError(503, str(e), "unavailable", headers={"Retry-After": "1"}) from None
            # aclosing: a disconnect (the handler is cancelled) aborts the request at once
            async with contextlib.aclosing(self.router.events(req)) as events:
                if body.stream:
                    return await self._sse(request, body, events, len(ids), chat)
                return await self._whole(body, events, len(ids), chat)
        finally:
            self.in_flight -= 1
            self._slots.release()

    @staticmethod
    def _id(body, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{body.request_id or uuid.uuid4().hex}"  # vLLM's

    def _usage(self, prompt_tokens: int, per_model: dict[str, int]) -> dict:
        n = sum(per_model.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                "per_model": {m: per_model.get(m, 0) for m in self.router.names}}

    async def _whole(self, body, events: AsyncIterator, prompt_tokens: int, chat: bool) -> web.Response:
        text, per_model, reason = [], {}, None
        try:
            async for ev in events:
                text.append(ev.text)
                if ev.model:
                    per_model[ev.model] = per_model.get(ev.model, 0) + 1
                reason = ev.finish_reason or reason
        except RouterUnavailable as e:  # failed with every request when a model's subserver died
            raise ApiError(503, str(e), "unavailable", headers={"Retry-After": "1"}) from None
        except RouterError as e:
            raise ApiError(500, str(e), "server_error") from None
        rid, created = self._id(body, chat), int(time.time())
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self.cfg.served_model_name, "choices": [choice],
                                  "usage": self._usage(prompt_tokens, per_model)})

    async def _sse(self, request: web.Request, body, events: AsyncIterator, prompt_tokens: int, chat: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid, created = self._id(body, chat), int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        per_model: dict[str, int] = {}
        opts = body.stream_options
        continuous = opts is not None and opts.continuous_usage_stats

        def chunk(text: str | None, reason: str | None, model: str | None, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            d = {"id": rid, "object": obj, "created": created, "model": self.cfg.served_model_name, "choices": [choice]}
            if model:
                d["aiorouter"] = {"model": model}
            if continuous:  # the tokens so far, this chunk's included
                d["usage"] = self._usage(prompt_tokens, per_model)
            return f"data: {json.dumps(d)}\n\n".encode()

        try:
            if chat:
                await resp.write(chunk("", None, None, first=True))
            async for ev in events:
                if ev.model:
                    per_model[ev.model] = per_model.get(ev.model, 0) + 1
                if ev.text or ev.finish_reason:
                    await resp.write(chunk(ev.text, ev.finish_reason, ev.model))
        except RouterError as e:
            code = 503 if isinstance(e, RouterUnavailable) else 500
            err = {"error": {"message": str(e), "type": "unavailable" if code == 503 else "server_error",
                             "param": None, "code": code}}
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        if opts is not None and opts.include_usage:
            u = {"id": rid, "object": obj, "created": created, "model": self.cfg.served_model_name, "choices": [],
                 "usage": self._usage(prompt_tokens, per_model)}
            await resp.write(f"data: {json.dumps(u)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
