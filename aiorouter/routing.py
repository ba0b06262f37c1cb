"""What the policy decides for one model's step: each request of the batch stays (its token is the
engine's to commit) or is handed off to a peer with the policy's `PeerReq`; and, on the peer, the
handoff taken in (`receive`). The handoff's bookkeeping (what each model has seen, parking, the
post to the peer's inbox) is here too. A policy that raises fails the request it raised for, never
the model: route is asked again per request, send and receive fail their request alone."""
from __future__ import annotations

from collections import abc
from typing import Callable

import torch

from aiorouter.launch import LaunchControl
from aiorouter.request import Handoff, RouterError, RouterRequest
from aiorouter.requests import RequestTable
from engines import Engine, Sequence
from engines.engine import Decided
from engines.logprobs import TokenLogprob
from engines.runner import ForwardOutput
from engines.worker import Worker
from policies.base import STAY, PeerReq, Policy, ReqView, StepResult

RouteObserver = Callable[[int, int, int, int], None]  # (from model, to model, tokens committed, decisions)


class Views(abc.Sequence):
    """A step's `StepResult.reqs`, each view built the first time it is read. R-Stitch, R2R, CITER
    and Co-LLM route on the logits and hidden states alone, and a view cost ~1.5 us a row (a
    third of routing's time at N = 64 on zero-latency sims, bench.host_cost --profile)."""

    __slots__ = ("_make", "_reqs", "_sampled", "_built")

    def __init__(self, make: Callable[[RouterRequest, int], ReqView], reqs: list[RouterRequest], sampled: list[int]):
        self._make, self._reqs, self._sampled = make, reqs, sampled
        self._built: list[ReqView | None] = [None] * len(reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self._built[i]
        if view is None:
            view = self._built[i] = self._make(self._reqs[i], self._sampled[i])
        return view


class Routing:
    def __init__(self, index: int, name: str, engine: Engine, launch: LaunchControl, requests: RequestTable,
                 vocab_size: int, worker: Worker, observe: RouteObserver | None = None):
        """`vocab_size`: the output rows that are tokens (rows past it are the policy's, never
        sampled); `worker`: the model's worker thread (where a policy's heavy route runs)."""
        self.index, self.name, self.engine, self.launch, self.requests = index, name, engine, launch, requests
        self.vocab_size, self.worker, self.observe = vocab_size, worker, observe

    # -- a step's batch --------------------------------------------------------------------------
    async def route(self, out: ForwardOutput, rows: list[int]) -> Decided:
        """The policy decides for each of `rows` (requests with a per-request policy are routed
        apart) -> the (sequence, token)s that stay here, for the engine to commit in one call, and
        the sequences handed off, for it to park."""
        groups: dict[int, tuple[Policy, list[int]]] = {}  # per policy (a request may bring its own)
        for row in rows:
            req = out.seqs[row].user_data
            if not req.finished:
                groups.setdefault(id(req.policy), (req.policy, []))[1].append(row)
        stays: list[tuple[Sequence, int]] = []
        sends: dict[int, list[tuple[RouterRequest, PeerReq]]] = {}  # per peer: what this step hands it
        i, lps = self.index, out.logprobs
        for policy, group in groups.values():
            peers = policy.peers(i)
            for req, d, row, views, k in await self._decide(policy, out, group):
                if d == STAY:
                    if not req.finished:  # (it may have ended while an isolating re-route ran: a client gone)
                        stays.append((req.local[i], out.next_tokens[row]))
                elif not req.finished:
                    self._hand_off(policy, peers, req, d, views[k], sends, lps[row] if lps is not None else None)
        for target, reqs in sends.items():
            self.launch.post(target, Handoff(tuple(reqs), self.index))
        return Decided(stays, [req.local[self.index] for reqs in sends.values() for req, _ in reqs])

    async def _decide(self, policy: Policy, out: ForwardOutput, rows: list[int]
                      ) -> list[tuple[RouterRequest, int, int, Views, int]]:
        """`policy.route` for these rows -> (request, destination, row, the views route saw, the
        row's index in them) each. When route raises for the batch, it is asked again for each request
        alone, so the request that makes it raise fails alone and the others go on (route sees
        each of them once more)."""
        reqs: list[RouterRequest] = [out.seqs[r].user_data for r in rows]
        logits, hidden, tokens = self._rows(out, rows)
        V = self.vocab_size  # rows past V: reserved for the policy (a view, no copy)
        views = Views(self._view, reqs, [out.next_tokens[r] for r in rows])
        # (no slice when there are no reserved rows: a torch call on the loop thread is a point where
        # a worker takes the GIL, and the loop then waits to get it back)
        reserved = logits.shape[-1] > V
        result = StepResult(self.index, logits[:, :V] if reserved else logits, tokens, hidden, views,
                            logits[:, V:] if reserved else None)
        try:
            dests = await self.worker.call(policy.route, result) if policy.route_in_worker else policy.route(result)
            dests = [int(d) for d in (dests.tolist() if hasattr(dests, "tolist") else dests)]
            if len(dests) != len(rows):
                raise RouterError(f"policy {policy.name!r}.route returned {len(dests)} destinations "
                                  f"for a batch of {len(rows)}")
        except Exception as e:
            if len(rows) > 1:
                return [x for r in rows if not out.seqs[r].user_data.finished
                        for x in await self._decide(policy, out, [r])]
            self.requests.fail(reqs[0], e if isinstance(e, RouterError) else
                               RouterError(f"policy {policy.name!r} raised in route on model {self.name!r}: {e!r}"))
            return []
        return [(q, d, r, views, k) for k, (q, d, r) in enumerate(zip(reqs, dests, rows))]

    @staticmethod
    def _rows(out: ForwardOutput, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The step's logits [len(rows), V], hidden states and sampled tokens [len(rows)] for `rows`:
        the output itself when they are the whole batch, else `index_select`. Not `logits[idx]`: advanced indexing opens a parallel
        region even for a few rows, on the event loop thread's default OpenMP team (every core), and
        waits at its barrier for a core another model's worker holds. On the shared 2-core machine
        that was 20 ms median for a [16, 512] gather, against 3 us for `index_select`; at N = 16 on
        the sim pair it took 70% of the event loop's time."""
        sampled = out.sampled if out.sampled is not None else torch.tensor(out.next_tokens, dtype=torch.long)
        if len(rows) == out.logits.shape[0]:  # rows are in batch order: all of them means the batch
            return out.logits, out.hidden, sampled
        idx = torch.tensor(rows)
        return (out.logits.index_select(0, idx), out.hidden.index_select(0, idx) if out.hidden is not None else None,
                sampled.index_select(0, idx))

    def _view(self, req: RouterRequest, sampled: int | None = None, peer: int | None = None) -> ReqView:
        # `seen` is copied (a few ints, and it changes under a handoff the policy may be reading);
        # token_ids and the trace are the request's own lists: a copy per row was O(length)
        return ReqView(req.rid, self.index, req.token_ids, req.num_prompt_tokens, sampled, tuple(req.seen),
                       req.trace, req.state[self.index], peer)

    # -- handoffs --------------------------------------------------------------------------------
    def _hand_off(self, policy: Policy, peers: list[int], req: RouterRequest, dest: int, view: ReqView,
                  sends: dict[int, list[tuple[RouterRequest, PeerReq]]], logprob: TokenLogprob | None = None) -> None:
        """The policy's send for a request routed to `peers[dest - 1]`: into `sends` when it leaves
        (it may end instead, or fail). `logprob`: the sampled token's, when the request asked."""
        try:
            if not 1 <= dest <= len(peers):
                raise RouterError(f"policy {policy.name!r} routed to peer {dest} from model {self.name!r}, "
                                  f"which has {len(peers)} peers")
            target = peers[dest - 1]
            pr = policy.send(view._replace(peer=target))
            new = self._check_send(policy, req, pr, target)
            if logprob is not None and new and new != [view.sampled]:
                raise RouterError(f"policy {policy.name!r}.send commits tokens model {self.name!r} did not sample "
                                  f"({new}, sampled {view.sampled}): their log probabilities, which this request "
                                  "asked for, are unknown")
        except Exception as e:
            self.requests.fail(req, e if isinstance(e, RouterError) else
                               RouterError(f"policy {policy.name!r} raised in send on model {self.name!r}: {e!r}"))
            return
        if self.observe is not None:
            self.observe(self.index, target, len(new), 1)
        if new:
            self.requests.commit(req, new, self.index, logprob)
        if pr.finished:
            self.requests.finish(req)
        if not req.finished:
            self.requests.count_handoff(self.index, target)
            sends.setdefault(target, []).append((req, pr))

    @staticmethod
    def _check_send(policy: Policy, req: RouterRequest, pr: PeerReq, target: int) -> list[int]:
        """-> the tokens the send commits. A PeerReq carries the whole suffix the peer has not seen."""
        unseen = req.token_ids[req.seen[target]:]
        if pr.rid != req.rid or pr.loc != len(req.token_ids) or pr.tokens[:len(unseen)] != unseen:
            raise RouterError(f"policy {policy.name!r}.send: a PeerReq must carry request {req.rid}, loc "
                              f"{len(req.token_ids)} (the decoding position) and the {len(unseen)} tokens the peer "
                              f"has not seen from position {req.seen[target]}; got loc {pr.loc}, {len(pr.tokens)} tokens")
        return pr.tokens[len(unseen):]

    def receive(self, req: RouterRequest, pr: PeerReq) -> None:
        """A request a peer handed here: the policy's receive says which tokens this model takes,
        then it arrives."""
        if req.finished:
            return
        try:
            tokens = list(req.policy.receive(pr, self._view(req)))
            seen = req.seen[self.index]
            if tokens != req.token_ids[seen:seen + len(tokens)]:
                raise RouterError(f"policy {req.policy.name!r}.receive on {self.name!r} returned tokens that are not "
                                  f"the request's committed tokens from position {seen}")
        except Exception as e:  # a policy bug fails this request only
            self.requests.fail(req, e if isinstance(e, RouterError) else
                               RouterError(f"policy {req.policy.name!r} raised in receive on model {self.name!r}: {e!r}"))
            return
        self.arrive(req, tokens)

    def arrive(self, req: RouterRequest, tokens: list[int]) -> None:
        """The request is now this model's: its engine takes what it has not seen and makes it ready."""
        if req.finished:
            return
        req.at = self.index
        seq = req.local[self.index]
        if seq is None:  # first visit: prefix matching and admission
            seq = req.local[self.index] = self.engine.add(tokens, req.sampling, req.num_prompt_tokens, user_data=req,
                                                          output=req.out, want_hidden=req.policy.needs_hidden)
        else:  # handoff-resume: KV kept, just extend
            self.engine.resume(seq, tokens)
        req.seen[self.index] = len(seq.token_ids)

