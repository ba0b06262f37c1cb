"""Prompt scoring: the log probability a model gives each token of a given text, teacher-forced
(lm-evaluation-harness's loglikelihood requests; OpenAI completions' `echo` with `logprobs`).

One prefill over the text computes every position's logits (chunked as a step's token budget
chunks a prompt); nothing is sampled and no decode step runs. Position p's token is scored by the
logits of position p - 1, so the first token has none (None, as OpenAI and vLLM answer). The
values are the model's raw distribution, log_softmax over the token vocabulary, as a generated
token's (engines/logprobs.py). The KV pages the prefill writes are the engine's own, taken from its
pool for the call and given back after it, never offered to the prefix cache: a scored text
leaves the pool and the cache as they were."""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines.logprobs import TokenLogprob


class PromptScores(NamedTuple):
    """A text of L tokens scored by one model, on the host: row i is position i + 1 (its token
    predicted from the tokens before it), so every tensor has L - 1 rows."""

    token: torch.Tensor  # [L-1] float32: the text's token's log probability
    top_ids: torch.Tensor | None  # [L-1, k] int64, most probable first (None when k is 0)
    top: torch.Tensor | None  # [L-1, k] float32
    logits: torch.Tensor | None  # [L-1, rows] float32 raw, every output row (when asked: a policy reads them)
    hidden: torch.Tensor | None  # [L-1, hidden] float32 final-normed (when asked: a policy reads them)

    def entry(self, row: int, k: int) -> TokenLogprob:
        """Row `row`'s value as a generated token's, with `k` alternatives (k <= the scored k)."""
        top = () if self.top_ids is None or k == 0 else tuple(
            zip(self.top_ids[row, :k].tolist(), self.top[row, :k].tolist()))
        return TokenLogprob(float(self.token[row]), top)

    def entries(self, k: int) -> list[TokenLogprob]:
        """Every row's value (each tensor read into Python once)."""
        token = self.token.tolist()
        if self.top_ids is None or k == 0:
            return [TokenLogprob(t, ()) for t in token]
        ids, top = self.top_ids[:, :k].tolist(), self.top[:, :k].tolist()
        return [TokenLogprob(t, tuple(zip(i, v))) for t, i, v in zip(token, ids, top)]


def chunk_scores(logits: torch.Tensor, targets: torch.Tensor, vocab: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [n, rows] of n consecutive positions, targets [n] the tokens after them -> (their
    log probabilities [n], top-k ids and values [n, k] or None), batched over the positions."""
    lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    token = lp.gather(1, targets[:, None]).squeeze(1)
    if k == 0:
        return token, None, None
    top, top_ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return token, top_ids, top
