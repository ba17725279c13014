"""No function of the package runs over MAX_LINES lines (outside `stages/report/`, whose section
builders are page templates): a longer one is split into named steps.

Read from the source with `ast`: a function's lines run from its `def` to its last statement,
its docstring and nested functions included. `EXCEPTIONS` names the few functions still longer,
each with its reason; one that gets short enough must leave the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tunelab"
MAX_LINES = 80
EXEMPT = ("stages/report",)
# "path:function" -> why it is still longer than MAX_LINES
EXCEPTIONS: dict[str, str] = {}


def long_functions(
    root: Path = SRC, limit: int = MAX_LINES, exempt: tuple[str, ...] = EXEMPT
) -> list[str]:
    """`path:line name (N lines)` for every function over `limit` lines under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(rel.as_posix().startswith(f"{folder}/") for folder in exempt):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_check_counts_nested_and_skips_the_exempt(tmp_path):
    lines = "".join(f"        x{i} = {i}\n" for i in range(5))
    (tmp_path / "a.py").write_text(
        "def short():\n    pass\n\n\nclass K:\n    def method(self):\n"
        + lines
        + "        def inner():\n"
        + lines.replace("        ", "            ")
    )
    (tmp_path / "stages" / "report").mkdir(parents=True)
    (tmp_path / "stages" / "report" / "b.py").write_text(
        "def page():\n" + lines.replace("        ", "    ")
    )
    assert long_functions(tmp_path, limit=4) == [
        "a.py:6 method (12 lines)",
        "a.py:12 inner (6 lines)",
    ]
    assert long_functions(tmp_path, limit=4, exempt=())[-1] == "stages/report/b.py:1 page (6 lines)"
    assert long_functions(tmp_path, limit=12) == []


def _key(found: str) -> str:
    """'path:line name (N lines)' -> 'path:name'."""
    where, name = found.split(" ")[:2]
    return f"{where.rsplit(':', 1)[0]}:{name}"


def test_no_function_over_the_limit():
    assert len(list(SRC.rglob("*.py"))) > 50
    found = long_functions()
    over = [f for f in found if _key(f) not in EXCEPTIONS]
    assert over == [], f"split these into named steps (at most {MAX_LINES} lines)"
    still_long = {_key(f) for f in found}
    short_now = sorted(k for k in EXCEPTIONS if k not in still_long)
    assert short_now == [], f"no longer over {MAX_LINES} lines: remove from EXCEPTIONS"
