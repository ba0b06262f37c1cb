"""The `aiorouter` command line: its help, its errors, and `generate`'s prompt convention."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import aiorouter
from aiorouter import Router, RouterConfig
from server import cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def aiorouter_cmd(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", ["serve", "generate"])
def test_every_option_has_help_and_its_default(cmd):
    p = aiorouter_cmd(cmd, "--help")
    assert p.returncode == 0
    text = p.stdout.split("options:", 1)[1]
    # an option's entry: from its line to the next option's (COLUMNS keeps argparse's wrapping stable enough)
    entries = re.split(r"\n  (?=-)", "\n" + text)[1:]
    assert len(entries) > 5
    for entry in entries:
        flag = entry.split()[0]
        if flag == "-h,":
            continue
        words = " ".join(entry.split())
        assert "default" in words, f"{cmd} {flag}: no default shown: {words!r}"
        assert len(words.split("(default")[0].split()) > 2, f"{cmd} {flag}: no help text: {words!r}"


def test_cli_defaults_match_the_library():
    assert cli.DEFAULT_POLICY == aiorouter.DEFAULT_POLICY  # cli keeps its own copy: --help imports no torch
    from policies import BUILTIN
    policy_help = " ".join(aiorouter_cmd("serve", "--help").stdout.split("--policy POLICY", 1)[1].split())
    assert all(f" {name}," in policy_help or f" {name} (" in policy_help for name in BUILTIN), list(BUILTIN)


def test_busy_port_is_one_line_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = aiorouter_cmd("serve", "--model", "a=sim:1", "--port", str(port))
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"aiorouter serve: error: port {port} on 127.0.0.1 is already in use; stop what listens "
                      "there or choose another with --port"], p.stderr


def test_bad_generation_config_is_a_usage_error(tmp_path):
    p = aiorouter_cmd("serve", "--model", "a=sim:1", "--generation-config", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "--generation-config" in p.stderr and "Traceback" not in p.stderr
    p = aiorouter_cmd("serve", "--model", "a=sim:1", "--policy", "single", "--port", "0", "--generation-config",
                      str(tmp_path))
    assert p.returncode == 2 and "no generation_config.json there" in p.stderr and "Traceback" not in p.stderr


async def test_generate_sends_a_user_message_and_raw_sends_text(tiny_chat_model):
    """`aiorouter generate TEXT` is router.stream([{"role": "user", "content": TEXT}]); --raw is stream(TEXT)."""
    text = "Tell me about cats."
    async with Router({"small": str(tiny_chat_model), "large": str(tiny_chat_model)},
                      RouterConfig(policy="single")) as router:
        chat = await router.generate([{"role": "user", "content": text}], max_tokens=12)
        raw = await router.generate(text, max_tokens=12)
    assert chat.text != raw.text  # the template changes the prompt, so the continuation
    models = ["--model", f"small={tiny_chat_model}", "--model", f"large={tiny_chat_model}", "--policy", "single",
              "--max-tokens", "12", "--kv-memory-gb", "0.05"]  # the default 2 GB is 262k pages of a tiny model
    for extra, want in (([], chat), (["--raw"], raw)):
        p = aiorouter_cmd("generate", text, *models, *extra)
        assert p.returncode == 0, p.stderr
        printed, summary = p.stdout.rsplit("\n[", 1)
        assert printed == want.text and summary.startswith(f"{len(want.token_ids)} tokens")


def test_generate_answers_one_request_without_tuning_and_logs_only_when_verbose(tiny_chat_model):
    """One request needs no schedule: generate neither profiles step costs nor solves thresholds
    (8.5 of 17 s of the default pair's first answer), and its stderr holds the start-up's INFO lines
    only with --verbose."""
    models = ["--model", f"small={tiny_chat_model}", "--model", f"large={tiny_chat_model}", "--policy", "random",
              "--max-tokens", "6", "--kv-memory-gb", "0.05"]
    quiet = aiorouter_cmd("generate", "Hi there.", *models)
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr, quiet.stderr  # (a library's own warning may still reach stderr)
    assert quiet.stdout.rsplit("\n[", 1)[1].startswith("6 tokens")
    loud = aiorouter_cmd("generate", "Hi there.", *models, "--verbose")
    assert loud.returncode == 0, loud.stderr
    assert "INFO aiorouter: loading model small" in loud.stderr and "INFO aiorouter: loading model large" in loud.stderr
    assert "decode step b=" not in loud.stderr and "threshold tuning" not in loud.stderr, loud.stderr
    # greedy on two copies of one model: the same text either way (the coins split it otherwise)
    assert loud.stdout.rsplit("\n[", 1)[0] == quiet.stdout.rsplit("\n[", 1)[0]


def test_generate_without_a_chat_template_says_to_use_raw(tiny_chat_model, tmp_path):
    base = tmp_path / "base"  # the tiny chat model without its chat template: a base model
    shutil.copytree(tiny_chat_model, base)
    (base / "chat_template.jinja").unlink()
    small_kv = ("--kv-memory-gb", "0.05")
    p = aiorouter_cmd("generate", "hello", "--model", f"m={base}", "--policy", "single", *small_kv)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "aiorouter generate: error: the entry model's tokenizer has no chat template: add --raw" in p.stderr
    p = aiorouter_cmd("generate", "hello", "--model", f"m={base}", "--policy", "single", "--raw", "--max-tokens", "3",
                      *small_kv)
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_cpu_kernel_build_says_what_it_does_once(tmp_path):
    """A first run waits ~15 s for the compiler: it says so on stderr; a cached build is silent."""
    code = "from engines import cpu_kernels; assert cpu_kernels.load() is not None"
    env = {**ENV, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    lines = runs[0].stderr.splitlines()
    assert lines[0].startswith("aiorouter: compiling the CPU kernels") and str(tmp_path) in lines[0]
    assert re.fullmatch(r"aiorouter: CPU kernels compiled in [\d.]+ s", lines[1]), lines
    assert "compil" not in runs[1].stderr


def test_no_retune_reaches_the_router():
    import argparse
    ap = argparse.ArgumentParser()
    cli.add_router_args(ap)
    sim = ["--model", "small=sim:1", "--model", "large=sim:6"]
    assert cli.router_args(ap.parse_args(sim))[1].retune is True
    models, config = cli.router_args(ap.parse_args(sim + ["--no-retune"]))
    assert config.retune is False and Router(models, config).config.retune is False
