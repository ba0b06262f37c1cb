"""Continuous batching for one model: admission under a token budget, chunked prefill,
preemption (recompute) when KV runs out, and a parked state for requests that wait on
something outside the engine (the router parks a request while a peer model serves it)."""
from __future__ import annotations

import itertools
from collections import deque

from engines.block_manager import BlockManager
from engines.config import EngineConfig
from engines.runner import ScheduledSeq
from engines.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, ecfg: EngineConfig, block_manager: BlockManager):
        self.ecfg = ecfg
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self._ids = itertools.count()  # sequence ids, per engine: several engines share a process
        # live sequences that asked for log probabilities: while there are none, a step computes
        # none and looks at no row for them (engines/logprobs.py)
        self.num_logprobs = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.parked)

    @property
    def num_ready(self) -> int:
        """Sequences a step could compute now."""
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if seq.seq_id < 0:  # new here (a resumed sequence whose KV was dropped comes back through add)
            seq.seq_id = next(self._ids)
            self.num_logprobs += seq.sampling.logprobs is not None
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.ecfg.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n == 0:
                i += 1
                continue
            while not self.bm.reserve(seq, n):
                if not self._preempt_one(keep=seq):
                    break
            else:
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            self._preempt(seq)  # nothing left to take pages from: retry this one later
        while self.waiting and budget > 0 and len(self.running) < self.ecfg.max_num_seqs:
            seq = self.waiting[0]
            self.bm.admit(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.bm.reserve(seq, n):
                self.bm.free(seq)
                # Nothing runs and parked sequences hold the pool: drop their KV (they
                # recompute on resume, mostly from the prefix cache) rather than stall forever.
                if not batch and not self.running and self._preempt_one(keep=seq):
                    continue
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _preempt_one(self, keep: Sequence) -> bool:
        """Free the newest running sequence other than `keep` (it is not yet in this batch,
        since running is scheduled oldest first), else a parked one."""
        if self.running and self.running[-1] is not keep:
            self._preempt(self.running[-1])
            return True
        for seq in self.parked.values():
            if seq.block_table:
                self.bm.free(seq)  # it recomputes its KV (mostly prefix-cache hits) when resumed
                self.num_preemptions += 1
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def commit(self, batch: list[ScheduledSeq]) -> None:
        """The batch's K/V were written."""
        for seq, n in batch:
            self.bm.commit_computed(seq, n)

    def park(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = SeqStatus.PENDING
        self.parked[seq.seq_id] = seq

    def resume(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Back from a peer: append what it produced; the next step extends over those tokens
        with the pages it already holds (no prefix matching, no new admission)."""
        del self.parked[seq.seq_id]
        seq.token_ids.extend(new_tokens)
        if seq.block_table or seq.num_computed_tokens:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:  # its KV was dropped under memory pressure while parked
            self.add(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a live sequence back to its first `num_tokens` tokens (BlockManager.truncate), between
        steps; it stays where it is (parked, waiting or running)."""
        if seq.status is SeqStatus.FINISHED:
            raise ValueError(f"sequence {seq.seq_id} is finished ({seq.finish_reason}): nothing to truncate")
        if num_tokens < seq.num_prompt_tokens:
            raise ValueError(f"truncate to {num_tokens} tokens would cut into the prompt ({seq.num_prompt_tokens} tokens)")
        self.bm.truncate(seq, num_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.PENDING:
            del self.parked[seq.seq_id]
        self.bm.free(seq)
        self.num_logprobs -= seq.sampling.logprobs is not None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
