"""Stop conditions shared by the engine and the router: EOS, stop ids, stop strings, lengths."""
from __future__ import annotations

from engines.sampling import SamplingParams


def check_stop(p: SamplingParams, token: int, num_output_tokens: int, text: str | None, eos_ids: tuple[int, ...],
               seq_len: int, max_model_len: int) -> tuple[str | None, int | None]:
    """After committing `token` (the request now has `num_output_tokens` outputs and
    `seq_len` tokens in all) -> (finish reason or None, where a stop string cuts `text`)."""
    if num_output_tokens >= p.min_tokens:
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            return "stop", None
        if p.stop and text:
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                return "stop", min(hits)
    if num_output_tokens >= p.max_tokens or seq_len >= max_model_len:
        return "length", None
    return None, None
