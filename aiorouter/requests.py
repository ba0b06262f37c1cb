"""The router's active requests and how they end. Each committed token is streamed here, once, in
order, whichever model made it: a token a model keeps is committed by its engine
(`Engine.commit`, which feeds the request's output stream: stop checks, text) and published here;
the tokens a policy's send carries are committed to the stream here. An ending releases the
request's KV on every model that holds it."""
from __future__ import annotations

import time
import uuid

from aiorouter.launch import LaunchControl
from aiorouter.metrics import RouterMetrics
from aiorouter.request import Release, RouterError, RouterRequest, RouterRequestError, StreamEvent
from engines import SamplingParams
from engines.grammar import GrammarDeadEnd, GrammarState
from engines.logprobs import TokenLogprob
from engines.output import Commit, OutputStream
from policies.base import Policy


class RequestTable:
    def __init__(self, names: list[str], metrics: RouterMetrics, launch: LaunchControl):
        self.names, self.metrics, self.launch = names, metrics, launch
        self.active: dict[str, RouterRequest] = {}

    def __len__(self) -> int:
        return len(self.active)

    def new(self, ids: list[int], sampling: SamplingParams, policy: Policy, tokenizer, eos_ids: tuple[int, ...],
            max_model_len: int, grammar: GrammarState | None = None) -> RouterRequest:
        """`grammar`: the request's structured-output state, kept on its output stream, through which
        every committed token passes, whichever model wrote it."""
        out = OutputStream(list(ids), len(ids), sampling, eos_ids, max_model_len, tokenizer, defer_text=True,
                           grammar=grammar)
        req = RouterRequest(uuid.uuid4().hex, out, policy, len(self.names))
        self.active[req.rid] = req
        self.metrics.requests_started += 1
        self._count()
        return req

    def commit(self, req: RouterRequest, tokens: list[int], model: int, logprob: TokenLogprob | None = None) -> None:
        """`model` commits `tokens` for `req` that no engine sequence takes (the tokens a policy's
        send carries): each is streamed as one event; a stop ends the request. `logprob`: the
        first token's (the one `model` sampled), when the request asked."""
        for t in tokens:
            if req.finished:
                return
            try:
                c = req.out.append(t)
            except Exception as e:
                self.failed_commit(req, t, model, e)
                return
            self.publish(req, t, c, model, logprob)
            logprob = None

    def publish(self, req: RouterRequest, token: int, c: Commit, model: int,
                logprob: TokenLogprob | None = None) -> None:
        """`token`, committed to `req`'s output by `model` (`c`), goes out as one event (with its
        log probability, when the request asked); a stop ends the request."""
        name = self.names[model]
        req.trace.append(model)
        self.metrics.models[name].tokens_committed += 1
        if req.t_first_token is None:
            req.t_first_token = time.perf_counter()
        req.events.push(StreamEvent(token, c.text, name, req.num_output_tokens - 1, c.finish_reason, logprob))
        if c.finish_reason is not None:
            self._end(req)

    def failed_commit(self, req: RouterRequest, token: int, model: int, err: Exception) -> None:
        """Detokenizing or a stop check raised on `token`: this request fails, not its model (as the
        client's fault when its own constraint allows no token here)."""
        if isinstance(err, GrammarDeadEnd):
            self.fail(req, RouterRequestError(f"after {req.num_output_tokens} output tokens, {err}"))
            return
        self.fail(req, RouterError(f"committing output token {req.num_output_tokens} (id {token}) from model "
                                   f"{self.names[model]!r} failed: {err!r}"))

    def failed_text(self, req: RouterRequest, ev: StreamEvent, err: Exception) -> RouterError:
        """Detokenizing a deferred token raised as its consumer took it: the request fails (and
        ends, on every model) -> the error its consumer raises."""
        what = f"output token {ev.index} (id {ev.token_id}) from model {ev.model!r}" if ev.token_id is not None \
            else "the last text of the output"
        error = RouterError(f"committing {what} failed: {err!r}")
        self.fail(req, error)
        return error

    def finish(self, req: RouterRequest, reason: str = "stop") -> None:
        """End a request that committed no stop token (a policy's finished PeerReq)."""
        if not req.finished:
            try:
                text = req.out.finish(reason)
            except Exception as e:  # the held-back text would not decode
                self.fail(req, RouterError(f"ending the request failed while detokenizing its last text: {e!r}"))
                return
            req.events.push(StreamEvent(None, text, None, req.num_output_tokens, reason))
            self._end(req)

    def fail(self, req: RouterRequest, err: BaseException) -> None:
        if self.active.get(req.rid) is not req:  # over already (failing again after a failed finish is fine)
            return
        req.error = err if isinstance(err, RouterError) else RouterError(str(err))
        self._close_output(req, "error")
        self.metrics.requests_failed += 1
        req.events.push(req.error)
        self._end(req)

    def abort(self, req: RouterRequest) -> None:
        if not req.finished:
            self._close_output(req, "abort")
            self._end(req)

    @staticmethod
    def _close_output(req: RouterRequest, reason: str) -> None:
        """Mark the output over. Its held-back text is not streamed on an abort or an error, so a
        detokenizer that raises on it (the reason the request may be failing) changes nothing."""
        try:
            req.out.finish(reason)
        except Exception:
            pass

    def count_handoff(self, src: int, dst: int) -> None:
        self.metrics.handoffs[(self.names[src], self.names[dst])] += 1

    def fail_all(self, err: BaseException) -> None:
        for req in list(self.active.values()):
            self.fail(req, err)

    def _end(self, req: RouterRequest) -> None:
        if self.active.pop(req.rid, None) is None:
            return
        self.metrics.requests_finished[req.finish_reason] += 1
        for i, seq in enumerate(req.local):
            if seq is not None:
                self.launch.post(i, Release(req))
        self._count()

    def _count(self) -> None:
        self.metrics.active = len(self.active)
        self.launch.set_active(len(self.active))
