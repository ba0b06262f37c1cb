"""Rules read from the source (issue 39): the engine alone writes its sequences, fault injection
stays out of the hot path, and no module keeps mutable state of its own."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("aiorouter", "engines", "policies", "server")
# the files a token passes through on every step: a fault plan wraps what they call, they check nothing
HOT_PATH = ("engines/engine.py", "engines/runner.py", "aiorouter/subserver.py", "aiorouter/routing.py",
            "policies/base.py")
MUTATING = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
            "discard", "appendleft", "extendleft", "popleft", "sort", "reverse"}


def py_files(*folders: str) -> list[Path]:
    return sorted(f for d in folders for f in (ROOT / d).rglob("*.py"))


def sequence_fields() -> set[str]:
    from engines.sequence import Sequence
    return {f.name for f in dataclasses.fields(Sequence)}


def writes_to_fields(tree: ast.AST, fields: set[str]) -> list[tuple[int, str]]:
    """`x.f = ...`, `x.f += ...`, `del x.f[...]`, `x.f[...] = ...` and `x.f.append(...)`-style calls,
    for f in `fields`, where x is not `self` (a class writing its own attribute of that name)."""
    def field_of(node: ast.AST) -> str | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and \
                not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            return node.attr
        return None

    hits = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
            targets = [node.func.value]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                f = field_of(el)
                if f is not None:
                    hits.append((node.lineno, f))
    return sorted(hits)


def test_nothing_outside_engines_writes_a_sequence():
    fields = sequence_fields()
    assert {"token_ids", "t_ready", "status", "num_computed_tokens"} <= fields  # the check reads the real fields
    hits = [f"{f.relative_to(ROOT)}:{line} .{name}" for f in py_files("aiorouter", "policies", "server")
            for line, name in writes_to_fields(ast.parse(f.read_text()), fields)]
    assert not hits, hits


def test_the_sequence_write_finder_finds_writes():
    tree = ast.parse("seq.t_ready = 1\nreq.seq.token_ids.append(3)\ndel s.token_ids[2:]\nself.status = 0\n"
                     "s.block_table[0] = 4\nx = s.token_ids\n")
    assert writes_to_fields(tree, {"t_ready", "token_ids", "status", "block_table"}) == [
        (1, "t_ready"), (2, "token_ids"), (3, "token_ids"), (5, "block_table")]


def fault_words(text: str) -> list[str]:
    return [w for w in re.findall(r"\w*fault\w*", text, re.I) if "default" not in w.lower()]


@pytest.mark.parametrize("path", HOT_PATH)
def test_no_fault_reference_in_the_hot_path(path):
    assert not fault_words((ROOT / path).read_text()), fault_words((ROOT / path).read_text())


def test_the_fault_finder_finds_one_and_passes_defaults():
    assert fault_words("x = DEFAULT_X  # defaults\nd.setdefault(1)\nif self.fault_hook: InjectedFault()") == [
        "fault_hook", "InjectedFault"]


def module_state_writes(tree: ast.Module) -> list[str]:
    """`global` statements anywhere, and module-level containers (a literal list, dict or set, or a
    call of a container type) that the module itself mutates: a subscript store or delete, an
    augmented assignment, or a mutating method call on the name."""
    containers = {"list", "dict", "set", "defaultdict", "Counter", "deque", "OrderedDict", "WeakValueDictionary",
                  "WeakKeyDictionary", "WeakSet"}
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        is_container = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in containers)
        if is_container:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.append(f"{node.lineno}: global {', '.join(node.names)}")
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
            targets = [node.func.value]
        out += [f"{node.lineno}: {t.id} mutated" for t in targets if isinstance(t, ast.Name) and t.id in names]
    return out


def test_no_module_state():
    hits = [f"{f.relative_to(ROOT)}: {h}" for f in py_files(*PACKAGES) for h in module_state_writes(ast.parse(f.read_text()))]
    assert hits == []


def test_the_module_state_finder_finds_it():
    tree = ast.parse("_n = 0\nCACHE = {}\nSEEN = set()\nFIXED = {'a': 1}\n"
                     "def f(k):\n    global _n\n    CACHE[k] = 1\n    SEEN.add(k)\n    local = {}\n    local[k] = 2\n"
                     "    return FIXED[k]\n")
    assert module_state_writes(tree) == ["6: global _n", "7: CACHE mutated", "8: SEEN mutated"]
