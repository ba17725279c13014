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
    else:  # a method of a computed value (`model.to(d).eval()`), not the builtin `eval`
        parts.append("<expr>")
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


def _assignments(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """name -> every expression assigned to it anywhere in the module."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
    return out


def test_remote_code_flag_comes_from_the_config_or_a_record():
    """Every trust_remote_code passed to transformers is read from model.trust_remote_code (the
    config), a base identity or an export manifest that recorded it; never computed or literal."""
    found = 0
    for path, tree in _sources():
        assigned = _assignments(tree)
        values = [
            (call.lineno, k.value)
            for call in _calls(tree)
            for k in call.keywords
            if k.arg == "trust_remote_code"
        ]
        values += [
            (node.lineno, v)
            for node in ast.walk(tree)
            if isinstance(node, ast.Dict)
            for key, v in zip(node.keys, node.values, strict=True)
            if isinstance(key, ast.Constant) and key.value == "trust_remote_code"
        ]
        for lineno, value in values:
            found += 1
            sources = [value]
            if isinstance(value, ast.Name) and value.id in assigned:
                sources = assigned[value.id]
            for src in sources:
                assert "trust_remote_code" in ast.unparse(src), (
                    f"{path}:{lineno} trust_remote_code={ast.unparse(value)} does not come from "
                    "the config or a record"
                )
    assert found >= 3


def test_no_unsafe_deserializers():
    """Nothing that can run code while reading: YAML only through safe_load, no numpy pickles,
    no marshal/shelve, no eval/exec, no transformers weights outside safetensors on purpose."""
    banned_calls = {
        "yaml.load",
        "yaml.unsafe_load",
        "yaml.full_load",
        "marshal.loads",
        "marshal.load",
        "shelve.open",
        "eval",
        "exec",
    }
    for path, tree in _sources():
        for call in _calls(tree):
            name = _name(call.func)
            assert name not in banned_calls, f"{path}:{call.lineno} calls {name}"
            for k in call.keywords:
                if k.arg == "allow_pickle":
                    assert isinstance(k.value, ast.Constant) and k.value.value is False, (
                        f"{path}:{call.lineno} allow_pickle"
                    )
                if k.arg == "use_safetensors":
                    assert isinstance(k.value, ast.Constant) and k.value.value is True, (
                        f"{path}:{call.lineno} use_safetensors={ast.unparse(k.value)}"
                    )


def test_safe_join_keeps_paths_inside(tmp_path):
    from tunelab.core.errors import StudyError
    from tunelab.core.records import safe_join

    root = tmp_path / "export"
    (root / "adapter").mkdir(parents=True)
    (root / "adapter" / "a.json").write_text("{}")
    assert safe_join(root, "adapter/a.json") == (root / "adapter" / "a.json").resolve()
    assert safe_join(root, "adapter/../adapter/a.json") == (root / "adapter" / "a.json").resolve()
    (tmp_path / "secret.txt").write_text("x")
    (root / "link").symlink_to(tmp_path / "secret.txt")
    (root / "dirlink").symlink_to(tmp_path)
    for bad in ("../secret.txt", "/etc/passwd", "adapter/../../secret.txt", "link", "dirlink/x"):
        try:
            safe_join(root, bad)
        except StudyError as exc:
            assert "escapes" in exc.message
        else:
            raise AssertionError(f"{bad!r} was let out of {root}")


def test_record_readers_refuse_paths_out_of_their_folder():
    """Where a record names a path (export manifests, checkpoints/final), the reader goes through
    safe_join or an equivalent check; tests/bad_inputs/cases.yaml exercises each one."""
    export = (SRC / "stages" / "export" / "check.py").read_text(encoding="utf-8")
    assert "safe_join" in export
    checkpoint = (SRC / "stages" / "train" / "layout.py").read_text(encoding="utf-8")
    assert "not a checkpoint of this run" in checkpoint
    import yaml

    cases = yaml.safe_load(
        (SRC.parents[1] / "tests" / "bad_inputs" / "cases.yaml").read_text(encoding="utf-8")
    )
    names = {c["name"] for c in cases}
    assert {
        "export_manifest_path_escape",
        "export_symlink_escape",
        "checkpoint_final_link_escapes_run",
        "cli_snapshot_id_escapes",
        "cli_run_id_escapes",
    } <= names
