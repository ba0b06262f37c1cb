"""No dead code in the library: vulture (a well-kept dead-code finder) over the library, the benchmarks
and the tests together, so that a name any of them uses counts as used. What it still reports in the
library must be on PUBLIC below, each with the reason a reader of the code cannot see a caller."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("aiorouter", "engines", "policies", "server")

# file: name -> why it stays though no code here calls it
PUBLIC = {
    "aiorouter/__init__.py: __getattr__": "module hook: lazy exports",
    "aiorouter/__init__.py: __dir__": "module hook: lazy exports",
    "engines/quant.py: extra_repr": "nn.Module hook, printed with the model",
    "server/ray_serve.py: check_health": "Ray Serve calls it on each replica",
    "server/schemas.py: _seed_range": "pydantic validator",
    "server/schemas.py: _stops": "pydantic validator",
    "server/schemas.py: _unsupported": "pydantic validator",
    "server/schemas.py: _one_prompt": "pydantic validator",
    "server/schemas.py: _unsupported_completion": "pydantic validator",
    "server/schemas.py: _top_needs_logprobs": "pydantic validator",
    "server/schemas.py: refusal": "OpenAI response field (chat logprobs)",
    "server/schemas.py: aiorouter_model": "response field: the model that wrote a token (chat logprobs)",
    "server/schemas.py: aiorouter_models": "response field: the model that wrote each token (completion logprobs)",
    "server/schemas.py: _bias": "pydantic validator",
    "server/schemas.py: _stop_ids": "pydantic validator",
    "server/schemas.py: total_tokens": "OpenAI response field",
    "server/schemas.py: owned_by": "OpenAI response field",
    "server/schemas.py: pages_freed": "response field of the cache-reset endpoint",
    "aiorouter/metrics.py: requests_started": "RouterMetrics field users read",
    "aiorouter/metrics.py: requests_failed": "RouterMetrics field users read",
    "aiorouter/requests.py: requests_started": "counts RouterMetrics.requests_started",
    "aiorouter/requests.py: requests_failed": "counts RouterMetrics.requests_failed",
    "aiorouter/tuning/dtmc.py: expected_tau_quanta": "DTMCResult field (the chain's E[tau] in quanta)",
    "aiorouter/tuning/dtmc.py: step_rate": "DTMCResult field (request-steps per second per model)",
    "aiorouter/tuning/schedules.py: round_seconds": "sync schedule result field",
    "aiorouter/tuning/search.py: child_main": "a search child runs it (`python -c`, search.ChildProcess)",
    "engines/default_model.py: hf_quantizer": "set on a transformers object transformers reads",
    "engines/default_model.py: model_max_length": "set on the tokenizer transformers reads",
    "engines/engine.py: prompt_token_ids": "RequestOutput field, as vLLM's",
    "policies/base.py: model_trace": "RequestView field policies read",
}
LINE = re.compile(r"^(?P<file>[^:]+):\d+: unused \w+(?: \w+)? '(?P<name>[^']+)'")


def test_vulture_finds_nothing_outside_the_public_list():
    done = subprocess.run([sys.executable, "-m", "vulture", *LIBRARY, "bench", "tests", "--min-confidence", "60"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 3), done.stderr  # 3: vulture found something
    found = {f"{m['file']}: {m['name']}" for line in done.stdout.splitlines()
             if (m := LINE.match(line)) and m["file"].startswith(LIBRARY)}
    assert found <= set(PUBLIC), sorted(found - set(PUBLIC))
    assert set(PUBLIC) <= found, f"no longer reported, drop from PUBLIC: {sorted(set(PUBLIC) - found)}"
