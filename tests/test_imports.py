"""The import graph of the `tunelab` package has no cycle, and goes only down the floors.

Read from the source with `ast`: every `import tunelab.x` and `from tunelab.x import y` executed
when a module is imported (the module's body, its class bodies and compound statements, not
`if TYPE_CHECKING:` blocks nor function bodies). Importing `tunelab.a.b` first runs the package
`tunelab.a`, so a module also depends on the packages above what it imports. A second test
counts the imports inside functions too, for every module: a loop there is one an import
deferred to call time hides, not one it removes.

`tunelab plan` works from records alone: run in a fresh process on a study's records, none of
its paths imports torch (nor transformers, peft).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "tunelab"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every module of the package."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(
    tree: ast.Module, inside_functions: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run at import time (or, with `inside_functions`, at any time):
    never those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                pending += node.body
            pending += node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                pending += handler.body
        elif isinstance(node, ast.With | ast.For | ast.While | ast.ClassDef):
            pending += node.body + getattr(node, "orelse", [])
        elif inside_functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            pending += node.body
    return found


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _parents(name: str, importer: str) -> set[str]:
    """The packages above `name` that are not above `importer` too (those are already being
    imported when `importer` runs)."""
    parts = name.split(".")
    above = {".".join(parts[:i]) for i in range(1, len(parts))}
    return above - {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}


def _targets(name: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules a statement names: `from pkg import sub` names the module pkg.sub, and pkg
    itself only when it also takes a name defined there."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = _resolve(name, node, modules[name].name == "__init__.py")
    subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    return subs | ({base} if len(subs) < len(node.names) else set())


def import_graph(
    src: Path = SRC, package: str = PACKAGE, inside_functions: bool = False
) -> dict[str, set[str]]:
    """{module: modules of the package it imports at import time (or at all)}."""
    modules = module_files(src, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps: set[str] = set()
        for node in top_level_imports(tree, inside_functions):
            for target in _targets(name, node, modules):
                if target.split(".")[0] == package:
                    deps |= ({target} | _parents(target, name)) & set(modules)
        deps.discard(name)
        # the root package holds only the version; every module runs it first, harmlessly
        deps.discard(package)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        iters = [iter(sorted(graph[start]))]
        state[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_reads_what_runs_at_import_time(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "from pkg.a.inner import thing\n",
        "pkg/a/inner.py": "from pkg.a import sibling\nthing = 1\n",
        "pkg/a/sibling.py": "",
        "pkg/b.py": (
            "from typing import TYPE_CHECKING\n"
            "import os\n"
            "from pkg.a.inner import thing\n"
            "from . import c\n"
            "try:\n    import pkg.d\nexcept ImportError:\n    pass\n"
            "if TYPE_CHECKING:\n    import pkg.e\n"
            "def later():\n    import pkg.f\n"
            "class Later:\n    import pkg.g\n"
        ),
        "pkg/c.py": "",
        "pkg/d.py": "",
        "pkg/e.py": "",
        "pkg/f.py": "",
        "pkg/g.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    # the package above a module runs first; the package itself only from outside it
    assert graph["pkg.b"] == {"pkg.a", "pkg.a.inner", "pkg.c", "pkg.d", "pkg.g"}
    assert import_graph(tmp_path, "pkg", inside_functions=True)["pkg.b"] == {
        "pkg.a",
        "pkg.a.inner",
        "pkg.c",
        "pkg.d",
        "pkg.f",
        "pkg.g",
    }
    assert graph["pkg.a"] == {"pkg.a.inner"}
    assert graph["pkg.a.inner"] == {"pkg.a.sibling"}
    assert len(import_graph()) > 50


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest cycle through `start` as [start, ..., start], or None (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph.get(node, ())):
                if dep == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if dep not in came_from:
                    came_from[dep] = node
                    nxt.append(dep)
        frontier = nxt
    return None


def test_a_cycle_is_found_and_named():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}
    assert cycle_through(graph, "b") == ["b", "c", "a", "b"]
    assert cycle_through(graph, "d") is None


def test_no_import_cycle_in_tunelab():
    cycle = find_cycle(import_graph())
    if cycle is not None:
        pytest.fail("module-level import cycle: " + " -> ".join(cycle))


def test_no_import_cycle_hidden_inside_functions():
    """An import deferred to call time hides a loop, it does not remove it."""
    graph = import_graph(inside_functions=True)
    cycles = [c for c in (cycle_through(graph, m) for m in sorted(graph)) if c is not None]
    if cycles:
        shortest = min(cycles, key=len)
        pytest.fail("import cycle through imports inside functions: " + " -> ".join(shortest))


# The floors of the house, lowest first: a module imports only from its own floor or those below.
# track (the MLflow mirror) and demo (the packaged example studies) both sit on stages, side by
# side: neither imports the other.
LAYERS = {"core": 0, "lib": 1, "stages": 2, "track": 3, "demo": 3, "cli": 4}

# Edges that still go up, each with why; removing one is progress, adding one needs a reason.
LAYERING_EXCEPTIONS = {
    # training.log_to mirrors the live metrics to MLflow from inside the training loop
    ("tunelab.stages.train.stage", "tunelab.track.live"),
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every edge (importer, imported) that goes to a higher floor, or across track and demo."""
    found = []
    for importer, deps in sorted(graph.items()):
        low = layer_of(importer)
        for dep in sorted(deps):
            high = layer_of(dep)
            if low is None or high is None or high == low:
                continue
            if any(other.startswith(dep + ".") for other in deps):
                continue  # a package above an imported module: that module's edge names it
            if LAYERS[high] > LAYERS[low] or LAYERS[high] == LAYERS[low]:
                found.append((importer, dep))
    return found


def test_upward_imports_are_found():
    graph = {
        "tunelab.core.a": {"tunelab.lib.b"},
        "tunelab.lib.b": {"tunelab.core.a"},
        "tunelab.track.t": {"tunelab.demo", "tunelab.demo.d", "tunelab.stages.s"},
        "tunelab.cli.c": {"tunelab.track.t", "tunelab.core.a"},
    }
    assert upward_imports(graph) == [
        ("tunelab.core.a", "tunelab.lib.b"),
        ("tunelab.track.t", "tunelab.demo.d"),
    ]


def test_layering_core_below_lib_below_stages_below_cli():
    """Imports inside functions count too: a deferred import is still a dependency."""
    found = set(upward_imports(import_graph(inside_functions=True)))
    new = sorted(found - LAYERING_EXCEPTIONS)
    if new:
        pytest.fail(
            "imports that go up a floor (core < lib < stages < track, demo < cli):\n"
            + "\n".join(f"  {a} -> {b}" for a, b in new)
        )
    gone = sorted(LAYERING_EXCEPTIONS - found)
    assert not gone, f"listed exceptions no longer needed (remove them): {gone}"


# a fresh process: the test process has torch imported already
PLAN_CHILD = """
import json, sys
from tunelab.cli import main

out, argv = sys.argv[1], sys.argv[2:]
try:
    main(argv)
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules)
with open(out, "w") as f:
    json.dump({"code": code, "heavy": heavy}, f)
"""


@pytest.mark.parametrize(
    "args",
    [[], ["--review"], ["--gpu", "H100-SXM"], ["--compare-gpus"]],
    ids=["plan", "review", "gpu", "compare-gpus"],
)
@pytest.mark.processes
def test_tunelab_plan_does_not_import_torch(pinned, args, tmp_path):  # noqa: F811
    out = tmp_path / "imported.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", PLAN_CHILD, str(out), "plan", "--study", str(pinned), "--json"]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)
    assert out.exists(), proc.stderr[-2000:]
    found = json.loads(out.read_text())
    assert found["code"] in (0, None), proc.stderr[-2000:]
    assert found["heavy"] == [], f"tunelab plan {' '.join(args)} imported {found['heavy']}"
