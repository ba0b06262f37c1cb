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

from aiorouter import Router, RouterError, RouterRequestError, RouterUnavailable, StreamEvent
from engines.grammar import StructuredOutput
from engines.sampling import SEED_MIN
from policies import BUILTIN, PolicyArgumentError, make_policy
from server.logprobs import LoggedToken, TokenText, chat_logprobs, completion_logprobs
from server.openapi import openapi_document
from server.prom import render_metrics
from server.sampling import SamplingDefaults
from server.structured import StructuredFieldError, structured_of
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
    # the most choices one request may ask for (prompts times n, or best_of; the schema's own bound is
    # OpenAI's 128): each costs a generation, so an operator may hold a small server to less
    max_choices: int = 128


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
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        kw.update(repetition_penalty=pick("repetition_penalty"), presence_penalty=body.presence_penalty or 0.0,
                  frequency_penalty=body.frequency_penalty or 0.0,
                  logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
                  stop_token_ids=body.stop_token_ids, min_tokens=body.min_tokens,
                  skip_special_tokens=body.skip_special_tokens,
                  include_stop_str_in_output=body.include_stop_str_in_output)
        try:
            kw["structured"] = structured_of(body)
        except StructuredFieldError as e:
            raise ApiError(400, str(e), param=e.param) from None
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
        return await self._generate(request, body, body.prompts(), body.max_tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, ChatCompletionRequest)
        return await self._generate(request, body, [self._messages(body)], body.limit(), chat=True)

    @staticmethod
    def _messages(body) -> list[dict[str, str]]:
        try:
            return [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None

    async def _generate(self, request: web.Request, body, prompts: list, max_tokens: int | None, chat: bool):
        """Every prompt's `n` choices (`best_of`, for completions) as requests of their own. A prompt's
        first choice is submitted now, its others once it has a token: its prompt's full KV pages
        are in the prefix cache by then, so the prompt is prefilled once and shared (submitted
        together, every choice would prefill it in the same step)."""
        self._require_ready()
        self._check_model(body.model)
        try:
            ids = [self.router.prompt_ids(p) for p in prompts]
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        n = body.n
        best = getattr(body, "best_of", None) or n
        if len(prompts) * best > self.cfg.max_choices:
            field = "best_of" if best > n else ("n" if len(prompts) == 1 else "prompt")
            raise ApiError(400, f"{field}: this request asks for {len(prompts) * best} choices (prompts times "
                           f"{'best_of' if best > n else 'n'}); this server allows at most {self.cfg.max_choices} "
                           "(aiorouter serve --max-choices)", param=field)
        kws = [{**self._sampling(body, max_tokens, len(i)), **self._logprobs(body, chat)} for i in ids]
        if best > n:  # the choices are ranked by their cumulative log probability
            for kw in kws:
                kw["logprobs"] = True
        await self._compile_structured(kws[0]["structured"])
        await self._admit()
        self.in_flight += 1
        submitted: list = []  # every request of this answer, aborted at the end (a no-op once over)
        try:
            choices = []
            for p_ids, kw in zip(ids, kws):
                if max_tokens == 0:  # echo alone (the schema allows 0 only with echo): nothing is generated
                    choices += [_no_output() for _ in range(best)]
                    continue
                first = asyncio.Event() if best > 1 else None
                lead = self._submit(p_ids, kw)  # a bad request is a 400 here, before any answer
                submitted.append(lead)
                choices.append(self._choice(lead, first))
                choices += [self._follower(p_ids, {**kw, "seed": nth_seed(kw["seed"], k)}, first, submitted)
                            for k in range(1, best)]
            echoed = await self._echoed(prompts, ids, kws, body.logprobs) if getattr(body, "echo", False) else None
            if body.stream:
                return await self._sse(request, body, choices, sum(map(len, ids)), chat)
            return await self._whole(body, choices, sum(map(len, ids)), chat, n, best, echoed)
        finally:
            for req in submitted:
                self.router.abort(req)
            self.in_flight -= 1
            self._slots.release()

    async def _echoed(self, prompts: list, ids: list[list[int]], kws: list[dict[str, Any]], k: int | None
                      ) -> list[tuple[str, list[LoggedToken] | None]]:
        """Per prompt, what `echo` puts before its choices: the prompt's text (as sent, or its ids
        decoded), and with `logprobs` k its tokens scored (Router.score, under the request's
        policy) with k alternatives each, text offsets counted over the tokens' own texts."""
        out = []
        text = TokenText(self.router.tokenizer)
        for prompt, p_ids, kw in zip(prompts, ids, kws):
            try:  # (with max_tokens 0 nothing else checks it)
                self.router.check_prompt(p_ids)
            except ValueError as e:
                raise ApiError(400, str(e), param="prompt") from None
            shown = prompt if isinstance(prompt, str) else (
                self.router.tokenizer.decode(p_ids) if self.router.tokenizer is not None else "")
            if k is None:
                out.append((shown, None))
                continue
            try:
                scored = await self.router.score(p_ids, top_logprobs=k, policy=kw.get("policy"))
            except RouterUnavailable as e:
                raise _unavailable(e) from None
            except ValueError as e:
                raise ApiError(400, f"echo: {e}", param="prompt") from None
            except RouterError as e:
                raise ApiError(500, str(e), "server_error") from None
            logged, at = [], 0
            for t, lp, m in zip(scored.token_ids, scored.logprobs, scored.models):
                logged.append(LoggedToken(t, m, lp, at))
                at += len(text(t))
            out.append((shown, logged))
        return out

    async def _compile_structured(self, so: StructuredOutput | None) -> None:
        """A request's grammar compiled off the event loop (cached per schema), so a bad schema is a
        400 naming its field before anything is submitted and `submit` finds the grammar compiled."""
        if so is None:
            return
        try:
            await self.router.compile_structured(so)
        except ValueError as e:
            raise ApiError(400, str(e), param=so.where.split(".")[0]) from None

    def _submit(self, ids: list[int], kw: dict[str, Any]):
        try:
            return self.router.submit(ids, **kw)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RouterUnavailable as e:  # a model restarting after its subserver died: retry shortly
            raise _unavailable(e) from None

    async def _choice(self, req, first: asyncio.Event | None) -> AsyncIterator:
        """One choice's events; `first` is set once it has one (or is over), for its prompt's other choices."""
        # aclosing: a disconnect (the handler is cancelled) aborts the request at once
        async with contextlib.aclosing(self.router.events(req)) as events:
            try:
                async for ev in events:
                    if first is not None:
                        first.set()
                    yield ev
            finally:
                if first is not None:
                    first.set()

    async def _follower(self, ids: list[int], kw: dict[str, Any], first: asyncio.Event, submitted: list
                        ) -> AsyncIterator:
        """A prompt's next choice, submitted once its first choice has a token (or is over)."""
        await first.wait()
        try:
            req = self.router.submit(ids, **kw)
        except ValueError as e:  # its first choice took the same fields: not expected
            raise RouterError(f"a further choice was refused: {e}") from None
        submitted.append(req)
        async for ev in self._choice(req, None):
            yield ev

    @staticmethod
    def _logprobs(body, chat: bool) -> dict[str, Any]:
        """The request's log-probability fields as Router.submit takes them: chat's two, or the
        legacy completions' count (which asks for log probabilities whatever its value, 0 too)."""
        if chat:
            return {"logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs or 0}
        return {"logprobs": body.logprobs is not None, "top_logprobs": body.logprobs or 0}

    @staticmethod
    def _logprobs_object(tokens: list[LoggedToken], chat: bool, text: TokenText) -> dict[str, Any]:
        return chat_logprobs(tokens, text) if chat else completion_logprobs(tokens, text)

    @staticmethod
    def _id(body, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{body.request_id or uuid.uuid4().hex}"  # vLLM's

    def _usage(self, prompt_tokens: int, per_model: dict[str, int]) -> dict:
        n = sum(per_model.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                "per_model": {m: per_model.get(m, 0) for m in self.router.names}}

    async def _whole(self, body, choices: list[AsyncIterator], prompt_tokens: int, chat: bool, n: int = 1,
                     best: int = 1, echoed: list[tuple[str, list[LoggedToken] | None]] | None = None
                     ) -> web.Response:
        """The answer at once: every choice read together; of each prompt's `best` choices, the `n`
        with the highest cumulative log probability (all of them when best == n). `echoed`: per
        prompt, its text and scored tokens, put before each of its choices' (`_echoed`)."""
        asked = self._logprobs(body, chat)["logprobs"]
        token_text = TokenText(self.router.tokenizer) if asked else None

        async def collect(events: AsyncIterator) -> tuple[dict[str, Any], dict[str, int], float]:
            text, per_model, reason, cumulative = [], {}, None, 0.0
            logged: list[LoggedToken] | None = [] if asked else None
            n_chars = 0  # the answer's text so far, where asked: each token's text_offset
            async for ev in events:
                if logged is not None:
                    if ev.token_id is not None:
                        logged.append(LoggedToken(ev.token_id, ev.model, ev.logprob, n_chars))
                    n_chars += len(ev.text)
                if best > n and ev.logprob is not None:
                    cumulative += ev.logprob.logprob
                text.append(ev.text)
                if ev.model:
                    per_model[ev.model] = per_model.get(ev.model, 0) + 1
                reason = ev.finish_reason or reason
            choice = {"index": 0, "finish_reason": reason, "logprobs": None if logged is None else
                      self._logprobs_object(logged, chat, token_text)}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            return choice, per_model, cumulative

        try:
            done = await _all([collect(c) for c in choices])
        except RouterUnavailable as e:  # failed with every request when a model's subserver died
            raise _unavailable(e) from None
        except RouterRequestError as e:  # what it asked for cannot be done (a constraint at a dead end)
            raise ApiError(400, str(e)) from None
        except RouterError as e:
            raise ApiError(500, str(e), "server_error") from None
        if echoed is not None:
            done = [(_with_echo(c, *echoed[i // best], token_text), used, cum) for i, (c, used, cum) in enumerate(done)]
        out, per_model = [], {}
        for at in range(0, len(done), best):  # one prompt's choices
            kept = sorted(done[at:at + best], key=lambda c: -c[2])[:n] if best > n else done[at:at + best]
            for choice, used, _ in kept:
                out.append({**choice, "index": len(out)})
                for m, k in used.items():
                    per_model[m] = per_model.get(m, 0) + k
        rid, created = self._id(body, chat), int(time.time())
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self.cfg.served_model_name, "choices": out,
                                  "usage": self._usage(prompt_tokens, per_model)})

    async def _sse(self, request: web.Request, body, choices: list[AsyncIterator], prompt_tokens: int, chat: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid, created = self._id(body, chat), int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        per_model: dict[str, int] = {}
        opts = body.stream_options
        continuous = opts is not None and opts.continuous_usage_stats

        token_text = TokenText(self.router.tokenizer) if self._logprobs(body, chat)["logprobs"] else None
        n_chars = [0] * len(choices)  # per choice the text streamed so far, where asked: each token's text_offset

        def chunk(text: str | None, reason: str | None, model: str | None, first: bool = False,
                  logprobs: dict | None = None, index: int = 0) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
            d = {"id": rid, "object": obj, "created": created, "model": self.cfg.served_model_name, "choices": [choice]}
            if model:
                d["aiorouter"] = {"model": model}
            if continuous:  # the tokens so far, this chunk's included
                d["usage"] = self._usage(prompt_tokens, per_model)
            return f"data: {json.dumps(d)}\n\n".encode()

        try:
            if chat:
                for i in range(len(choices)):
                    await resp.write(chunk("", None, None, first=True, index=i))
            async with contextlib.aclosing(_merged(choices)) as merged:  # closed: no choice is read on
                async for i, ev in merged:
                    if ev.model:
                        per_model[ev.model] = per_model.get(ev.model, 0) + 1
                    if token_text is not None and ev.token_id is not None:  # asked: every token goes, empty too
                        one = self._logprobs_object([LoggedToken(ev.token_id, ev.model, ev.logprob, n_chars[i])],
                                                    chat, token_text)
                        n_chars[i] += len(ev.text)
                        await resp.write(chunk(ev.text, ev.finish_reason, ev.model, logprobs=one, index=i))
                    elif ev.text or ev.finish_reason:
                        await resp.write(chunk(ev.text, ev.finish_reason, ev.model, index=i))
        except RouterError as e:
            code, kind = (503, "unavailable") if isinstance(e, RouterUnavailable) else \
                (400, "invalid_request_error") if isinstance(e, RouterRequestError) else (500, "server_error")
            err = {"error": {"message": str(e), "type": kind, "param": None, "code": code}}
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        if opts is not None and opts.include_usage:
            u = {"id": rid, "object": obj, "created": created, "model": self.cfg.served_model_name, "choices": [],
                 "usage": self._usage(prompt_tokens, per_model)}
            await resp.write(f"data: {json.dumps(u)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _unavailable(e: RouterUnavailable) -> ApiError:
    """A model is down for now (its subserver restarting after it died): 503, retry shortly."""
    return ApiError(503, str(e), "unavailable", headers={"Retry-After": "1"})


async def _no_output() -> AsyncIterator[StreamEvent]:
    """A choice that generates nothing (echo with max_tokens 0): its one closing event."""
    yield StreamEvent(None, "", None, 0, "length")


def _with_echo(choice: dict[str, Any], prompt: str, logged: list[LoggedToken] | None,
               text: TokenText | None) -> dict[str, Any]:
    """A completions choice with the prompt echoed before it: its text, and its log probabilities
    (the prompt's tokens' first, the choice's text offsets moved past the prompt's text)."""
    choice = {**choice, "text": prompt + choice["text"]}
    if logged is not None and choice["logprobs"] is not None:
        head, tail = completion_logprobs(logged, text), choice["logprobs"]
        tail = {**tail, "text_offset": [len(prompt) + o for o in tail["text_offset"]]}
        choice["logprobs"] = {key: head[key] + tail[key] for key in head}
    return choice


def nth_seed(seed: int | None, k: int) -> int | None:
    """Choice k's seed: the request's plus k (vLLM's), wrapped into the signed 64-bit range."""
    return None if seed is None else (seed + k - SEED_MIN) % 2**64 + SEED_MIN


async def _all(coros: list) -> list:
    """Run `coros` together -> their results; the first to fail cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def _merged(choices: list[AsyncIterator]) -> AsyncIterator[tuple[Any, Any]]:
    """(choice index, event) from every choice, as they come; one choice is read as it is (no task,
    no queue: a plain request pays nothing for this). A choice that fails ends them all."""
    if len(choices) == 1:
        async for ev in choices[0]:
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator) -> None:
        try:
            async for ev in events:
                queue.put_nowait((i, ev))
        except Exception as e:
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))  # this choice is over

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        left = len(tasks)
        while left:
            i, ev = await queue.get()
            if ev is None:
                left -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
