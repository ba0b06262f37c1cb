"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, min-p, seeds)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch

from engines.devices import host_tensor
from engines.grammar import StructuredOutput, apply_grammar
from engines.logprobs import check_logprobs

# Seeds as vLLM's OpenAI server takes them: a signed 64-bit integer (torch.long). A seed past it
# would overflow the generator's seeding inside a model step, so it is refused up front.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
# Below this temperature a request decodes greedily, as vLLM's (its _SAMPLING_EPS): logits / T in
# float32 overflow to inf for a T near zero (a denormal like 5e-324 is 0 in float32), and softmax
# of an inf row is NaN. The most probable token is what such a temperature asks for anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # the stop tokens (EOS, stop_token_ids) cannot be drawn before this many
    # vLLM's penalties: repetition over the prompt's and the response's tokens, presence and
    # frequency over the response's, whichever model wrote them (`apply_controls`)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias added to its logit (OpenAI's logit_bias); kept as sorted (id, bias) pairs,
    # so the parameters stay hashable
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()
    skip_special_tokens: bool = True  # the text leaves special tokens out
    include_stop_str_in_output: bool = False  # the text keeps the stop string, or the stop token's text
    # any control above that changes the logits: set from them, so the sampler checks one flag per row
    adjusts_logits: bool = field(init=False, repr=False, compare=False, default=False)
    # per generated token: its log probability and this many alternatives (engines/logprobs.py); None: off
    logprobs: int | None = None
    # the response follows this JSON schema, regex, choice or grammar (engines/grammar.py); the
    # request's output stream holds its matcher, whichever model samples applies its mask
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        check_logprobs(self.logprobs)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be an engines.grammar.StructuredOutput, got {type(self.structured).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self._check_controls()

    def _check_controls(self) -> None:
        """The controls' ranges are vLLM's and OpenAI's (a penalty past them is a client's mistake,
        not a stronger penalty); token ids are checked against a model's vocabulary where one is
        known (`Engine.validate_sampling`)."""
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)!r}")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, Mapping) else tuple(tuple(b) for b in (bias or ()))
        for t, b in pairs:
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not (_is_number(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id more than once")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        object.__setattr__(self, "adjusts_logits", self.penalized or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] bool on logits' device, with no host sync: the rows holding a NaN or
    an infinity. A model's raw logits are finite, so such a row means that sequence's forward
    broke (an overflow, a bad KV page).

    A row's sum is finite exactly when all of it is (NaN propagates, an infinity stays one, and
    +inf with -inf makes NaN), short of finite entries that add up past the dtype's range (fp32:
    |x| ~ 1e34 over 49152 entries, which no softmax input reaches; such a row is broken too). One
    reduction: 0.13 against 0.27 ms for amax and amin of [16, 49152] on one CPU thread, and 1.9
    for the element-wise check."""
    return ~torch.isfinite(logits.sum(dim=-1))


def nonfinite_host_rows(logits: torch.Tensor) -> tuple[int, ...]:
    """`nonfinite_rows` for logits on the host, as row indices: the same sum, read into Python.
    A CPU step pays it on every model: 2.5 us for [2, 4096] against 15 for the tensor form (and
    the `any`, `nonzero` and `tolist` that followed it), cProfile and timeit on one thread."""
    return tuple(i for i, s in enumerate(logits.sum(dim=-1).tolist()) if not math.isfinite(s))


def _finite(logits: torch.Tensor, bad: tuple[int, ...] | None = None) -> torch.Tensor:
    """logits [B, V] with every non-finite row set to zeros. Left as they are, one NaN row makes
    `multinomial` raise (failing the whole batch) and argmax return an arbitrary id; a zero row
    draws an id inside the vocabulary, a placeholder the caller discards (the runner reports the
    rows, `ForwardOutput.bad_rows`, and the sequence fails alone). `bad`: those rows
    (`nonfinite_host_rows`), where the caller has them already; on a GPU, pass None: the mask is
    applied without reading anything back."""
    if bad is None and logits.device.type != "cpu":
        return logits.masked_fill(nonfinite_rows(logits)[:, None], 0.0)
    bad = nonfinite_host_rows(logits) if bad is None else bad
    if not bad:  # the usual case
        return logits
    out = logits.clone()
    out[list(bad)] = 0.0
    return out


class Written(Protocol):
    """What the controls read of a row's sequence (engines.sequence.Sequence): every token so far,
    the prompt's and the response's, whichever model wrote them (a sequence handed back to a model
    holds the tokens its peers wrote: `Engine.resume`), and the ids that end the response."""

    token_ids: list[int]
    num_prompt_tokens: int
    eos_ids: tuple[int, ...]


def apply_controls(logits: torch.Tensor, params: list[SamplingParams], seqs: Sequence[Written] | None) -> torch.Tensor:
    """logits [B, V] -> the same with each row's controls applied, in vLLM's order: logit_bias,
    then min_tokens (the stop tokens at -inf while the response is shorter), then the penalties
    (repetition: a seen token's logit divided by the penalty when positive, multiplied when not, as
    transformers' RepetitionPenaltyLogitsProcessor; then minus frequency x its count in the
    response and presence x whether it is there). Out of place, so the step's raw logits stay what
    the policies and log probabilities read; the input itself when no row asks (no copy, no op).

    Batched over the rows that ask, with no host sync: one flat tensor of their tokens goes up and
    one `index_put_` counts them into [R, V]. The tokens are read from each asking sequence (its
    prompt only when it asks for a repetition penalty), the one per-row host work, which a token
    list on the device would need too."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if seqs is None:
        raise ValueError("sampling controls (penalties, logit_bias, min_tokens) need the rows' sequences")
    # min_tokens alone adjusts nothing once the response is long enough
    rows = [i for i in rows if params[i].penalized or params[i].logit_bias
            or len(seqs[i].token_ids) - seqs[i].num_prompt_tokens < params[i].min_tokens]
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[-1]
    idx = host_tensor(rows, torch.int64, dev)
    x = logits.index_select(0, idx).float()  # [R, V], a copy
    at: list[int] = []
    ids: list[int] = []
    vals: list[float] = []
    for r, i in enumerate(rows):
        for t, b in params[i].logit_bias:
            at.append(r)
            ids.append(t)
            vals.append(b)
    if ids:
        x.index_put_((host_tensor(at, torch.int64, dev), host_tensor(ids, torch.int64, dev)),
                     host_tensor(vals, torch.float32, dev), accumulate=True)
    at, ids = [], []
    for r, i in enumerate(rows):
        p, s = params[i], seqs[i]
        if len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
            stops = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + s.eos_ids
            at += [r] * len(stops)
            ids += stops
    if ids:
        x.index_put_((host_tensor(at, torch.int64, dev), host_tensor(ids, torch.int64, dev)),
                     x.new_full((), float("-inf")))
    if any(params[i].penalized for i in rows):
        x = _penalize(x, [params[i] for i in rows], [seqs[i] for i in rows])
        # a tiny repetition_penalty (5e-324 is > 0, as the field asks) divides a logit past the
        # float range: +inf would make softmax NaN and fail the step, the largest float keeps the order
        big = torch.finfo(x.dtype).max
        x = x.clamp(min=-big, max=big).masked_fill(x == float("-inf"), float("-inf"))
    return logits.index_copy(0, idx, x.to(logits.dtype))


def _penalize(x: torch.Tensor, ps: list[SamplingParams], seqs: list[Written]) -> torch.Tensor:
    """x [R, V] -> with each row's penalties (neutral for a row that asks for none)."""
    dev, (R, V) = x.device, x.shape
    toks: list[int] = []
    lens: list[int] = []
    prompt: list[int] = []  # per row: how many of its tokens sent are the prompt's
    for p, s in zip(ps, seqs):
        if not p.penalized:
            lens.append(0)
            prompt.append(0)
            continue
        first = 0 if p.repetition_penalty != 1.0 else s.num_prompt_tokens
        part = s.token_ids[first:]
        toks += part
        lens.append(len(part))
        prompt.append(s.num_prompt_tokens - first)
    n = len(toks)
    counts = torch.zeros(R, V, device=dev)
    seen = torch.zeros(R, V, dtype=torch.bool, device=dev)
    if n:
        lens_t = host_tensor(lens, torch.int64, dev)
        row = torch.repeat_interleave(torch.arange(R, device=dev), lens_t, output_size=n)
        starts = torch.cumsum(lens_t, 0) - lens_t
        pos = torch.arange(n, device=dev) - torch.repeat_interleave(starts, lens_t, output_size=n)
        output = pos >= torch.repeat_interleave(host_tensor(prompt, torch.int64, dev), lens_t, output_size=n)
        tok = host_tensor(toks, torch.int64, dev)
        counts.index_put_((row, tok), output.float(), accumulate=True)
        seen.index_put_((row, tok), torch.ones((), dtype=torch.bool, device=dev))
    rep = host_tensor([p.repetition_penalty for p in ps], torch.float32, dev)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = host_tensor([p.frequency_penalty for p in ps], torch.float32, dev)[:, None]
    pres = host_tensor([p.presence_penalty for p in ps], torch.float32, dev)[:, None]
    return x - freq * counts - pres * (counts > 0)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           bad: tuple[int, ...] | None = None, seqs: Sequence[Written] | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] (int64), each in [0, V).

    Greedy rows take argmax (ties go to the lowest id, as HF does). Other rows are filtered
    (top-k, top-p, min-p) on the temperature-scaled distribution and drawn with the
    request's own generator when it has a seed, so a seeded request samples the same
    tokens whatever batch it lands in. A row with NaN or inf draws a placeholder (`_finite`).
    `bad`: those rows (`nonfinite_host_rows`), where the caller has them (the runner reports them
    too: passed here, the step checks its logits once). `seqs`: the rows' sequences, which the
    sampling controls read (`apply_controls`; needed when a row asks for one); a greedy row with
    controls takes the argmax of its adjusted logits.
    """
    logits = apply_grammar(apply_controls(_finite(logits, bad), params, seqs), params, seqs)
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    x = logits[rows].float() / torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
    for r, i in enumerate(rows):
        p = params[i]
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            x[r] = _filter(x[r], p)
    probs = torch.softmax(x, dim=-1)
    for r, i in enumerate(rows):
        out[i] = torch.multinomial(probs[r], 1, generator=generators[i]).squeeze(0)
    return out


def _filter(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """x [V] scaled logits -> same with filtered entries at -inf."""
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True, stable=True)  # ties: lower id first, as argmax
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (cum - torch.softmax(sorted_x, -1)) >= p.top_p
        drop[0] = False  # a top_p below float32's least value (5e-324) compares as 0: keep the first anyway
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sample_batched(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                   seqs: Sequence[Written] | None = None) -> torch.Tensor:
    """`sample` for GPUs: logits [B, V] -> token ids [B] on logits' device, with no host sync
    (nothing reads a device value back; parameters go up in pinned, non-blocking copies).

    Same distribution as `sample` (same filters, in the same order), drawn as an exponential race:
    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i. A seeded request
    draws its E on the CPU from its own generator (its Sequence's CPU generator), so its tokens do
    not depend on the batch; the others use the device's generator. Ran on CPU in tests only.
    A row with NaN or inf draws a placeholder in [0, V) (`_finite`). `seqs`: as `sample`'s."""
    logits = apply_grammar(apply_controls(_finite(logits), params, seqs), params, seqs)
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev, V = logits.device, logits.shape[-1]
    ps = [params[i] for i in rows]
    idx = host_tensor(rows, torch.int64, dev)
    temp = host_tensor([p.temperature for p in ps], torch.float32, dev)
    x = _filter_batched(logits.index_select(0, idx).float() / temp[:, None], ps)
    probs = torch.softmax(x, dim=-1)
    race = torch.empty_like(probs).exponential_()  # [R, V]
    for r, i in enumerate(rows):
        if generators[i] is not None:
            e = torch.empty(V).exponential_(generator=generators[i])
            race[r] = e.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else e
    return out.index_copy(0, idx, torch.argmax(probs / race, dim=-1))


def _filter_batched(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """x [R, V] scaled logits -> `_filter` applied to each row, in batched ops. One sort serves
    top-k, min-p and top-p (each masks a tail of the descending order, so the order holds) and
    one scatter puts the row back: a [R, V] sort is the costliest op here (V = 151936 for Qwen3)."""
    dev, V = x.device, x.shape[-1]
    inf = float("-inf")
    top_k = any(p.top_k > 0 and p.top_k < V for p in ps)
    min_p = any(p.min_p > 0.0 for p in ps)
    top_p = any(p.top_p < 1.0 for p in ps)
    if not (top_k or top_p):  # min-p alone needs no order
        if min_p:
            mp = host_tensor([p.min_p for p in ps], torch.float32, dev)
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < mp[:, None] * probs.max(-1, keepdim=True).values, inf)
        return x
    sx, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [R, V] each; ties as in _filter
    if top_k:
        k = host_tensor([p.top_k if 0 < p.top_k < V else V for p in ps], torch.int64, dev)
        sx = sx.masked_fill(sx < sx.gather(1, (k - 1)[:, None]), inf)  # ties with the k-th stay, as in _filter
    if min_p:
        mp = host_tensor([p.min_p for p in ps], torch.float32, dev)
        probs = torch.softmax(sx, -1)
        sx = sx.masked_fill(probs < mp[:, None] * probs[:, :1], inf)  # column 0 holds the row's max
    if top_p:
        tp = host_tensor([p.top_p for p in ps], torch.float32, dev)
        sp = torch.softmax(sx, -1)
        drop = ((sp.cumsum(-1) - sp) >= tp[:, None]) & (tp < 1.0)[:, None]  # top_p 1: keep all
        drop[:, 0] = False  # the first stays, whatever a tiny top_p rounds to in float32 (see _filter)
        sx = sx.masked_fill(drop, inf)
    return x.scatter(1, order, sx)
