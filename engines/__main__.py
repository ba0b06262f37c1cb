"""`python -m engines "prompt"`: stream one chat answer from a model through the engine
(the embedded SmolLM2-135M-Instruct when no --model is given)."""
from __future__ import annotations

import argparse
import sys
import time

from engines import Engine, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engines", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--model", help="HF model directory or a known model's name, e.g. gemma3-270m "
                                    "(default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    if args.model is None:
        from engines.known_models import default_model_path
        args.model = default_model_path()
    else:
        from engines.known_models import UnknownModelError, resolve_model_path
        try:
            args.model = resolve_model_path(args.model)
        except UnknownModelError as e:
            ap.error(str(e))
    eng = Engine.from_pretrained(args.model, dtype=args.dtype, num_kv_tokens=4096)
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    seq = eng.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    out = eng.output_of(seq)
    t0, shown = time.perf_counter(), 0
    while not seq.is_finished:
        eng.step()
        sys.stdout.write(out.text[shown:])
        sys.stdout.flush()
        shown = len(out.text)
    dt = time.perf_counter() - t0
    print(f"\n[{seq.num_output_tokens} tokens in {dt:.2f}s, {seq.num_output_tokens / dt:.1f} tok/s, finish={seq.finish_reason}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
