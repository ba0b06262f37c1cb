"""One request as the engine sees it: tokens, KV pages and progress."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engines.logprobs import TokenLogprob
from engines.output import OutputStream
from engines.sampling import SamplingParams

class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted: no KV pages yet
    RUNNING = "running"  # schedulable
    PENDING = "pending"  # parked: skipped by the scheduler, KV and state kept (handoff-resume)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    sampling: SamplingParams
    seq_id: int = -1  # numbered by the engine's scheduler when added (ids are per engine)
    status: SeqStatus = SeqStatus.WAITING
    num_prompt_tokens: int = 0
    # Tokens whose K/V are written in this engine's pool. The next forward computes
    # token_ids[num_computed_tokens:], which covers prefill, chunked prefill, decode and the
    # extend of a request resumed after a handoff with one rule.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at admission (tokens not computed)
    block_table: list[int] = field(default_factory=list)
    num_registered_pages: int = 0  # leading full pages already offered to the prefix cache
    last_page_key: object = None  # prefix-cache key of the last registered page (chain parent)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    user_data: object = None  # owner's handle (the runtime keeps its request here)
    # where its committed tokens go (stop checks, text): the engine's own stream for a request of
    # `add_request`, whose token list is this sequence's; a router's request stream otherwise
    output: OutputStream | None = None
    t_ready: float | None = None  # when it last became ready to compute (admission-delay metric)
    want_hidden: bool = False  # its steps return hidden states (its owner's policy reads them)
    # the engine alone (`Engine.add_request`): per committed output token its log probability, when
    # its request asked; a router streams them with its tokens instead
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end this response: its output stream's (a router's request ends on its entry
        model's EOS, whichever model samples); none without a stream (such a sequence never commits)."""
        return self.output.eos_ids if self.output is not None else ()

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
