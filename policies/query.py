"""`query`: RouteLLM-style query-level routing; one of M models writes the whole response.

At a request's first step on the entry model (no output token yet), a score picks the model:
model k = the number of `thresholds` (ascending, M - 1 of them; models ordered weakest first) that
the score exceeds. If that is the entry model, it keeps its token and the request never moves; else
the entry model's token is discarded and the chosen model writes the whole response.

Scores: `score="entropy"`, the normalized entropy of the entry model's next-token distribution;
`"margin"`, 1 - its top-1 probability; or `classifier`, sigmoid(w . h + b) on its last hidden state
(same file forms as Co-LLM's head, see `policies.networks.load_linear_head`).
Approximation: the interface hands the policy the distribution at the last prompt position only,
so the score is that position's, not the mean over all prompt positions.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from policies.base import Policy
from policies.networks import load_linear_head
from policies.rstitch import normalized_entropy

SCORES = ("entropy", "margin")


class QueryPolicy(Policy):
    name = "query"

    def __init__(self, thresholds: float | list[float] = 0.5, score: str = "entropy",
                 classifier: str | Path | dict | None = None, split: list[float] | None = None,
                 mean_len: float = 256.0):
        th = [float(thresholds)] if isinstance(thresholds, (int, float)) else [float(t) for t in thresholds]
        if not th or any(b < a for a, b in zip(th, th[1:])):
            raise ValueError(f"query: thresholds must be a non-empty ascending list, got {th}")
        if classifier is None and score not in SCORES:
            raise ValueError(f"query: unknown score {score!r}; use one of {', '.join(SCORES)} or a classifier")
        self.thresholds, self.score = th, score
        self.head = load_linear_head(classifier) if classifier is not None else None
        self.needs_hidden = self.head is not None
        self.split, self.mean_len = split, float(mean_len)

    def bind(self, model_names):
        if len(self.thresholds) + 1 != len(model_names):
            raise ValueError(f"policy 'query' has {len(self.thresholds)} thresholds, so it picks among "
                             f"{len(self.thresholds) + 1} models, but the router has {len(model_names)}: "
                             f"{list(model_names)}")
        super().bind(model_names)

    def scores(self, result) -> torch.Tensor:
        if self.head is not None:
            if result.hidden is None:
                raise ValueError("query with a classifier needs the entry model's hidden states")
            return self.head.prob(result.hidden)
        if self.score == "entropy":
            return normalized_entropy(result.logits)
        return 1.0 - torch.softmax(result.logits.float(), dim=-1).max(-1).values

    def route(self, result):
        # The entry model (0) scores a request once, at its first step; the chosen model k is the
        # entry model's k-th peer, so the score's rank is the destination. Elsewhere: stay.
        if result.model != 0:
            return [0] * len(result.reqs)
        todo = [i for i, r in enumerate(result.reqs) if "query_model" not in r.state]
        if todo:
            idx = torch.tensor(todo)
            sub = result._replace(logits=result.logits[idx],
                                  hidden=result.hidden[idx] if result.hidden is not None else None)
            for i, s in zip(todo, self.scores(sub).tolist()):
                result.reqs[i].state["query_model"] = sum(s > t for t in self.thresholds)
        return [r.state["query_model"] for r in result.reqs]

    def routing_template(self):
        """Requests do not move after admission: P = I, mixed at rate 1/mean_len (a request ends and
        its replacement is split at admission) with the split; the admission move commits nothing."""
        M = self.M
        s = np.full(M, 1.0 / M) if self.split is None else np.asarray(self.split, float) / sum(self.split)
        r = 1.0 / self.mean_len
        P = (1 - r) * np.eye(M) + r * np.tile(s, (M, 1))
        C = np.ones((M, M))
        C[0, 1:] = 0.0
        return P, C
