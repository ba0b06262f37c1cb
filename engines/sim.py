"""`SimEngine`: the real engine's scheduler, KV accounting and step semantics, with the model
replaced by a sleep of L(b) = a + c*b seconds for a batch of b sequences and deterministic
tokens. The runtime and the throughput model are validated on it."""
from __future__ import annotations

import time

import torch

from engines.config import EngineConfig, ModelConfig
from engines.engine import Engine
from engines.logprobs import step_logprobs
from engines.runner import ForwardOutput, LayerHook, ScheduledSeq
from engines.sampling import sample
from engines.scoring import PromptScores, chunk_scores


class ByteTokenizer:
    """ids 0..255 are bytes; higher ids are specials that decode to nothing."""

    eos_token_id = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def sim_model_config(vocab_size: int = 512, max_len: int = 8192, eos: tuple[int, ...] = (256,)) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=max_len, tie_word_embeddings=True,
                       attention_bias=False, mlp_bias=False, qk_norm=False, eos_token_ids=eos, bos_token_id=None)


class SimRunner:
    def __init__(self, cfg: ModelConfig, latency_a: float, latency_c: float, token_seed: int):
        self.cfg, self.a, self.c, self.token_seed = cfg, latency_a, latency_c, token_seed

    def latency(self, batch_size: int) -> float:
        return self.a + self.c * batch_size

    def next_logits(self, seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [len(seqs), V], each row's top id [len(seqs)]): one row per sequence,
        deterministic in (its last token, its length): two engines with the same token_seed agree
        on every token, which identical-model equivalence tests rely on. The top logit's margin
        varies, so entropy-based policies see both confident and unsure steps. Built in one scatter:
        a zero-latency sim stands for a device whose step costs the host nothing, so its own
        per-row work must not be what host-cost benchmarks time (a tensor per row was ~5 us a row)."""
        h = [(s.token_ids[-1] * 1_000_003 + len(s.token_ids) * 7919 + self.token_seed * 104_729) % 2_147_483_647
             for s in seqs]
        top = torch.tensor([32 + x % 95 for x in h], dtype=torch.long)  # printable ASCII: readable, no EOS
        logits = torch.zeros(len(seqs), self.cfg.vocab_size)
        logits[torch.arange(len(seqs)), top] = torch.tensor([1.0 + (x >> 8) % 12 for x in h])
        return logits, top

    def score(self, seq, chunk: int, vocab: int, k: int, want_logits: bool, want_hidden: bool) -> PromptScores:
        """ModelRunner.score's contract: every position's logits as `next_logits` gives them for
        the prefix ending there (the same function of its last token and length), all at once."""
        ids = torch.tensor(seq.token_ids[:-1], dtype=torch.long)
        n = len(ids)
        h = (ids * 1_000_003 + torch.arange(1, n + 1) * 7919 + self.token_seed * 104_729) % 2_147_483_647
        logits = torch.zeros(n, self.cfg.vocab_size)
        logits[torch.arange(n), 32 + h % 95] = (1 + (h >> 8) % 12).float()
        token, top_ids, top = chunk_scores(logits, torch.tensor(seq.token_ids[1:], dtype=torch.long), vocab, k)
        seq.num_computed_tokens = n
        return PromptScores(token, top_ids, top, logits if want_logits else None,
                            torch.zeros(n, self.cfg.hidden_size) if want_hidden else None)

    def run(self, batch: list[ScheduledSeq], want_hidden: bool = False, sample_vocab: int | None = None,
            layer_hook: LayerHook | None = None, want_logprobs: bool = False) -> ForwardOutput:
        """ModelRunner.run's contract (log probabilities of its logits included); `sample_vocab`
        and `layer_hook` have nothing to act on here (SimEngine reserves no rows, and CoreShare
        never shares cores with a model that sleeps).
        Its logits are finite by construction (no bad rows), and a greedy row's token is its one
        positive logit's id, the argmax, unless the row's sampling controls change the logits."""
        t0 = time.perf_counter()
        seqs = [s for s, n in batch if s.num_computed_tokens + n == len(s.token_ids)]
        logits, top = self.next_logits(seqs)
        params = [s.sampling for s in seqs]
        sampled = top if all(p.greedy and not p.adjusts_logits for p in params) else \
            sample(logits, params, [s.generator for s in seqs], (), seqs)
        hidden = torch.zeros(len(seqs), self.cfg.hidden_size) if want_hidden else None
        lp = step_logprobs(logits, sampled, [p.logprobs for p in params]) if want_logprobs else None
        # sleep the remainder of L(b): the bookkeeping above counts as part of the step
        rest = self.latency(len(batch)) - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return ForwardOutput(seqs, logits, sampled.tolist(), hidden, (), sampled,
                             lp.entries(len(seqs)) if lp is not None else None)


class SimEngine(Engine):
    def __init__(self, latency_a: float = 0.006, latency_c: float = 0.0, vocab_size: int = 512,
                 config: EngineConfig | None = None, token_seed: int = 0, max_model_len: int = 8192):
        if latency_a < 0 or latency_c < 0:
            raise ValueError(f"SimEngine latencies must be >= 0, got a={latency_a}, c={latency_c}")
        mcfg = sim_model_config(vocab_size, max_model_len)
        ecfg = self._fit_config(config or EngineConfig(), mcfg)
        self.path = None
        self._setup(mcfg, ecfg, SimRunner(mcfg, latency_a, latency_c, token_seed), ByteTokenizer(),
                    [torch.device("cpu")], torch.float32)

    def check_reserved_rows(self, n: int) -> int:
        if n:
            raise ValueError("a sim engine has no output head to reserve rows of")
        return n
