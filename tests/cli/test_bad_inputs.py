"""The bad-input corpus (tests/bad_inputs/cases.yaml, files in tests/bad_inputs/files/): every
case is applied to a copy of one finished study (registered hypothesis, data snapshot, baseline,
a completed LoRA run on the tiny BERT with its evaluation and export, and a run interrupted by
SIGTERM), then one `tunelab` command runs. Each must exit with code 2, print `error:` naming the
place (file, line, field, option or record) and a `hint:` with the fix, and leave every record
that existed before byte-identical (sha256 of every file under records/, the ledger's run rows).

A case is a mapping: `name`, `why` (one line), `setup` (a list of steps, below), `cmd` (the
arguments after `tunelab`; `-s STUDY` is added unless `no_study: true`), `expect` (fragments
that must all appear in the error output, case-insensitive) and optionally `new_run: true`
(the command may add one new run record, e.g. a run that failed at model loading, but never
change an old one). A case with `exit: 0` is input tunelab must accept, with a warning: the
command succeeds, the fragments appear in its output, it may add records (a snapshot), and
every old record stays byte-identical.

Setup steps (paths are relative to the study folder; `{run}`, `{run_dir}`, `{ckpt}`,
`{snap}`, `{export}`, `{stopped}`, `{stopped_dir}`, `{stopped_ckpt}`, `{baseline}`,
`{study}`, `{other_base}` are filled in):
  {write: PATH, text: "..."}            write text (`fill: N` puts N x's in place of @FILL@)
  {copy: FILE, to: PATH}                copy tests/bad_inputs/files/FILE
  {append_file: FILE, to: PATH}         append tests/bad_inputs/files/FILE (a bad line after
                                        the 36 good ones of data.jsonl: line 37)
  {append: PATH, text: "..."}           append text
  {yaml: {dotted.key: value}}           set keys of study.yaml (null deletes with `delete: true`)
  {unset: [dotted.key, ...]}            remove keys of study.yaml
  {delete: PATH}                        remove a file, symlink or folder
  {truncate: PATH, keep: 0.5}           keep the first fraction of a file's bytes
  {flip: PATH}                          flip one bit in the middle of a file
  {json: PATH, set: {dotted.key: v}}    edit a JSON record (`merge: {...}` merges a mapping in,
                                        for keys with dots; `rehash: export` recomputes an
                                        export manifest's own sha256)
  {mkdir: PATH}
  {symlink: PATH, to: TARGET}
  {encode: PATH, as: utf-8-sig | utf-16 | gzip | zip}   re-encode a file in place
  {patch: PATH, at: N, hex: "ff00"}     overwrite bytes at offset N
  {edit_header: PATH, replace: [OLD, NEW]}   edit a safetensors header's JSON text (its
                                        length is rewritten; the data stays)
  {reseal: FOLDER}                      recompute the sha256 a checkpoint's state.json or an
                                        export's manifest records, as a forger would
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sqlite3
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import register_study, run_cli, train_stopped_at, tree_hashes, write_topic_study

HERE = Path(__file__).resolve().parents[1] / "bad_inputs"
CASES = yaml.safe_load((HERE / "cases.yaml").read_text(encoding="utf-8"))
# ---------------------------------------------------------------- the finished study


def build_study(root: Path, bert_dir: Path) -> dict[str, str]:
    """register -> data -> baseline -> train -> eval -> export, plus a run stopped by SIGTERM
    after step 2. The base model is copied into the study (`base/`) so a case may damage it.
    Returns the ids the cases refer to."""
    from tunelab.stages.data import stage as data_stage
    from tunelab.stages.evaluate import stage as evaluate_stage
    from tunelab.stages.export import stage as export_stage
    from tunelab.stages.train import stage as train_stage

    root.mkdir(parents=True)
    shutil.copytree(bert_dir, root / "base")
    write_topic_study(root, "base", "bad-inputs", training={"num_threads": 1})
    study = register_study(root, snapshot=False)
    snapshot = data_stage.run(study)["snapshot_id"]
    baseline, _ = evaluate_stage.run(study)
    run = train_stage.run(study, name="lora")
    evaluate_stage.run(study, run.id)
    export, _ = export_stage.run(study, run.id)
    stopped = train_stopped_at(study, 2, "stopped")
    assert stopped.status == "interrupted"
    return {
        "run": run.id,
        "run_dir": f"records/runs/{run.id}",
        "ckpt": f"records/runs/{run.id}/checkpoints/step-000004",
        "snap": f"records/data/{snapshot}",
        "export": str(export.relative_to(study.root)),
        "stopped": stopped.id,
        "stopped_dir": f"records/runs/{stopped.id}",
        "stopped_ckpt": f"records/runs/{stopped.id}/checkpoints/step-000002",
        "baseline": baseline.id,
    }


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory, tiny_bert_dir, tiny_llama_dir) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bad-inputs") / "study"
    ids = build_study(root, tiny_bert_dir)
    ids["other_base"] = str(tiny_llama_dir)
    return root, ids


# ---------------------------------------------------------------- applying a case


def _fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, v in ids.items():
            value = value.replace("{" + key + "}", v)
        return value
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    if isinstance(value, dict):
        return {_fill(k, ids): _fill(v, ids) for k, v in value.items()}
    return value


def _set_dotted(obj: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj.setdefault(p, {})
    obj[last] = value


def _merge(obj: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(obj.get(key), dict):
            _merge(obj[key], value)
        else:
            obj[key] = value


def _unset_dotted(obj: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj[p]
    del obj[last]


def apply_step(root: Path, step: dict[str, Any]) -> None:
    op = next(iter(step))
    path = root / step[op] if isinstance(step[op], str) else None
    if op == "write":
        path.parent.mkdir(parents=True, exist_ok=True)
        text = step["text"].replace("@FILL@", "x" * int(step.get("fill", 0)))
        path.write_bytes(text.encode("utf-8"))
    elif op == "copy":
        target = root / step["to"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / "files" / step["copy"], target)
    elif op == "append_file":
        with open(root / step["to"], "ab") as f:
            f.write((HERE / "files" / step["append_file"]).read_bytes())
    elif op == "append":
        with open(path, "ab") as f:
            f.write(step["text"].encode("utf-8"))
    elif op == "yaml":
        raw = yaml.safe_load((root / "study.yaml").read_text())
        for key, value in step["yaml"].items():
            _set_dotted(raw, key, value)
        (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    elif op == "unset":
        raw = yaml.safe_load((root / "study.yaml").read_text())
        for key in step["unset"]:
            _unset_dotted(raw, key)
        (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    elif op == "delete":
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    elif op == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * float(step.get("keep", 0.5)))])
    elif op == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif op == "json":
        obj = json.loads(path.read_text(encoding="utf-8"))
        for key, value in step.get("set", {}).items():
            _set_dotted(obj, key, value)
        _merge(obj, step.get("merge", {}))
        if step.get("rehash") == "export":
            from tunelab.stages.export import manifest_sha256

            obj["manifest_sha256"] = manifest_sha256(obj)
        path.write_text(json.dumps(obj, indent=2))
    elif op == "mkdir":
        path.mkdir(parents=True, exist_ok=True)
    elif op == "symlink":
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(step["to"], path)
    elif op == "patch":
        data = bytearray(path.read_bytes())
        new = bytes.fromhex(step["hex"])
        data[step["at"] : step["at"] + len(new)] = new
        path.write_bytes(bytes(data))
    elif op == "edit_header":
        data = path.read_bytes()
        size = int.from_bytes(data[:8], "little")
        old, new = step["replace"]
        header = data[8 : 8 + size].decode("utf-8").replace(old, new, 1).encode("utf-8")
        path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + size :])
    elif op == "reseal":
        reseal(path)
    elif op == "encode":
        data = path.read_bytes()
        if step["as"] == "gzip":
            path.write_bytes(gzip.compress(data, mtime=0))
        elif step["as"] == "zip":
            with zipfile.ZipFile(path.with_suffix(".tmp"), "w") as z:
                z.writestr(path.name, data)
            os.replace(path.with_suffix(".tmp"), path)
        else:
            path.write_bytes(data.decode("utf-8").encode(step["as"]))
    else:
        raise AssertionError(f"unknown setup step {op!r}")


def reseal(folder: Path) -> None:
    """Make a checkpoint's state.json or an export's manifest agree with the files again."""
    from tunelab.core.hashing import sha256_file

    state = folder / "state.json"
    if state.exists():
        obj = json.loads(state.read_text(encoding="utf-8"))
        obj["files"] = {name: sha256_file(folder / name) for name in obj["files"]}
        state.write_text(json.dumps(obj, indent=2))
        return
    from tunelab.stages.export.manifest import MANIFEST, manifest_sha256

    obj = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    obj["files"] = {rel: sha256_file(folder / rel) for rel in obj["files"]}
    obj["manifest_sha256"] = manifest_sha256(obj)
    (folder / MANIFEST).write_text(json.dumps(obj, indent=2))


def run_rows(root: Path) -> dict[str, tuple]:
    """The ledger's run rows (read-only), by id."""
    db = sqlite3.connect(f"file:{root / 'records' / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return {r[0]: r for r in db.execute("SELECT * FROM runs").fetchall()}
    finally:
        db.close()


# ---------------------------------------------------------------- the corpus


def test_corpus_is_large_and_well_formed():
    names = [c["name"] for c in CASES]
    assert len(names) >= 40 and len(set(names)) == len(names)
    for case in CASES:
        assert {"name", "why", "cmd", "expect"} <= set(case), case.get("name")
        assert set(case) <= {"name", "why", "setup", "cmd", "expect", "no_study", "new_run", "exit"}
    kinds = {c["name"].split("_")[0] for c in CASES}
    assert {"data", "config", "cli", "checkpoint", "export", "snapshot"} <= kinds, kinds
    used = {
        s.get("copy") or s.get("append_file")
        for c in CASES
        for s in c.get("setup", [])
        if "copy" in s or "append_file" in s
    }
    assert used == {p.name for p in (HERE / "files").iterdir()}  # no stray file in the corpus


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input(case, finished_study, tmp_path, capsys):
    source, ids = finished_study
    root = tmp_path / "study"
    shutil.copytree(source, root, symlinks=True)
    ids = {**ids, "study": str(root)}
    for step in case.get("setup", []):
        apply_step(root, _fill(step, ids))
    before, rows_before = tree_hashes(root / "records"), run_rows(root)

    args = [str(a) for a in _fill(case["cmd"], ids)]
    if not case.get("no_study"):
        args += ["-s", str(root)]
    code, out, err = run_cli(capsys, *args)
    after, rows_after = tree_hashes(root / "records"), run_rows(root)
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert not changed, f"records changed or removed: {changed}"
    assert {i: rows_after[i] for i in rows_before} == rows_before, "a run row changed"

    if case.get("exit") == 0:  # accepted with a warning
        assert code == 0, f"exit code {code}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
        text = " ".join((out + err).split()).lower()
        for fragment in _fill(case["expect"], ids):
            assert " ".join(str(fragment).split()).lower() in text, (fragment, out + err)
        return
    assert code == 2, f"exit code {code}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
    text = " ".join(err.split()).lower()  # rich wraps long lines
    assert "error:" in text and "hint:" in text, err
    assert "traceback" not in text, err
    for fragment in _fill(case["expect"], ids):
        assert " ".join(str(fragment).split()).lower() in text, (fragment, err)

    added = sorted(set(after) - set(before))
    new_rows = set(rows_after) - set(rows_before)
    if case.get("new_run"):  # at most one new run, its files in its own folder
        assert len(new_rows) <= 1, new_rows
        assert all(any(a.startswith(f"runs/{r}/") for r in new_rows) for a in added), added
    else:
        assert not new_rows and not added, f"new records: {added}"
