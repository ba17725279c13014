"""`tunelab export` and `tunelab check-export`: a trained model bound to its exact base.

An export folder (`records/exports/<id>/`, or `--out DIR`), written atomically:

```
adapter/                 LoRA: adapter_config.json + adapter_model.safetensors (peft format;
                         an encoder's classification head is inside, in modules_to_save)
model/                   full or freeze: config.json + model.safetensors (save_pretrained)
tokenizer/               the base's tokenizer files, byte for byte
example.json             one validation example with its recorded prediction
README.md                the model card
tunelab-manifest.json    base identity (sha256 of every weight and tokenizer file), config,
                         data snapshot, hypothesis, environment, metrics against the baseline,
                         guardrails, limitations, sha256 of every exported file, and its own
                         sha256 (`manifest_sha256`, over the manifest without that field)
```

`check_export(dir, base)` refuses an edited manifest, a changed or added file, any pickle file,
and a base folder whose files do not match the recorded hashes (ExportError listing each file);
then it loads the base with the adapter (plain `PeftModel.from_pretrained`) or the full model and
runs the recorded example. Nothing is pickled: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunelab.config import sha256_json
from tunelab.errors import EvaluationError, ExportError, HypothesisError, RunError, StudyError
from tunelab.records import (
    dumps_json,
    publish_dir,
    read_json,
    remove_tree,
    safe_join,
    sha256_file,
    temp_dir_beside,
    write_bytes_atomic,
    write_json_atomic,
)

MANIFEST = "tunelab-manifest.json"
FORMAT = "tunelab-export/1"
# Files that hold (or may hold) pickled Python objects: never exported, never loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
TOKENIZER_DIR = "tokenizer"
EXAMPLE_FILE = "example.json"
# Files of the export folder that are not listed in the manifest's file hashes.
UNLISTED = {MANIFEST, "DONE"}


class ExampleMismatch(ExportError):
    """The exported model's output on the recorded example differs from the recording (exit 1)."""

    exit_code = 1


# ---------------------------------------------------------------- pure parts


def manifest_sha256(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own `manifest_sha256` field."""
    return sha256_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})


def regressions(comparison: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Categories and fields whose metrics went down against the baseline (delta < 0)."""
    if not comparison:
        return []
    out = []
    for table, keys in (("per_category", ("f1",)), ("per_field", ("f1", "normalized_match"))):
        for item, row in (comparison.get(table) or {}).items():
            for key in keys:
                entry = (row or {}).get(key) or {}
                delta = entry.get("delta")
                if delta is not None and delta < 0:
                    out.append(
                        {
                            "scope": table.removeprefix("per_"),
                            "item": item,
                            "metric": key,
                            "baseline": entry.get("baseline"),
                            "variant": entry.get("variant"),
                            "delta": delta,
                        }
                    )
    return out


def failure_kinds(predictions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How predictions failed: parse/format failure kinds (generation tasks) and the most
    frequent confusions (classification)."""
    kinds: Counter[str] = Counter()
    confusions: Counter[str] = Counter()
    for p in predictions:
        failure = (p.get("verdicts") or {}).get("failure")
        if isinstance(failure, Mapping):
            failure = failure.get("kind") or failure.get("failure")
        if failure:
            kinds[str(failure)] += 1
        elif p.get("correct") is False and isinstance(p.get("prediction"), str):
            confusions[f"{p.get('gold')} -> {p.get('prediction')}"] += 1
    return {
        "n": len(predictions),
        "failures": dict(kinds.most_common()),
        "top_confusions": dict(confusions.most_common(5)),
    }


def limitation_lines(detail: Mapping[str, Any]) -> list[str]:
    """The limitations as sentences (the model card and the dossier print them)."""
    lines = []
    if detail.get("not_compared"):
        lines.append(f"Not compared with the baseline: {detail['not_compared']}")
    for r in detail.get("regressed") or []:
        lines.append(
            f"{r['scope']} {r['item']!r}: {r['metric']} went down against the baseline "
            f"({_num(r['baseline'])} -> {_num(r['variant'])}, {r['delta']:+.4f})"
        )
    for g in detail.get("guardrails_failed") or []:
        where = f" for {g['item']!r}" if g.get("item") is not None else ""
        lines.append(
            f"guardrail failed{where}: {g['rule']} (value {_num(g.get('value'))}, bound "
            f"{_num(g.get('bound'))}){'; ' + g['note'] if g.get('note') else ''}"
        )
    fk = detail.get("failure_kinds") or {}
    if fk.get("failures"):
        shown = ", ".join(f"{k}: {v}" for k, v in fk["failures"].items())
        lines.append(f"failure kinds in {fk['n']} validation predictions: {shown}")
    if fk.get("top_confusions"):
        shown = ", ".join(f"{k} ({v})" for k, v in fk["top_confusions"].items())
        lines.append(f"most frequent confusions on validation: {shown}")
    for split, t in (detail.get("truncation") or {}).items():
        if t.get("truncated"):
            lines.append(
                f"{t['truncated']} of {t['n']} {split} examples ({t['share']:.1%}) were truncated "
                f"to preprocess.max_seq_len"
            )
    openings = detail.get("test_openings")
    if openings is not None:
        if openings == 0:
            lines.append("the sealed test split was never opened: no test-set result exists")
        elif openings > 1:
            lines.append(
                f"the sealed test split was opened {openings} times: test results are biased "
                "by the choices made between openings"
            )
        else:
            lines.append("the sealed test split was opened once")
    if detail.get("verify") is None:
        lines.append("the checkpoint was not verified in a fresh process (`tunelab verify`)")
    elif not detail["verify"].get("passed"):
        lines.append(f"the latest `tunelab verify` failed: {detail['verify'].get('reason')}")
    for note in detail.get("notes") or []:
        lines.append(f"note: {note}")
    return lines


def _num(x: Any) -> str:
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))


# ---------------------------------------------------------------- building an export


def new_export_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"export-{stamp}-{secrets.token_hex(3)}"


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() not in UNLISTED
    }


def _no_pickle(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES)
    )


def _copy_files(src: Path, dst: Path, names: Sequence[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)


def _write_adapter(ckpt: Path, dst: Path, base_name: str) -> None:
    """Copy the checkpoint's peft adapter; base_model_name_or_path names the base, not a local
    path of the training machine."""
    src = ckpt / "adapter"
    names = [p.name for p in sorted(src.iterdir()) if p.suffix in (".json", ".safetensors")]
    if "adapter_model.safetensors" not in names or "adapter_config.json" not in names:
        raise ExportError(
            f"{src}: not a complete peft adapter (adapter_config.json, adapter_model.safetensors)",
            hint="the checkpoint is damaged; `tunelab verify RUN` says which file",
        )
    _copy_files(src, dst, [n for n in names if n != "adapter_config.json"])
    config = json.loads((src / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_name
    (dst / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_full_model(study: Any, run: Any, ckpt: Path, dst: Path, method: str) -> None:
    """The whole model in safetensors: a full run's checkpoint as is; a freeze run's trained
    tensors merged into the base (save_pretrained)."""
    src = ckpt / "model"
    if method == "full" and (src / "config.json").exists():
        names = [p.name for p in sorted(src.iterdir()) if p.suffix in (".json", ".safetensors")]
        _copy_files(src, dst, names)
        return
    from tunelab.models._quiet import quiet_transformers
    from tunelab.train import load_run_model

    model, _, _ = load_run_model(study, run, device="cpu")  # merged and saved, not computed on
    with quiet_transformers():
        model.save_pretrained(dst, safe_serialization=True)


def _truncation(
    study: Any, run: Any, cfg: Any, base: Any, snapshot: Any, labels: Any
) -> dict[str, Any]:
    """Share of train and validation examples cut by preprocess.max_seq_len.

    The run counted them when it encoded its splits (preprocess.json) with the tokenizer whose
    hash the export has just checked, its own config and its own snapshot: the same numbers as
    encoding again, without loading the tokenizer. Runs recorded before it counted both splits
    are encoded again."""
    path = run.path("preprocess.json")
    recorded = read_json(path) if path.exists() else {}
    splits = {s: recorded.get(s) for s in ("train", "validation")}
    if all(isinstance(v, dict) and "truncated" in v and "n" in v for v in splits.values()):
        # length_stats' share_truncated, None for an empty split
        return {
            s: {"n": v["n"], "truncated": v["truncated"], "share": v["share_truncated"] or 0.0}
            for s, v in splits.items()
        }
    from tunelab.models import load_tokenizer
    from tunelab.preprocess import Preprocessor
    from tunelab.tasks import get_task

    tokenizer = load_tokenizer(base)
    pre = Preprocessor(tokenizer, cfg, get_task(cfg, labels), base.architecture)
    out = {}
    for split in ("train", "validation"):
        rows = snapshot.rows(split)
        cut = sum(1 for r in rows if pre.encode(r).get("truncated"))
        out[split] = {"n": len(rows), "truncated": cut, "share": cut / len(rows) if rows else 0.0}
    return out


def _comparison(study: Any, run_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """The run against the latest baseline on validation (compare's record row), or why not."""
    from tunelab.compare import compare_study

    try:
        record = compare_study(study, [run_id])
    except (EvaluationError, HypothesisError, RunError) as exc:
        return None, exc.message
    entry = next((e for e in record["runs"] if e["run_id"] == run_id), None)
    if entry is None or not entry.get("compared"):
        return None, (entry or {}).get("not_compared_reason") or "no comparison row"
    entry = dict(entry)
    entry.pop("flips", None)  # example ids: in the compare records, not in the model card
    entry["baseline"] = record["baseline"]
    entry["bootstrap"] = record["bootstrap"]
    return entry, None


def _latest_verify(run: Any) -> dict[str, Any] | None:
    found = []
    for p in run.dir.glob("verify-*.json"):
        try:
            found.append((int(p.stem.split("-")[1]), p))
        except ValueError:
            continue
    if not found:
        return None
    rec = read_json(max(found)[1])
    return {k: rec.get(k) for k in ("record", "passed", "reason", "finished_at", "environment")}


def _env_summary(env: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not env:
        return None
    return {
        "python": env.get("python"),
        "torch": env.get("torch"),
        "backend": env.get("backend"),
        "cuda": env.get("cuda"),
        "rocm": env.get("rocm"),
        "gpus": [g.get("name") for g in env.get("gpus") or []],
        "cpu": (env.get("cpu") or {}).get("name"),
        "packages": env.get("packages"),
        "tunelab_git": env.get("tunelab_git"),
    }


def export_run(
    study: Any,
    run_id: str,
    *,
    out: Path | str | None = None,
    notes: Sequence[str] = (),
) -> tuple[Path, dict[str, Any]]:
    """`tunelab export RUN`: write the export folder; returns (folder, manifest).

    Refuses a run that is not a completed training run, a damaged checkpoint, a base model that
    changed since training, and an existing destination.
    """
    import torch  # noqa: F401 (capture_env reads its build; imported before the timer starts)

    from tunelab import __version__
    from tunelab.data import load_snapshot
    from tunelab.env import capture_env
    from tunelab.evaluate import find_evaluation, load_predictions
    from tunelab.hypothesis import latest_hypothesis
    from tunelab.models import resolve_model, verify_identity
    from tunelab.models.identity import TOKENIZER_FILES
    from tunelab.train.layout import final_checkpoint
    from tunelab.verify import check_checkpoint_files

    # the export's own work, timed like the ledger times a run: after its libraries are imported
    started = time.perf_counter()
    run = study.get_run(run_id)
    row = run.row
    if row.kind != "train":
        hint = (
            f"export the run it evaluates: `tunelab export {row.parent}`"
            if row.kind == "eval"
            else "export a completed training run (`tunelab runs --kind train`)"
        )
        raise ExportError(f"run {row.id} is a {row.kind} run, not a training run", hint=hint)
    if row.status != "completed":
        raise ExportError(
            f"run {row.id} is {row.status}" + (f" ({row.reason})" if row.reason else ""),
            hint="only a completed run is exported",
        )
    export_id = new_export_id()
    final = Path(out).resolve() if out else study.records / "exports" / export_id
    if final.exists():
        raise ExportError(
            f"{final} already exists; an export is never written over another",
            hint="choose a new --out folder (or leave --out away for records/exports/<id>)",
        )
    record = read_json(run.path("config.json"))
    from tunelab.config import validate_config

    cfg = validate_config(record["config"], source=str(run.path("config.json")))
    method = cfg.adaptation.method
    ckpt = final_checkpoint(run.dir / "checkpoints")
    if ckpt is None:
        raise ExportError(f"run {row.id} has no final checkpoint", hint="the run is incomplete")
    files_check = check_checkpoint_files(ckpt)
    if not files_check["ok"]:
        raise ExportError(
            f"checkpoint {ckpt} does not match the sha256 recorded when it was written: "
            + ", ".join(files_check["changed"] + files_check["missing"]),
            hint=f"the checkpoint is damaged; `tunelab verify {row.id}` records the check",
        )
    base = resolve_model(cfg.model, root=study.root)
    identity = record.get("base_model") or base.identity
    try:
        verify_identity(identity, base.path)
    except Exception as exc:  # ModelError: say it as an export refusal
        raise ExportError(
            f"the base model changed since run {row.id} trained: {getattr(exc, 'message', exc)}",
            hint="restore the base the run was trained on, then export again",
        ) from None
    snapshot = load_snapshot(study, row.data_snapshot)
    labels = record.get("labels")
    hyp_all = latest_hypothesis(study.records)
    hypothesis = None
    if hyp_all:
        hypothesis = {
            "version": record.get("hypothesis_version"),
            "sha256": record.get("hypothesis_sha256"),
            "latest_version": hyp_all["version"],
            **(hyp_all["content"]["hypothesis"] if hyp_all else {}),
        }
    comparison, not_compared = _comparison(study, row.id)
    evaluation = find_evaluation(study, row.id, "validation")
    predictions = load_predictions(evaluation) if evaluation else []
    verdicts = (comparison or {}).get("guardrails") or []
    openings = study.ledger.test_openings()
    detail = {
        "not_compared": not_compared,
        "regressed": regressions(comparison),
        "guardrails_failed": [v for v in verdicts if not v["pass"]],
        "failure_kinds": failure_kinds(predictions),
        "truncation": _truncation(study, run, cfg, base, snapshot, labels),
        "test_openings": len(openings),
        "test_openings_log": openings,
        "verify": _latest_verify(run),
        "notes": [n for n in notes if n and n.strip()],
    }
    run_env = read_json(run.path("env.json")) if run.path("env.json").exists() else None

    tmp = temp_dir_beside(final)
    try:
        artifact_dir = "adapter" if method == "lora" else "model"
        if method == "lora":
            _write_adapter(ckpt, tmp / "adapter", identity.get("name") or str(base.path))
        else:
            _write_full_model(study, run, ckpt, tmp / "model", method)
        tok_names = [n for n in identity["files"] if n in TOKENIZER_FILES]
        _copy_files(base.path, tmp / TOKENIZER_DIR, tok_names)
        example = None
        if predictions:
            first = predictions[0]
            rows = {r["id"]: r for r in snapshot.rows("validation")}
            if first["id"] in rows:
                example = {"example": rows[first["id"]], "recorded": first}
                write_json_atomic(tmp / EXAMPLE_FILE, example)
        pickled = _no_pickle(tmp)
        if pickled:
            raise ExportError(
                f"the export would hold pickle files: {pickled}", hint="only safetensors and JSON"
            )
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "export_id": export_id if not out else final.name,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "tunelab_version": __version__,
            "study": cfg.name,
            "run_id": row.id,
            "run_name": row.name,
            "run_parent": row.parent,
            "run_why": row.why,
            "artifact": {
                "kind": "adapter" if method == "lora" else "model",
                "dir": artifact_dir,
                "method": method,
                "format": "peft" if method == "lora" else "transformers",
                "weights": "safetensors",
            },
            "tokenizer_dir": TOKENIZER_DIR,
            "base": {
                **{k: v for k, v in identity.items() if k != "path"},
                "architecture": base.architecture,
                "path_at_export": str(base.path),
            },
            "task": {
                "kind": cfg.task.kind,
                "labels": labels,
                "fields": (cfg.task.json_schema or {}).get("required"),
            },
            "config": record["config"],
            "config_sha256": record.get("config_sha256"),
            "adaptation": cfg.adaptation.model_dump(mode="json"),
            "training": cfg.training.model_dump(mode="json"),
            "template_sha256": (evaluation or {}).get("record", {}).get("template_sha256"),
            "data_snapshot": row.data_snapshot,
            "hypothesis": hypothesis,
            "environment": {
                "training": _env_summary(run_env),
                "export": _env_summary(capture_env()),
            },
            "results": comparison,
            "evaluation_run": (evaluation or {}).get("eval_run"),
            "guardrails": {
                "pass": None if comparison is None else comparison.get("guardrails_pass"),
                "verdicts": verdicts,
            },
            "limitations": limitation_lines(detail),
            "limitations_detail": detail,
            "example": EXAMPLE_FILE if example else None,
        }
        readme = model_card(manifest)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        manifest["files"] = _tree_hashes(tmp)
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        write_bytes_atomic(tmp / MANIFEST, dumps_json(manifest).encode("utf-8"))
        path = publish_dir(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    # its duration, for `tunelab plan --review` (the manifest's created_at is taken mid-way)
    study.ledger.add_event(
        row.id,
        "export",
        {
            "export_id": manifest["export_id"],
            "path": str(path),
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    return path, manifest


# ---------------------------------------------------------------- the model card


def model_card(m: Mapping[str, Any]) -> str:
    """README.md of an export, from its manifest."""
    base = m["base"]
    art = m["artifact"]
    task = m["task"]
    hyp = m.get("hypothesis") or {}
    lines = [
        f"# {m['study']}: {art['method']} fine-tune of {base.get('name')}",
        "",
        f"Exported by tunelab {m['tunelab_version']} from run `{m['run_id']}` "
        f"({m['created_at']}). Manifest: `{MANIFEST}`.",
        "",
        "## What it is for",
        "",
        f"- Task: {task['kind']}"
        + (f", labels {', '.join(task['labels'])}" if task.get("labels") else "")
        + (f", fields {', '.join(task['fields'])}" if task.get("fields") else ""),
        f"- Hypothesis v{hyp.get('version')}: {hyp.get('behaviour')}",
        f"- Primary metric: {hyp.get('primary_metric')} (must improve by at least "
        f"{hyp.get('min_improvement')})",
        "",
        "## Base model (verified by hash before loading)",
        "",
        f"- Name: {base.get('name')}, revision {base.get('revision') or '-'}",
        f"- Architecture: {base.get('architecture')}",
        f"- Identity sha256: `{base.get('sha256')}`",
        "",
        "| file | sha256 |",
        "|---|---|",
        *[f"| {n} | `{h}` |" for n, h in sorted((base.get("files") or {}).items())],
        "",
        "## Results on the validation split",
        "",
    ]
    res = m.get("results")
    if not res:
        lines.append("Not compared with a baseline (see limitations).")
    else:
        lines += [
            f"Against baseline `{res['baseline']['run_id']}`, {res.get('n_paired')} paired "
            f"examples, 95% paired bootstrap intervals.",
            "",
            "| metric | baseline | this model | delta | 95% CI |",
            "|---|---|---|---|---|",
        ]
        for name, v in (res.get("metrics") or {}).items():
            ci = (
                f"[{_num(v.get('ci_low'))}, {_num(v.get('ci_high'))}]"
                if v.get("ci_low") is not None
                else "-"
            )
            lines.append(
                f"| {name} | {_num(v.get('baseline'))} | {_num(v.get('variant'))} | "
                f"{_num(v.get('delta'))} | {ci} |"
            )
    lines += ["", "## Guardrails", ""]
    g = m.get("guardrails") or {}
    if not g.get("verdicts"):
        lines.append("Not checked.")
    else:
        lines.append(f"All pass: {g.get('pass')}.")
        lines.append("")
        lines += ["| rule | item | value | bound | pass |", "|---|---|---|---|---|"]
        for v in g["verdicts"]:
            lines.append(
                f"| {v['rule']} | {v.get('item') if v.get('item') is not None else '-'} | "
                f"{_num(v.get('value'))} | {_num(v.get('bound'))} | {v['pass']} |"
            )
    lines += ["", "## Limitations", ""]
    lines += [f"- {line}" for line in m.get("limitations") or []] or ["- none recorded"]
    adapter = art["kind"] == "adapter"
    arch = base.get("architecture")
    auto = "AutoModelForSequenceClassification" if arch == "encoder" else "AutoModelForCausalLM"
    head = f", num_labels={len(task['labels'])}" if arch == "encoder" and task.get("labels") else ""
    lines += [
        "",
        "## Loading",
        "",
        "Check the base first (refuses a base whose files differ by one byte):",
        "",
        "```",
        "tunelab check-export THIS_FOLDER --base /path/to/base",
        "```",
        "",
        "```python",
        f"from transformers import AutoTokenizer, {auto}",
    ]
    if adapter:
        lines += [
            "from peft import PeftModel",
            "",
            f'base = {auto}.from_pretrained("/path/to/base"{head})',
            'model = PeftModel.from_pretrained(base, "THIS_FOLDER/adapter")',
        ]
    else:
        lines += ["", f'model = {auto}.from_pretrained("THIS_FOLDER/model")']
    lines += [
        'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER/tokenizer")',
        "```",
        "",
        "## Training",
        "",
        f"- Adaptation: {json.dumps(m.get('adaptation'), sort_keys=True)}",
        f"- Training: {json.dumps(m.get('training'), sort_keys=True)}",
        f"- Data snapshot: `{m.get('data_snapshot')}`",
        f"- Config sha256: `{m.get('config_sha256')}`",
    ]
    env = (m.get("environment") or {}).get("training") or {}
    if env:
        lines.append(
            f"- Environment: torch {env.get('torch')}, backend {env.get('backend')}, "
            f"devices {', '.join(env.get('gpus') or []) or env.get('cpu')}"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- checking an export


def _read_manifest(export_dir: Path) -> dict[str, Any]:
    path = export_dir / MANIFEST
    if not path.is_file():
        raise ExportError(
            f"{export_dir}: no {MANIFEST}; not a tunelab export",
            hint="point check-export at a folder written by `tunelab export`",
        )
    try:
        manifest = read_json(path)
    except StudyError as exc:
        raise ExportError(exc.message, hint="the manifest is damaged; export again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ExportError(
            f"{path}: unknown manifest format {manifest.get('format')!r}",
            hint=f"expected {FORMAT}",
        )
    return manifest


def _safe(root: Path, rel: str) -> Path:
    try:
        return safe_join(root, rel)
    except StudyError as exc:
        raise ExportError(
            f"manifest names a path outside the export: {exc.message}",
            hint="the manifest was edited; do not load this export",
        ) from None


def check_files(export_dir: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's own sha256, each exported file's sha256, no extra and no pickle file."""
    problems = []
    if manifest.get("manifest_sha256") != manifest_sha256(manifest):
        problems.append(f"{MANIFEST}: content does not match its manifest_sha256 (edited)")
    listed = manifest.get("files") or {}
    for rel, digest in sorted(listed.items()):
        f = _safe(export_dir, rel)
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{rel}: sha256 {sha256_file(f)[:12]}..., expected {digest[:12]}...")
    for rel in sorted(set(_tree_hashes(export_dir)) - set(listed)):
        problems.append(f"{rel}: not in the manifest (added after export)")
    pickled = _no_pickle(export_dir)
    for rel in pickled:
        problems.append(f"{rel}: pickle format, refused")
    if problems:
        raise ExportError(
            f"export {export_dir} does not match its manifest:\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="the export was changed after it was written; export the run again",
        )
    return {"files_checked": len(listed), "manifest_sha256": manifest["manifest_sha256"]}


def check_base(base_path: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Every recorded base file (weights, tokenizer, config) must be in `base_path` with the
    recorded sha256, and no unrecorded weight file may be there."""
    from tunelab.models.identity import WEIGHT_SUFFIXES, identity_files

    base = manifest["base"]
    base_path = Path(base_path).resolve()
    if not base_path.is_dir():
        raise ExportError(
            f"--base {base_path}: not a folder",
            hint="pass the base model folder (for a GGUF base, the converted folder)",
        )
    problems = []
    for name, digest in sorted((base.get("files") or {}).items()):
        f = _safe(base_path, name)
        if not f.is_file():
            problems.append(f"{name}: missing")
            continue
        got = sha256_file(f)
        if got != digest:
            problems.append(f"{name}: sha256 {got[:16]}..., expected {digest[:16]}...")
    extra = [
        n
        for n in identity_files(base_path)
        if n.endswith(WEIGHT_SUFFIXES) and n not in (base.get("files") or {})
    ]
    problems += [f"{n}: weight file not in the recorded base" for n in extra]
    if problems:
        raise ExportError(
            f"refusing base {base_path}: it is not the base this export was trained on "
            f"({base.get('name')}, identity sha256 {str(base.get('sha256'))[:16]}...):\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="pass --base the exact folder the run trained on (every weight and tokenizer "
            "file must match byte for byte)",
        )
    return {"path": str(base_path), "files_checked": len(base.get("files") or {})}


def load_export(export_dir: Path, base_path: Path, manifest: Mapping[str, Any]):
    """(model, tokenizer) from an export: the base plus the adapter through plain
    `PeftModel.from_pretrained`, or the exported full model. safetensors only."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from tunelab.models._quiet import quiet_transformers

    arch = manifest["base"]["architecture"]
    cfg = manifest["config"]
    dtype = getattr(torch, cfg["model"].get("dtype", "float32"))
    remote = bool(manifest["base"].get("trust_remote_code"))
    labels = manifest["task"].get("labels")
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": remote}
    auto = AutoModelForSequenceClassification if arch == "encoder" else AutoModelForCausalLM
    art = manifest["artifact"]
    art_dir = _safe(export_dir, art["dir"])
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(
            _safe(export_dir, manifest["tokenizer_dir"]), trust_remote_code=remote
        )
        if art["kind"] == "adapter":
            from peft import PeftModel

            if arch == "encoder":
                kwargs.update(
                    num_labels=len(labels),
                    id2label=dict(enumerate(labels)),
                    label2id={label: i for i, label in enumerate(labels)},
                )
            base = auto.from_pretrained(base_path, **kwargs)
            model = PeftModel.from_pretrained(base, art_dir)
        else:
            model = auto.from_pretrained(art_dir, **kwargs)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def run_example(model: Any, tokenizer: Any, manifest: Mapping[str, Any], example: dict) -> dict:
    """The recorded example through the exported model with the study's evaluation procedure."""
    from tunelab.config import validate_config
    from tunelab.evaluate import predict_rows
    from tunelab.preprocess import Preprocessor
    from tunelab.tasks import get_task

    cfg = validate_config(manifest["config"], source=MANIFEST)
    arch = manifest["base"]["architecture"]
    task = get_task(cfg, manifest["task"].get("labels"))
    pre = Preprocessor(tokenizer, cfg, task, arch)
    import torch

    torch.manual_seed(cfg.evaluation.seed)
    with torch.inference_mode():
        return predict_rows(model, tokenizer, pre, task, cfg, [example], arch, lambda n: None)[0]


def check_export(
    export_dir: Path | str, base_path: Path | str, *, atol: float = 2e-4
) -> dict[str, Any]:
    """`tunelab check-export DIR --base PATH`: files, base, load, one example.

    Raises ExportError for an edited export or a mismatched base. Returns {export, manifest
    summary, files, base, load_s, example: {id, gold, recorded, output, scores_max_diff,
    matches_recorded}}.
    """
    from tunelab.verify import compare_predictions

    export_dir = Path(export_dir).resolve()
    manifest = _read_manifest(export_dir)
    files = check_files(export_dir, manifest)
    base = check_base(Path(base_path), manifest)
    started = time.perf_counter()
    model, tokenizer = load_export(export_dir, Path(base_path).resolve(), manifest)
    load_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "export": str(export_dir),
        "run_id": manifest["run_id"],
        "artifact": manifest["artifact"],
        "base_name": manifest["base"].get("name"),
        "base_sha256": manifest["base"].get("sha256"),
        "files": files,
        "base": base,
        "load_s": round(load_s, 3),
        "example": None,
    }
    if manifest.get("example"):
        stored = read_json(_safe(export_dir, manifest["example"]))
        started = time.perf_counter()
        fresh = run_example(model, tokenizer, manifest, stored["example"])
        cmp = compare_predictions([stored["recorded"]], [fresh], atol=atol)
        result["example"] = {
            "id": fresh["id"],
            "gold": fresh.get("gold"),
            "recorded": stored["recorded"].get("prediction"),
            "output": fresh.get("prediction"),
            "raw_output": fresh.get("raw_output"),
            "scores_max_diff": cmp["max_score_diff"],
            "matches_recorded": cmp["ok"],
            "seconds": round(time.perf_counter() - started, 3),
        }
    return result
