"""The README's examples, run as written. Each lives in docs-snippets/ and the README shows it
verbatim (the first test checks). The only change a test makes is the port: `127.0.0.1:8000`
becomes a free port, so that parallel test runs on one machine do not collide.

Each example runs twice: on the tiny random chat model (tests/conftest.py), fast, for what does not
depend on the answer (it runs, it closes, the shapes are right); and on the real default pair, where
the answer must name Paris."""
from __future__ import annotations

import ast
import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

import aiorouter.defaults
from aiorouter import ModelSpec
from bench.common import free_port
from server.cli import parser

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs-snippets"
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def snippet(name: str) -> str:
    return (SNIPPETS / name).read_text()


def at_port(text: str, port: int) -> str:
    assert "127.0.0.1:8000" in text
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def readme_blocks() -> list[str]:
    return [m.group(1) for m in re.finditer(r"```[a-z]*\n(.*?)```", README, re.S)]


@pytest.mark.parametrize("name", sorted(p.name for p in SNIPPETS.iterdir()))
def test_readme_shows_each_snippet_verbatim(name):
    assert snippet(name) in readme_blocks(), f"README.md has no code block equal to docs-snippets/{name}"


def test_readme_opens_with_the_two_commands_ci_runs():
    first = readme_blocks()[0]
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and commands[0].endswith("&& aiorouter serve"), commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_readme_command_lines_parse():
    """The command lines shown with paths of your own: every flag exists and takes what is given."""
    for block in readme_blocks():
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.startswith("aiorouter ") and cmd.split()[1] in ("serve", "generate"):
                words = shlex.split(cmd.split("#")[0].replace("$KEY", "sk-x"))
                parser().parse_args(words[1:])


def tiny_pair(path) -> dict[str, ModelSpec]:
    # num_kv_tokens: a router's default 2 GB of KV would be 262k pages of this tiny model
    return {name: ModelSpec(path=str(path), num_kv_tokens=4096) for name in ("small", "large")}


def run(cmd: list[str], timeout: float = 900) -> str:
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def per_model(printed: str) -> dict[str, int]:
    """The {model: tokens} dict an example prints last."""
    return ast.literal_eval(printed[printed.rindex("{"):].strip())


# -- Embedding -------------------------------------------------------------------------------------
def test_embedding_runs_on_tiny_models(tiny_chat_model, monkeypatch, capsys):
    monkeypatch.setattr(aiorouter.defaults, "default_models", lambda: tiny_pair(tiny_chat_model))
    exec(compile(snippet("embedding.py"), "embedding.py", "exec"), {"__name__": "__main__"})
    usage = per_model(capsys.readouterr().out)
    assert set(usage) == {"small", "large"} and 0 < sum(usage.values()) <= 8


@pytest.mark.slow
def test_embedding_answers_paris():
    out = run([sys.executable, "docs-snippets/embedding.py"])
    streamed, raw = out.split("\n", 1)  # the chat answer, then the raw completion
    assert "Paris" in streamed and "Paris" in raw, out


# -- Jupyter ---------------------------------------------------------------------------------------
def run_notebook(setup: list[str], monkeypatch) -> list[str]:
    """Executes the snippet's cells (`# %%`) after `setup`, then checks the router is closed; returns
    each cell's printed text."""
    cells = [c.strip() for c in snippet("jupyter.py").split("# %%") if c.strip()]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in
                                         [*setup, *cells, "print('started:', router.started)"]])
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    printed = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream") for c in nb.cells]
    assert printed[-1].strip() == "started: False"  # the last snippet cell closed it
    return printed[len(setup):]


def test_jupyter_notebook_runs_and_closes_on_tiny_models(tiny_chat_model, monkeypatch):
    setup = ["import aiorouter.defaults\nfrom aiorouter import ModelSpec\n"
             "aiorouter.defaults.default_models = lambda: {n: ModelSpec(path=PATH, num_kv_tokens=4096) "
             "for n in ('small', 'large')}".replace("PATH", repr(str(tiny_chat_model)))]
    printed = run_notebook(setup, monkeypatch)
    assert printed[1]  # the streamed answer


@pytest.mark.slow
def test_jupyter_notebook_answers_paris(monkeypatch):
    assert "Paris" in run_notebook([], monkeypatch)[1]


# -- Writing a policy (tests/test_readme_policy.py checks the policy itself) -----------------------------
@pytest.mark.slow
def test_custom_policy_answers_paris():
    out = run([sys.executable, "docs-snippets/custom_policy.py"])
    assert "Paris" in out, out


# -- The engine alone ------------------------------------------------------------------------------
def test_engine_alone_answers_paris():
    out = run([sys.executable, "docs-snippets/engine.py"])
    assert "Paris" in out, out


# -- curl and the openai client, against a real `aiorouter serve` process -----------------------------
@contextlib.contextmanager
def serving(*args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the server never became healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def curl_answers(port: int) -> list[dict]:
    out = run(["bash", "-c", at_port(snippet("curl.sh"), port)], timeout=600).strip()
    docs, decoder = [], json.JSONDecoder()
    while out:  # curl prints the two JSON bodies back to back
        doc, end = decoder.raw_decode(out)
        docs.append(doc)
        out = out[end:].strip()
    return docs


def openai_answer(port: int) -> tuple[str, dict[str, int]]:
    out = run([sys.executable, "-c", at_port(snippet("openai_client.py"), port)], timeout=600)
    return out[:out.rindex("{")], per_model(out)


def test_curl_and_openai_run_against_serve_on_tiny_models(tiny_chat_model):
    with serving("--model", f"small={tiny_chat_model}", "--model", f"large={tiny_chat_model}",
                 "--policy", "random", "--kv-memory-gb", "0.05") as port:
        chat, cmpl = curl_answers(port)
        assert chat["object"] == "chat.completion" and cmpl["object"] == "text_completion"
        assert 0 < chat["usage"]["completion_tokens"] <= 32 and 0 < cmpl["usage"]["completion_tokens"] <= 8
        assert set(chat["usage"]["per_model"]) == {"small", "large"}
        again = curl_answers(port)  # temperature 0: the same answers again
        assert [d["choices"] for d in again] == [chat["choices"], cmpl["choices"]]
        text, usage = openai_answer(port)
        assert text.strip() == chat["choices"][0]["message"]["content"].strip()
        assert set(usage) == {"small", "large"} and sum(usage.values()) == chat["usage"]["completion_tokens"]


@pytest.mark.slow
def test_curl_and_openai_answer_paris_from_the_default_pair():
    with serving() as port:
        chat, cmpl = curl_answers(port)
        assert "Paris" in chat["choices"][0]["message"]["content"], chat
        assert "Paris" in cmpl["choices"][0]["text"], cmpl
        text, usage = openai_answer(port)
        assert "Paris" in text and sum(usage.values()) > 0


@pytest.mark.slow
def test_cli_generate_answers_paris():
    out = run([sys.executable, "-m", "server.cli", "generate", "What is the capital of France?"])
    assert "Paris" in out, out
