"""`query`: query-level routing, RouteLLM-style; one model is chosen per request.

Models are ordered weakest first, and `thresholds` (ascending, M - 1 of them) split a score: the
request goes to model k = the number of thresholds the score reaches (score >= t, RouteLLM's rule).

With `scorer`, a function of the query text, the choice is made at admission, before any model
spends a step, and the chosen model writes the whole response. The scorer returns the strong
model's predicted win rate, as RouteLLM's routers do: a callable `text -> float`, a RouteLLM
`Router` object (its `calculate_strong_win_rate` is called), or "module:attribute" naming either.
The text is the prompt's, or a chat's last message, which is what RouteLLM's controller scores.

Without one, the entry model scores the request from its own prefill: `score="entropy"`, the
normalized entropy of its next-token distribution; `"margin"`, 1 - its top-1 probability; or
`classifier`, sigmoid(w . h + b) on its last hidden state (forms: `policies.checkpoints.load_linear_head`).
That step is not wasted: its token is committed and travels with the request, so the chosen model
extends over prompt + that token (`keep_first_token=False` discards it, the chosen model then
writing every token, at the price of the entry model's prefill and first step).

What this is, relative to RouteLLM: its decision rule (strong if win rate >= threshold, on the last
message's text, one model per response), generalized to M models, and a place to plug its routers
(mf, bert, sw_ranking, causal_llm) in as scorers, serving the chosen model locally with the rest of
this runtime. What it is not: it ships none of RouteLLM's trained routers, it does not calibrate
the threshold to a target share of strong-model calls (RouteLLM's calibrate_threshold; choose
`thresholds` yourself), and the model-based scores above are baselines of ours, not RouteLLM's.
The scorer runs in `Router.submit`, on the event loop: a scorer that calls a remote embedding API
(RouteLLM's mf) stalls admission meanwhile.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from policies.base import STAY, PeerReq, Policy
from policies.checkpoints import load_linear_head
from policies.rstitch import normalized_entropy

SCORES = ("entropy", "margin")
Scorer = Callable[[str], float]


def as_scorer(scorer: object) -> Scorer:
    """A text -> win rate function from a callable, a RouteLLM router, or "module:attribute"."""
    if isinstance(scorer, str):
        mod, _, attr = scorer.partition(":")
        if not attr:
            raise ValueError(f"query: scorer {scorer!r} must be 'module:attribute'")
        try:
            scorer = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"query: cannot import scorer {scorer!r}: {e}") from None
    if hasattr(scorer, "calculate_strong_win_rate"):  # a RouteLLM Router
        return scorer.calculate_strong_win_rate
    if not callable(scorer):
        raise ValueError(f"query: scorer must be callable (text -> strong model's win rate), "
                         f"got {type(scorer).__name__}")
    return scorer


class QueryPolicy(Policy):
    name = "query"

    def __init__(self, thresholds: float | list[float] = 0.5, score: str = "entropy",
                 classifier: str | Path | dict | None = None, scorer: object = None, keep_first_token: bool = True,
                 split: list[float] | None = None, mean_len: float = 256.0):
        th = [float(thresholds)] if isinstance(thresholds, (int, float)) else [float(t) for t in thresholds]
        if not th or any(b < a for a, b in zip(th, th[1:])):
            raise ValueError(f"query: thresholds must be a non-empty ascending list, got {th}")
        if classifier is None and score not in SCORES:
            raise ValueError(f"query: unknown score {score!r}; use one of {', '.join(SCORES)} or a classifier")
        if scorer is not None and classifier is not None:
            raise ValueError("query: give a text scorer or an entry-model classifier, not both")
        if isinstance(scorer, str) and ":" not in scorer:
            raise ValueError(f"query: scorer {scorer!r} must be 'module:attribute' (or a callable)")
        self.thresholds, self.score = th, score
        # a "module:attribute" scorer is imported at setup, by the server's own router: a client
        # choosing it per request would name code to run, so a scorer or a classifier is never per
        # request (allows_per_request)
        self.scorer_spec, self.text_scored = scorer, scorer is not None
        self.scorer = as_scorer(scorer) if scorer is not None and not isinstance(scorer, str) else None
        self.head = load_linear_head(classifier) if classifier is not None else None
        self.needs_hidden = self.head is not None
        self.keep_first_token = bool(keep_first_token)
        self.split, self.mean_len = split, float(mean_len)

    @classmethod
    def allows_per_request(cls, args):  # entropy scores only: a classifier is a file, a scorer is code
        return args.get("scorer") is None and args.get("classifier") is None

    def bind(self, model_names):
        if len(self.thresholds) + 1 != len(model_names):
            raise ValueError(f"policy 'query' has {len(self.thresholds)} thresholds, so it picks among "
                             f"{len(self.thresholds) + 1} models, but the router has {len(model_names)}: "
                             f"{list(model_names)}")
        super().bind(model_names)

    def pick(self, score: float) -> int:
        return sum(score >= t for t in self.thresholds)

    def setup(self, models):
        if self.text_scored and self.scorer is None:
            self.scorer = as_scorer(self.scorer_spec)

    def admit(self, rid, prompt_ids, text):
        if not self.text_scored:
            return None  # the entry model scores the request from its prefill
        if self.scorer is None:
            self.scorer = as_scorer(self.scorer_spec)
        if text is None:
            raise ValueError("query: the scorer reads the query's text; this prompt is token ids and the entry "
                             "model has no tokenizer to decode them")
        return self.pick(float(self.scorer(text)))

    def scores(self, result) -> torch.Tensor:
        if self.head is not None:
            if result.hidden is None:
                raise ValueError("query with a classifier needs the entry model's hidden states")
            return self.head.prob(result.hidden)
        if self.score == "entropy":
            return normalized_entropy(result.logits)
        return 1.0 - torch.softmax(result.logits.float(), dim=-1).max(-1).values

    def route(self, result):
        # Without a scorer, the model a request starts on scores it at its first step (nothing
        # written yet, no other model has seen it) and sends it to the chosen model; then it stays.
        if self.text_scored:
            return [STAY] * len(result.reqs)
        fresh = [i for i, r in enumerate(result.reqs)
                 if r.loc == r.num_prompt_tokens and not any(r.seen[j] for j in self.peers(result.model))]
        dest = [STAY] * len(result.reqs)
        if fresh:
            idx = torch.tensor(fresh)
            sub = result._replace(logits=result.logits[idx],
                                  hidden=result.hidden[idx] if result.hidden is not None else None)
            for i, s in zip(fresh, self.scores(sub).tolist()):
                k = self.pick(s)
                dest[i] = STAY if k == result.model else self.peers(result.model).index(k) + 1
        return dest

    def send(self, req):  # only the admission move: with keep_first_token the entry model's token goes along
        keep = [req.sampled] if self.keep_first_token else []
        return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + keep, loc=req.loc)

    def routing_template(self):
        """Requests do not move after admission: P = I, mixed at rate 1/mean_len (a request ends and
        its replacement is split at admission) with the split. Every step commits its token, but
        for the entry model's first step when `keep_first_token=False` sends the request away."""
        M = self.M
        s = np.full(M, 1.0 / M) if self.split is None else np.asarray(self.split, float) / sum(self.split)
        r = 1.0 / self.mean_len
        P = (1 - r) * np.eye(M) + r * np.tile(s, (M, 1))
        C = np.ones((M, M))
        if not self.text_scored and not self.keep_first_token:
            C[0, 1:] = 0.0
        return P, C
