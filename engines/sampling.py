"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, min-p, seeds)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engines.devices import host_tensor

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
    min_tokens: int = 0

    def __post_init__(self) -> None:
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
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           bad: tuple[int, ...] | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] (int64), each in [0, V).

    Greedy rows take argmax (ties go to the lowest id, as HF does). Other rows are filtered
    (top-k, top-p, min-p) on the temperature-scaled distribution and drawn with the
    request's own generator when it has a seed, so a seeded request samples the same
    tokens whatever batch it lands in. A row with NaN or inf draws a placeholder (`_finite`).
    `bad`: those rows (`nonfinite_host_rows`), where the caller has them (the runner reports them
    too: passed here, the step checks its logits once).
    """
    logits = _finite(logits, bad)
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


def sample_batched(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> torch.Tensor:
    """`sample` for GPUs: logits [B, V] -> token ids [B] on logits' device, with no host sync
    (nothing reads a device value back; parameters go up in pinned, non-blocking copies).

    Same distribution as `sample` (same filters, in the same order), drawn as an exponential race:
    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i. A seeded request
    draws its E on the CPU from its own generator (its Sequence's CPU generator), so its tokens do
    not depend on the batch; the others use the device's generator. Ran on CPU in tests only.
    A row with NaN or inf draws a placeholder in [0, V) (`_finite`)."""
    logits = _finite(logits)
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
