"""Prompt scoring through the router (`Router.score`; OpenAI completions' `echo` with `logprobs`).

A routed system's log probability of a given text is defined teacher-forced: each position is
scored by the model the policy routes that position to, the policy seeing each model's output at
that position exactly as it would while generating, with the text's token forced where generation
would have sampled. With `single` it is the entry model's.

What "the prompt" is, for a policy: the text's first token. Position 0 has no logits, so it is
scored by no model (None, as OpenAI and vLLM answer); `admit` sees that one token (its text, the
entry model's decoding of it), and every later position is a routed one: the request's
`num_prompt_tokens` is 1 and positions 1..L-1 are its output as the policy sees them. So a policy
that keys on the prompt (`query`'s scorer, `random` with `key="prompt"`) keys on the first token,
not on a context an evaluation harness meant as the prompt: the text is scored as one response.

How: each model the replay reaches prefills the whole text once (engines/scoring.py: every
position's logits in one chunked prefill, nothing sampled, its KV pages given back at once), the
log probabilities of every position computed there in one batched log_softmax; then the policy's
decisions are replayed over the positions, driving `admit`, `route`, `send` and `receive` through
the calls generation makes, in its order, with its views (a batch of one request; the step's
logits and hidden rows are that model's rows at the position; `seen`, the trace and the per-model
state as generation keeps them). A model the replay never reaches prefills nothing.

What cannot be scored so, and is a RouterError naming the policy: a send that commits tokens its
model did not sample (their log probabilities are unknown), a receive that takes fewer than the
tokens its model has not seen (its position would lag the text), a policy that ends the request
before the text does, and one that moves between models without committing (past a bound)."""
from __future__ import annotations

import asyncio
import uuid
from typing import NamedTuple, Sequence

import torch

from aiorouter.request import RouterError, RouterUnavailable
from engines import Engine
from engines.logprobs import TokenLogprob
from engines.scoring import PromptScores
from engines.worker import Worker
from policies.base import STAY, Policy, ReqView, StepResult

NO_LOGITS = torch.empty(1, 0)  # [1, 0]: the policy declared it reads none, so none were kept
PROMPT_TOKENS = 1  # the policy's prompt: the first token (see the module's docstring)


class ScoreResult(NamedTuple):
    """A text's routed log probabilities: per token of the text, its value under the model that
    scored it (None for the first token, which no model predicts) and that model's name."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    models: list[str | None]

    @property
    def total(self) -> float:
        """The text's log probability past its first token: the sum over the scored positions."""
        return sum(lp.logprob for lp in self.logprobs if lp is not None)


class ScoredModel(NamedTuple):
    """One model as scoring uses it: its engine, its worker thread, its reserved output rows."""

    name: str
    engine: Engine
    worker: Worker
    reserved_rows: int


async def prefill(model: ScoredModel, ids: list[int], k: int, want_logits: bool, want_hidden: bool) -> PromptScores:
    """`ids` scored by one model: its pages taken on the loop, the prefill in its worker (between
    its steps), the pages back on the loop once the prefill is over, even when the caller is
    cancelled meanwhile (a page freed under a running prefill could be written into another's)."""
    eng = model.engine
    try:
        seq = eng.score_begin(ids, model.reserved_rows)
    except ValueError as e:  # the text was checked against every model: its pool is full now
        raise RouterUnavailable(f"model {model.name!r} cannot score this text now: {e}") from None
    run = asyncio.ensure_future(model.worker.call(eng.score_run, seq, k, want_logits, want_hidden,
                                                  model.reserved_rows))
    def give_back(_: object = None) -> None:  # (after a restart meanwhile, score_end gives nothing back)
        eng.score_end(seq)

    try:
        return await asyncio.shield(run)
    finally:
        if run.done():
            give_back()
        else:
            run.add_done_callback(give_back)


async def score(models: Sequence[ScoredModel], policy: Policy, entry: int, ids: list[int], k: int,
                first_text: str | None) -> ScoreResult:
    """The replay (see the module's docstring). `first_text`: the first token as text, for admit."""
    L, M, P = len(ids), len(models), PROMPT_TOKENS
    rid = uuid.uuid4().hex
    scores: dict[int, PromptScores] = {}
    vocab = [m.engine.model_config.vocab_size - m.reserved_rows for m in models]

    async def scores_of(i: int) -> PromptScores:  # each model prefills once, when the replay first reaches it
        if i not in scores:
            scores[i] = await prefill(models[i], ids, k, policy.reads_logits, policy.needs_hidden)
        return scores[i]

    start = policy.admit(rid, ids[:P], first_text) if policy.admits else None
    cur = entry if start is None else int(start)
    if not 0 <= cur < M:
        raise RouterError(f"policy {policy.name!r}.admit chose model {cur}; the router has {M} models")
    committed, trace = ids[:P], []
    seen, state = [0] * M, [{} for _ in range(M)]
    seen[cur] = P
    writer: list[int | None] = [None] * L
    moves = 0  # moves that commit nothing: a policy that bounces forever is stopped
    while len(committed) < L:
        p, s = len(committed), await scores_of(cur)
        sampled = ids[p]
        view = ReqView(rid, cur, committed, P, sampled, tuple(seen), trace, state[cur])
        logits = s.logits[p - 1:p] if s.logits is not None else NO_LOGITS
        V = vocab[cur]
        result = StepResult(cur, logits[:, :V], torch.tensor([sampled]),
                            s.hidden[p - 1:p] if s.hidden is not None else None, [view],
                            logits[:, V:] if logits.shape[-1] > V else None)
        dests = (await models[cur].worker.call(policy.route, result) if policy.route_in_worker
                 else policy.route(result))
        d = int((dests.tolist() if hasattr(dests, "tolist") else list(dests))[0])
        if d == STAY:
            committed.append(sampled)
            trace.append(cur)
            writer[p] = cur
            seen[cur], moves = len(committed), 0
            continue
        peers = policy.peers(cur)
        if not 1 <= d <= len(peers):
            raise RouterError(f"policy {policy.name!r} routed to peer {d} from model {models[cur].name!r}, "
                              f"which has {len(peers)} peers")
        target = peers[d - 1]
        pr = policy.send(view._replace(peer=target))
        unseen = committed[seen[target]:]
        if pr.rid != rid or pr.loc != p or pr.tokens[:len(unseen)] != unseen:
            raise RouterError(f"policy {policy.name!r}.send: a PeerReq must carry request {rid}, loc {p} and the "
                              f"{len(unseen)} tokens model {models[target].name!r} has not seen")
        new = pr.tokens[len(unseen):]
        if new and new != [sampled]:
            raise RouterError(f"policy {policy.name!r}.send commits tokens model {models[cur].name!r} did not "
                              f"sample ({new}, the text has {sampled}): they cannot be scored")
        if new:
            committed.append(sampled)
            trace.append(cur)
            writer[p] = cur
            moves = 0
        elif (moves := moves + 1) > 2 * M:
            raise RouterError(f"policy {policy.name!r} moved position {p} between models {moves} times without "
                              "committing its token: it cannot be scored")
        if pr.finished and len(committed) < L:
            raise RouterError(f"policy {policy.name!r} ended the request at position {len(committed)} of {L}: "
                              "the rest of the text cannot be scored")
        if len(committed) == L:
            break
        got = list(policy.receive(pr, ReqView(rid, target, committed, P, None, tuple(seen), trace, state[target])))
        if got != committed[seen[target]:]:
            raise RouterError(f"policy {policy.name!r}.receive on {models[target].name!r} took {len(got)} tokens, "
                              f"not the {len(committed) - seen[target]} it has not seen: teacher-forced scoring "
                              "needs each model at the text's position")
        seen[target], cur = len(committed), target
    return ScoreResult(list(ids), _values(scores, writer, k), [models[w].name if w is not None else None for w in writer])


def _values(scores: dict[int, PromptScores], writer: list[int | None], k: int) -> list[TokenLogprob | None]:
    """Per position, the value its writer's prefill computed: each model's rows read once."""
    rows = {i: s.entries(k) for i, s in scores.items() if any(w == i for w in writer)}
    return [None if w is None else rows[w][p - 1] for p, w in enumerate(writer)]
