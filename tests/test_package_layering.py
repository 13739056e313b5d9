"""Which way imports run: no cycle between pipeserve's top-level packages, and the
planner reaches the runtime only through public names (docs/ARCHITECTURE.md, "Which
way imports run"). Reads the sources' import statements, lazy ones inside functions
included; imports nothing of pipeserve."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeserve"

# Cycles tolerated while someone removes them; each must still exist (else drop it here).
# None today: the pipeline registers its message payload types with comm.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _unit(module: str) -> str | None:
    """``pipeserve.engine.llm_engine`` -> ``engine``; a top-level module is its own unit."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeserve" and len(parts) > 1 else None


def _imported_modules(tree: ast.AST) -> list[tuple[str, ast.stmt]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "pipeserve uses absolute imports only"
            if node.module == "pipeserve":   # from pipeserve import engine, __version__
                found += [(f"pipeserve.{alias.name}", node) for alias in node.names]
            elif node.module:
                found.append((node.module, node))
    return found


@cache
def _sources() -> dict[str, tuple[str, ast.AST]]:
    """Module name -> (its unit, parsed source), for every file under pipeserve/ except
    the package's own facade (``__init__``, ``__main__``), which imports the front doors."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if len(rel.parts) == 2 and rel.name in ("__init__", "__main__"):
            continue
        module = ".".join(rel.parts)
        out[module] = (rel.parts[1], ast.parse(path.read_text(), str(path)))
    return out


def package_graph() -> dict[str, set[str]]:
    """Unit -> the units it imports (``engine`` -> {``scheduler``, ...})."""
    units = {unit for unit, _ in _sources().values()}
    graph: dict[str, set[str]] = defaultdict(set)
    for unit, tree in _sources().values():
        for module, _ in _imported_modules(tree):
            target = _unit(module)
            if target in units and target != unit:
                graph[unit].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components with more than one member: the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(component)

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert strongly_connected({"a": {"b"}, "b": {"c"}}) == []


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = package_graph()
    # The graph is the real one (not empty because a path moved): the engine's known edges.
    assert {"scheduler", "sequence", "worker"} <= graph["engine"] and "kv_cache" in graph["scheduler"]
    cycles = {frozenset(c) for c in strongly_connected(graph)}
    new = cycles - KNOWN_CYCLES
    assert not new, "import cycles between packages: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    gone = KNOWN_CYCLES - cycles
    assert not gone, f"{sorted(map(sorted, gone))} no longer form a cycle: remove them from KNOWN_CYCLES"


def test_sampling_and_worker_do_not_import_each_other_both_ways() -> None:
    graph = package_graph()
    assert "sampling" in graph["worker"] and "worker" not in graph["sampling"]


def test_low_layers_import_no_higher_one() -> None:
    graph = package_graph()
    allowed = {"sequence": {"outputs", "sampling_params"}, "kv_cache": {"sequence"},
               "scheduler": {"config", "kv_cache", "sequence"}}
    for unit, below in allowed.items():
        assert graph.get(unit, set()) <= below, f"{unit} imports {sorted(graph[unit] - below)}"


def test_planner_uses_no_private_name_of_another_package() -> None:
    """``from pipeserve.x import _y``, ``Name._y`` or a subclass that overrides ``_y``, in
    plan/, for a name from outside plan/."""
    for module, (unit, tree) in _sources().items():
        if unit != "plan":
            continue
        foreign = {}          # local name -> module outside plan/
        for name, node in _imported_modules(tree):
            if _unit(name) in (None, "plan"):
                continue
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    assert not alias.name.startswith("_"), f"{module} imports {name}.{alias.name}"
                    foreign[alias.asname or alias.name] = name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in foreign and node.attr.startswith("_"):
                raise AssertionError(f"{module} uses {node.value.id}.{node.attr} of {foreign[node.value.id]}")
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in foreign
                                                      for b in node.bases):
                private = [f.name for f in node.body if isinstance(f, ast.FunctionDef)
                           and f.name.startswith("_") and not f.name.startswith("__")]
                assert not private, f"{module}: {node.name} overrides {private} of a runtime class"


def test_cli_parser_and_a_plain_request_need_no_web_stack_or_grammar_engine() -> None:
    """``pipeserve bench``/``plan`` run where fastapi or llguidance is missing (the GPU machine's
    image lacked both): the parser imports the server's defaults only, and an unconstrained
    request never imports llguidance."""
    import subprocess
    import sys
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'llguidance'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
from pipeserve.entrypoints.cli import build_parser
build_parser().parse_args(['bench', 'throughput', '--num-prompts', '1'])
from pipeserve.engine.guides import Guides
from pipeserve.sequence import Sequence
from pipeserve.sampling_params import SamplingParams
guides = Guides(None, 32)
guides.start(Sequence('r', 0, [1, 2, 3], SamplingParams(max_tokens=1)))
assert len(guides) == 0
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
