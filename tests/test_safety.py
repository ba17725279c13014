"""Safe loading, checked on the source itself: no pickle, no torch.load without weights_only=True,
no remote code unless the config asks for it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tunelab"


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.expr) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _sources():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_pickle_anywhere():
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(
                    n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib") for n in names
                ), f"{path}:{node.lineno} imports a pickle module"
        for call in _calls(tree):
            assert _name(call.func) not in ("torch.save",), (
                f"{path}:{call.lineno} torch.save pickles; use safetensors"
            )


def test_torch_load_only_with_weights_only():
    for path, tree in _sources():
        for call in _calls(tree):
            if _name(call.func).endswith("torch.load"):
                kw = {k.arg: k.value for k in call.keywords}
                ok = (
                    isinstance(kw.get("weights_only"), ast.Constant)
                    and kw["weights_only"].value is True
                )
                assert ok, f"{path}:{call.lineno} torch.load without weights_only=True"


def test_remote_code_only_from_config():
    for path, tree in _sources():
        for call in _calls(tree):
            for k in call.keywords:
                if k.arg == "trust_remote_code":
                    assert not (isinstance(k.value, ast.Constant) and k.value.value is True), (
                        f"{path}:{call.lineno} hard-codes trust_remote_code=True"
                    )
