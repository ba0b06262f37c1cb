"""The hand-written baseline aiorouter is measured against, built as well as its design allows.
(The paper's Std. Serving, one single-model server per model and a per-token dispatcher, is in
bench/std_serving.py, and over HTTP in bench/token_server.py.)

* `HFNaive` -- what a researcher writes by hand (how the official R2R and CITER code works): two
  `transformers` models, one static batch of N requests, left-padded, decoded in lock-step with
  a `DynamicCache` per model; no continuous batching. Each step the small model decodes for the
  whole batch, routing is drawn per request, and the large model runs only when some request
  needs it, catching up over the tokens it missed in one multi-token forward for the batch.

It routes with the same rules as the runtime's policies (`RandomRule` = `policies.random`,
`RStitchRule` = `policies.rstitch`), with the same R2R token semantics: when the small model
hands a position to the large model, its own token is discarded and the large model generates
that position.
"""
from __future__ import annotations

import itertools
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from policies.rstitch import normalized_entropy

SMALL, LARGE = 0, 1
NAMES = ("small", "large")


# -- routing rules (the policies' decisions, outside the runtime) ---------------------------------
class RandomRule:
    """`policies.random`: the small model hands a position to the large one with probability p
    (its token discarded); the large model commits its token and hands straight back.
    Seeded per request exactly like `RandomPolicy`."""

    name = "random"

    def __init__(self, p: float = 0.35, seed: int = 0):
        self.p, self.seed = float(p), int(seed)

    def describe(self) -> str:
        return f"random p={self.p}"

    def new_state(self, rid: str) -> dict:
        return {"rng": np.random.default_rng([self.seed, zlib.crc32(rid.encode())])}

    def small_hands_off(self, states: list[dict], logits: torch.Tensor | None) -> list[bool]:
        return [s["rng"].random() < self.p for s in states]

    def large_hands_back(self, states: list[dict], logits: torch.Tensor | None) -> list[bool]:
        return [True] * len(states)


class RStitchRule:
    """`policies.rstitch`: the small model hands off when its normalized entropy exceeds tau
    (token discarded); the large model keeps going while unsure and hands back on its first
    confident token, which it commits."""

    name = "rstitch"

    def __init__(self, tau: float = 0.03):
        self.tau = float(tau)

    def describe(self) -> str:
        return f"rstitch tau={self.tau}"

    def new_state(self, rid: str) -> dict:
        return {}

    def small_hands_off(self, states, logits):
        return (normalized_entropy(logits) > self.tau).tolist()

    def large_hands_back(self, states, logits):
        return (normalized_entropy(logits) <= self.tau).tolist()


def make_rule(policy: str, args: dict) -> RandomRule | RStitchRule:
    if policy == "random":
        return RandomRule(**args)
    if policy == "rstitch":
        return RStitchRule(**args)
    raise ValueError(f"the baselines implement the random and rstitch rules, not {policy!r}")


# -- HF naive ---------------------------------------------------------------------------------------
@dataclass
class BatchResult:
    t_first: float  # seconds from the batch's start to its first committed token
    seconds: float  # the whole batch
    traces: list[list[int]] = field(default_factory=list)  # per request: model of each output token
    tokens: list[list[int]] = field(default_factory=list)  # per request: output token ids
    large_forwards: int = 0
    small_forwards: int = 0
    small_tokens: int = 0  # token positions run through the small model (padding included)
    large_tokens: int = 0
    small_s: float = 0.0  # time in the small model's forwards (routing included)
    large_s: float = 0.0


class HFNaive:
    """Two `transformers` models decoding one static batch in lock-step (R2R/CITER official
    code style), routed per request; see the module docstring."""

    def __init__(self, small: str | Path, large: str | Path, rule, threads: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        self.rule, self.threads = rule, threads
        self.models = [AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in (small, large)]
        self._rids = itertools.count()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> BatchResult:
        from transformers import DynamicCache
        prev_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._generate(prompts, max_tokens, DynamicCache)
        finally:
            torch.set_num_threads(prev_threads)

    def _generate(self, prompts, max_tokens, DynamicCache) -> BatchResult:
        t0 = time.perf_counter()
        B, P = len(prompts), max(map(len, prompts))
        T = P + max_tokens
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.ones(B, T, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
            mask[i, :P - len(p)] = 0
        padded = any(len(p) != P for p in prompts)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        caches = [DynamicCache(config=m.config) for m in self.models]
        seen = [0, 0]
        res = BatchResult(0.0, 0.0, [[] for _ in range(B)])

        def forward(m: int, L: int) -> torch.Tensor:
            """Catch model m up over the columns it has not seen (all rows alike: lock-step)
            and return its next-token logits for every row, [B, V]."""
            s = seen[m]
            if m == SMALL:
                res.small_tokens += B * (L - s)
            else:
                res.large_tokens += B * (L - s)
            out = self.models[m](input_ids=ids[:, s:L], attention_mask=mask[:, :L] if padded else None,
                                 position_ids=pos[:, s:L], cache=caches[m], use_cache=True, logits_to_keep=1)
            seen[m] = L
            return out.logits[:, -1, :].float()

        states = [self.rule.new_state(f"hf-{next(self._rids)}") for _ in range(B)]
        on_large = [False] * B
        L = P
        for step in range(max_tokens):
            nxt = [0] * B
            go = on_large[:]
            small_rows = [i for i in range(B) if not on_large[i]]
            t_s = time.perf_counter()
            if small_rows:
                logits = forward(SMALL, L)
                res.small_forwards += 1
                toks = logits.argmax(-1).tolist()
                idx = torch.tensor(small_rows)
                hand = self.rule.small_hands_off([states[i] for i in small_rows], logits[idx])
                for i, h in zip(small_rows, hand):
                    if h:
                        go[i] = True  # discard small's token: the large model makes this position
                    else:
                        nxt[i] = toks[i]
                        res.traces[i].append(SMALL)
            t_l = time.perf_counter()
            res.small_s += t_l - t_s
            large_rows = [i for i in range(B) if go[i]]
            if large_rows:
                logits = forward(LARGE, L)
                res.large_forwards += 1
                toks = logits.argmax(-1).tolist()
                idx = torch.tensor(large_rows)
                back = self.rule.large_hands_back([states[i] for i in large_rows], logits[idx])
                for i, b in zip(large_rows, back):
                    nxt[i] = toks[i]
                    res.traces[i].append(LARGE)
                    on_large[i] = not b
            res.large_s += time.perf_counter() - t_l
            ids[:, L] = torch.tensor(nxt, dtype=torch.long)
            L += 1
            if step == 0:
                res.t_first = time.perf_counter() - t0
        res.seconds = time.perf_counter() - t0
        res.tokens = ids[:, P:].tolist()
        return res
