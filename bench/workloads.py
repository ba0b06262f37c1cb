"""CPU-sized versions of the paper's three workloads (section 5.1), as token-id prompts.

The paper uses AIME2024 prompts (~100 tokens) with 2,048 / 8,192 output tokens, and SWE-Smith
agent trajectories (~8,192 input tokens, 1,024 output). Here the prompts are token ids drawn
from a seeded RNG (so every system sees the same ones) and output lengths are fixed
(`ignore_eos`), scaled to what two CPU cores serve in minutes:

- ``low-effort``:  ~100-token prompts, 256 output tokens;
- ``high-effort``: ~100-token prompts, 1024 output tokens;
- ``agentic``:     ~2048-token multi-turn prompts, 128 output tokens. Several sessions share a
  system/tool preamble; each turn's prompt is the previous turn's prompt + answer-like tokens
  + new user tokens, so later turns hit the prefix cache of a system that has one. Prompts
  are ordered turn by turn (every session's turn 0, then every turn 1, ...), which is the
  order a closed loop of clients sends them in.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

VOCAB = 4096
FIRST_ID = 2  # keep clear of bos (0) and eos (1) of the cpu-tiny pair


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    description: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def mean_prompt_len(self) -> float:
        return sum(map(len, self.prompts)) / max(1, len(self.prompts))

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"max_tokens": self.max_tokens, "num_prompts": len(self.prompts), "prompt_len_mean": self.mean_prompt_len,
                "prompt_len_min": min(lens), "prompt_len_max": max(lens), "description": self.description, **self.meta}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def short_prompts(seed: int, count: int = 64, mean_len: int = 100, spread: int = 20, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [_ids(rng, rng.randrange(mean_len - spread, mean_len + spread + 1), vocab) for _ in range(count)]


def agentic_prompts(seed: int, sessions: int = 8, turns: int = 5, preamble: int = 512, first_turn: int = 1152,
                    answer: int = 128, user: int = 64, vocab: int = VOCAB) -> list[list[int]]:
    """`sessions` conversations of `turns` turns. All share a `preamble` (system prompt and tool
    descriptions); turn 0 adds `first_turn` session-specific tokens (task, repository context);
    each later turn appends `answer` answer-like tokens (the previous reply) and `user` new
    tokens (a tool result / user message). Defaults: turns of 1664, 1856, 2048, 2240, 2432
    tokens, mean 2048. Returned turn by turn."""
    rng = random.Random(seed)
    shared = _ids(rng, preamble, vocab)
    convs = [shared + _ids(rng, first_turn, vocab) for _ in range(sessions)]
    by_turn: list[list[list[int]]] = [[c[:] for c in convs]]
    for _ in range(1, turns):
        convs = [c + _ids(rng, answer, vocab) + _ids(rng, user, vocab) for c in convs]
        by_turn.append([c[:] for c in convs])
    return [p for turn in by_turn for p in turn]


WORKLOADS = ("low-effort", "high-effort", "agentic")


def make(name: str, quick: bool = False, seed: int = 0, vocab: int = VOCAB) -> Workload:
    """A workload by name; `quick` shrinks prompts and outputs so every system runs in seconds."""
    vocab = min(vocab, VOCAB)
    if name == "low-effort":
        if quick:
            return Workload(name, short_prompts(seed, 32, 32, 8, vocab), 16, "quick: ~32-token prompts, 16 output tokens")
        return Workload(name, short_prompts(seed, 64, 100, 20, vocab), 256, "~100-token prompts, 256 output tokens")
    if name == "high-effort":
        if quick:
            return Workload(name, short_prompts(seed + 1, 32, 32, 8, vocab), 32, "quick: ~32-token prompts, 32 output tokens")
        return Workload(name, short_prompts(seed + 1, 64, 100, 20, vocab), 1024, "~100-token prompts, 1024 output tokens")
    if name == "agentic":
        if quick:
            p = agentic_prompts(seed + 2, sessions=2, turns=2, preamble=64, first_turn=128, answer=16, user=16, vocab=vocab)
            return Workload(name, p, 8, "quick: ~200-token multi-turn prompts, 8 output tokens",
                            {"sessions": 2, "turns": 2})
        p = agentic_prompts(seed + 2, vocab=vocab)
        return Workload(name, p, 128, "~2048-token multi-turn prompts sharing prefixes (8 sessions x 5 turns, "
                        "512-token shared preamble), 128 output tokens", {"sessions": 8, "turns": 5})
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def warmup_prompt(length: int = 48, vocab: int = VOCAB) -> list[int]:
    """A prompt that shares no page with any workload prompt (warming a system up must not
    warm its prefix cache for the measured requests)."""
    return warmup_prompts(1, length, vocab)[0]


def warmup_prompts(count: int, length: int = 48, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(10_000_019)
    return [_ids(rng, length, min(vocab, VOCAB)) for _ in range(count)]
