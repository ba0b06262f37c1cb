"""Log probabilities of the sampled tokens, as the OpenAI API returns them (chat's `logprobs` and
`top_logprobs`, completions' `logprobs=k`).

They are the model's raw distribution: log_softmax of the step's logits before temperature or any
filter, as vLLM's default (`logprobs_mode="raw_logprobs"`), so a token's log probability is the
model's whatever the request sampled with. Computed in the step that sampled the token, from the
logits it already holds, for the rows that asked: one log_softmax, one gather and one topk over
those rows together. A step with no such row computes nothing (`ModelRunner.run` is told so by
its engine's scheduler, which counts the live sequences that asked)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from engines.devices import host_tensor

# The most alternatives a request may ask for per token: OpenAI's top_logprobs bound, and vLLM's
# default max_logprobs.
MAX_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """One sampled token's log probability under the model that sampled it, and the `k` most
    probable tokens of that step (k as the request asked), most probable first."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log probability)


def check_logprobs(n: object) -> None:
    """ValueError unless `n` is None (no log probabilities) or a count of alternatives in [0, MAX_LOGPROBS]."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the alternatives per token) or None, "
                         f"got {n!r}")


class StepLogprobs(NamedTuple):
    """The log probabilities of one step's asking rows, as tensors (on the device until `to_host`)."""

    rows: list[int]  # batch rows that asked, ascending
    ks: list[int]  # alternatives each asked for
    token: torch.Tensor  # [R] float32: the sampled token's log probability
    top_ids: torch.Tensor | None  # [R, max(ks)] int64, most probable first (None when no row wants any)
    top: torch.Tensor | None  # [R, max(ks)] float32

    def to_host(self) -> "StepLogprobs":
        """Copies to the host, queued on the current stream (non-blocking: the caller synchronizes
        before reading them, as the runner does for the step's tokens)."""
        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)
        return self._replace(token=host(self.token), top_ids=host(self.top_ids), top=host(self.top))

    def entries(self, batch: int) -> tuple[TokenLogprob | None, ...]:
        """-> per batch row its TokenLogprob, None for a row that did not ask. Host tensors only.
        Each tensor is read into Python once; the per-row work is building the answer itself."""
        out: list[TokenLogprob | None] = [None] * batch
        token = self.token.tolist()
        if self.top_ids is None:
            for r, lp in zip(self.rows, token):
                out[r] = TokenLogprob(lp, ())
            return tuple(out)
        ids, top = self.top_ids.tolist(), self.top.tolist()
        for i, (r, k) in enumerate(zip(self.rows, self.ks)):
            out[r] = TokenLogprob(token[i], tuple(zip(ids[i][:k], top[i][:k])))
        return tuple(out)


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asked: Sequence[int | None]) -> StepLogprobs | None:
    """logits [B, V] (raw, the token vocabulary only), tokens [B] sampled from them, and per row
    the alternatives it asked for (None: no log probabilities) -> the asking rows' log
    probabilities, on logits' device, with no host sync; None when no row asked.

    One log_softmax over the asking rows together (in float32), the sampled ids gathered from it,
    and one topk of the largest count asked; each row keeps its own count when read (`entries`)."""
    rows = [i for i, k in enumerate(asked) if k is not None]
    if not rows:
        return None
    ks = [asked[i] for i in rows]
    if len(rows) == len(asked):  # the whole batch: no gather
        lp, tok = torch.log_softmax(logits.float(), dim=-1), tokens
    else:
        idx = host_tensor(rows, torch.int64, logits.device)
        lp, tok = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1), tokens.index_select(0, idx)
    token = lp.gather(1, tok.to(lp.device)[:, None]).squeeze(1)
    k = min(max(ks), lp.shape[-1])
    if k == 0:
        return StepLogprobs(rows, ks, token, None, None)
    top, top_ids = torch.topk(lp, k, dim=-1)
    return StepLogprobs(rows, ks, token, top_ids, top)


def requested(logprobs: bool, top_logprobs: int | None) -> int | None:
    """OpenAI chat's two fields -> SamplingParams.logprobs: `logprobs` asks for each token's log
    probability, `top_logprobs` for that many alternatives too (it needs `logprobs`, as OpenAI's
    API says). Bad values are a ValueError naming the field."""
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs must be true or false, got {logprobs!r}")
    k = 0 if top_logprobs is None else top_logprobs
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
    if k and not logprobs:
        raise ValueError("top_logprobs needs logprobs set to true")
    return k if logprobs else None
