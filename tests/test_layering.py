"""The shape of the code, read from its source: no import cycles, one owner per concern, layers that
point one way, and no reference outside the repository."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("aiorouter", "engines", "policies", "server")
# The engine's own white-box tests reach into its runner to test the runner (graph capture, stages,
# a KV pool filled with NaN); everything else goes through the engine's public API.
RUNNER_WHITE_BOX = {"tests/test_engine_api.py", "tests/test_gpu_graphs.py", "tests/test_gpu_parts_cpu.py",
                    "tests/test_streams.py", "tests/test_architectures.py"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def py_files(*folders: str) -> list[Path]:
    return sorted(f for d in folders for f in (ROOT / d).rglob("*.py"))


def type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports, at module level or inside functions (TYPE_CHECKING aside).
    `from pkg import x` counts as importing pkg.x when that is a module, else pkg."""
    tree = ast.parse(path.read_text())
    skip = type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
    return {m for m in found if m in mods and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_no_import_cycle():
    mods = modules()
    graph = {m: imports_of(m, f, mods) for m, f in mods.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_layers_point_one_way():
    """engines knows nothing of routing; policies nothing of the runtime; nothing imports server or bench."""
    mods = modules()
    forbidden = {"engines": ("aiorouter", "policies", "server", "bench"), "policies": ("aiorouter", "server", "bench"),
                 "aiorouter": ("server", "bench"), "server": ("bench",)}
    for m, f in mods.items():
        bad = [d for d in imports_of(m, f, mods) if d.split(".")[0] in forbidden[m.split(".")[0]]]
        assert not bad, f"{m} imports {bad}"
        text = f.read_text()
        assert not re.search(r"^\s*(from|import) bench\b", text, re.M), f"{m} imports bench"


def attribute_uses(path: Path, names: set[str], owners_excluded=("self", "cls")) -> list[str]:
    """`x.name` for name in `names`, where x is not self/cls, with line numbers."""
    tree = ast.parse(path.read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in owners_excluded):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return hits


def router_private_names() -> set[str]:
    tree = ast.parse((ROOT / "aiorouter" / "router.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
            names.add(node.name)
    return names


def test_nothing_outside_router_py_uses_a_private_router_attribute():
    names = router_private_names()
    assert {"_launch", "_requests", "_tasks"} <= names  # the check reads the real names
    hits = [h for f in py_files(*PACKAGES, "bench", "tests") if f != ROOT / "aiorouter" / "router.py"
            for h in attribute_uses(f, names)]
    assert not hits, hits


def test_nothing_outside_engines_uses_the_engine_internals():
    internals = {"scheduler", "runner", "block_manager"}
    hits = [h for f in py_files("aiorouter", "policies", "server", "bench", "tests", "docs-snippets")
            if str(f.relative_to(ROOT)) not in RUNNER_WHITE_BOX for h in attribute_uses(f, internals)]
    assert not hits, hits
    white_box = [h for f in RUNNER_WHITE_BOX for h in attribute_uses(ROOT / f, {"scheduler", "block_manager"})]
    assert not white_box, white_box  # even there, only the runner


@pytest.mark.parametrize("folder", [*PACKAGES, "bench", "tests", "docs-snippets"])
def test_no_reference_outside_the_repository(folder):
    """A user of the project has no ../shared: its docs are inside (docs/)."""
    pattern = re.compile(r"shared/design|shared/paper|\.\./shared|DTMC\.md")
    this = Path(__file__).resolve()
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in py_files(folder) if f.resolve() != this
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_two_engines_number_their_sequences_independently(tiny_qwen3):
    """No process-wide counter: several models (and routers) share one process."""
    from engines import Engine
    a = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=256)
    b = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=256)
    ids_a = [a.add_request([5, 6]).seq_id for _ in range(3)]
    ids_b = [b.add_request([5, 6]).seq_id for _ in range(3)]
    assert ids_a == ids_b == [0, 1, 2]


def test_builtin_policies_are_read_only():
    from policies import BUILTIN, SinglePolicy
    with pytest.raises(TypeError):
        BUILTIN["mine"] = SinglePolicy  # type: ignore[index]
