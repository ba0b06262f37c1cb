"""The tools users already run, unchanged, against `aiorouter serve` on the default pair (issue 40):
guidellm (streaming and not, chat and completions), lm-evaluation-harness (`local-completions`
with generate_until, batched, and multiple_choice, which scores with `echo` and `logprobs`;
`local-chat-completions` with generate_until) and `vllm bench serve` (in the README's commands).
Their tasks are the repository's own (tests/clients_tasks), since nothing can be downloaded here.

These clients are heavy (lm-eval and vLLM each bring their own torch), so they live in the
`clients` extra (vLLM apart), best in virtual environments of their own, and these tests are
marked `clients` and `slow`, which CI leaves out:

    python -m venv ~/clients && ~/clients/bin/pip install 'lm-eval[api]' guidellm
    python -m venv ~/vllm && ~/vllm/bin/pip install vllm
    AIOROUTER_CLIENTS_BIN=~/clients/bin:~/vllm/bin python -m pytest -m clients tests/test_clients.py

Without the clients on AIOROUTER_CLIENTS_BIN (a search path) or PATH, the tests fail and say so: a
run that asked for them must not pass without them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.clients, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "clients_tasks"  # the task files name their data relative to the repository root
SNIPPET = ROOT / "docs-snippets" / "clients.sh"
REQUESTS = 10  # guidellm's requests per run, as the table counted them


def tool(name: str) -> str:
    where = os.environ.get("AIOROUTER_CLIENTS_BIN")
    found = shutil.which(name, path=where) if where else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found on {'AIOROUTER_CLIENTS_BIN=' + where if where else 'PATH'}: "
                    "install the clients (see this file's docstring)")
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`aiorouter serve` as a user starts it (the embedded default pair), on a free port -> (url, tokenizer dir)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900  # a first run builds the models
        while True:
            if proc.poll() is not None:
                pytest.fail(f"aiorouter serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"aiorouter serve not ready in 900 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            root = json.load(r)["data"][0]["root"]  # the entry model's directory: its tokenizer
        yield url, root
    finally:
        proc.terminate()
        proc.wait(30)


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize("fmt", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", ["true", "false"])
def test_guidellm(served, tmp_path, fmt, stream):
    url, tokenizer = served
    out = tmp_path / "guidellm.json"
    run = subprocess.run(
        [tool("guidellm"), "run", "--backend", f"kind=openai_http,target={url},request_format={fmt},stream={stream}",
         "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
         "--disable-console-interactive"], capture_output=True, text=True, timeout=900, env=offline_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    made = bench["scheduler_metrics"]["requests_made"]
    assert (made["successful"], made["errored"], made["incomplete"]) == (REQUESTS, 0, 0), made
    tokens = bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    print(f"guidellm {fmt} stream={stream}: {made['successful']}/{REQUESTS} answered, {tokens:.1f} output tok/s")
    assert tokens > 0


LM_EVAL = {  # name -> (model, model_args past model/base_url, task, extra arguments)
    "completions-generate": ("local-completions", "tokenizer_backend=huggingface,num_concurrent=2", "aiorouter_gen", []),
    "completions-generate-batched": ("local-completions", "tokenizer_backend=huggingface", "aiorouter_gen",
                                     ["--batch_size", "2"]),
    "completions-multiple-choice": ("local-completions", "tokenizer_backend=huggingface,num_concurrent=2",
                                    "aiorouter_mc", []),
    "chat-generate": ("local-chat-completions", "num_concurrent=2", "aiorouter_gen", ["--apply_chat_template"]),
}


@pytest.mark.parametrize("case", list(LM_EVAL))
def test_lm_eval(served, tmp_path, case):
    url, tokenizer = served
    model, args, task, extra = LM_EVAL[case]
    endpoint = "/v1/chat/completions" if model.endswith("chat-completions") else "/v1/completions"
    if model == "local-completions":
        args += f",tokenizer={tokenizer}"
    run = subprocess.run(
        [tool("lm_eval"), "--model", model, "--model_args", f"model=aiorouter,base_url={url}{endpoint},max_retries=1,{args}",
         "--tasks", task, "--include_path", str(TASKS), "--output_path", str(tmp_path / "out"), "--log_samples",
         *extra], capture_output=True, text=True, timeout=1800, env=offline_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob(f"samples_{task}_*.jsonl") for line in open(f)]
    docs = sum(1 for _ in open(TASKS / ("gen.jsonl" if task == "aiorouter_gen" else "mc.jsonl")))
    assert len(samples) == docs
    metric = "exact_match,none" if task == "aiorouter_gen" else "acc,none"
    print(f"lm-eval {case}: {metric.split(',')[0]} = {results[metric]:.3f} over {len(samples)} documents")
    assert 0.0 <= results[metric] <= 1.0
    if task == "aiorouter_mc":  # every choice was scored: a negative log probability each
        assert all(len(s["resps"]) == len(s["doc"]["choices"]) and all(float(r[0][0]) < 0 for r in s["resps"])
                   for s in samples)


def test_readme_snippet_runs_as_written(served, tmp_path):
    """The README's commands (docs-snippets/clients.sh) from its third line on, against this server's
    port; its first two install the clients, which AIOROUTER_CLIENTS_BIN (or PATH) stands for here."""
    url, _ = served
    lines = SNIPPET.read_text().splitlines()
    assert lines[1].startswith("python -m venv ~/clients") and lines[2].startswith("python -m venv ~/vllm")
    assert lines[3].startswith("export PATH=~/clients/bin")
    script = "set -e\n" + "\n".join(lines[4:]).replace("http://127.0.0.1:8000", url).replace("~/vllm/bin/vllm", tool("vllm"))
    where = os.path.dirname(tool("lm_eval"))
    assert os.path.dirname(tool("guidellm")) == where
    env = {**offline_env(), "PATH": where + os.pathsep + os.environ["PATH"]}
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=2400, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "Benchmarking complete" in out  # guidellm
    assert re.search(r"Successful requests:\s+10\b", out) and re.search(r"Failed requests:\s+0\b", out)  # vllm
    for row in ("aiorouter_gen", "aiorouter_mc"):  # lm-eval's results tables
        assert re.search(rf"\|{row}\s*\|", out), out[-3000:]
