"""`tunelab export RUN`: a completed training run's weights, tokenizer, example, model card and
manifest, written atomically into one folder (the layout: `tunelab.stages.export`).

The run is checked first (kind, status, checkpoint hashes, base identity), then the evidence
is read from the records (hypothesis, comparison, evaluation, limitations), then the folder is
written beside its destination and moved into place.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab import __version__
from tunelab.core.config import StudyConfig
from tunelab.core.env import capture_env
from tunelab.core.errors import EvaluationError, ExportError, HypothesisError, RunError
from tunelab.core.evidence import find_evaluation, latest, latest_hypothesis
from tunelab.core.record_checks import FoundEvaluation
from tunelab.core.record_export import ExportBase, ExportResults
from tunelab.core.record_parts import CompareEntry
from tunelab.core.record_train import RunPreprocess
from tunelab.core.record_types import (
    Compare,
    Evaluation,
    ExportManifest,
    RunConfig,
    Verify,
)
from tunelab.core.records import (
    dumps_json,
    publish_dir,
    read_json,
    remove_tree,
    temp_dir_beside,
    write_bytes_atomic,
    write_json_atomic,
)
from tunelab.core.run_parts import CheckpointCheck, Prediction, RunEnv
from tunelab.lib.models import BaseModel, hub_source, resolve_recorded, verify_identity
from tunelab.lib.models.identity import TOKENIZER_FILES
from tunelab.stages.data import load_snapshot
from tunelab.stages.evaluate.stage import load_predictions
from tunelab.stages.export.card import model_card
from tunelab.stages.export.limitations import failure_kinds, limitation_lines, regressions
from tunelab.stages.export.manifest import (
    ARTIFACT_DIR,
    EXAMPLE_FILE,
    FORMAT,
    MANIFEST,
    TOKENIZER_DIR,
    manifest_sha256,
    pickle_files,
    tree_hashes,
)
from tunelab.stages.train.layout import final_checkpoint
from tunelab.stages.verify.stage import check_checkpoint_files

if TYPE_CHECKING:
    from tunelab.core.ledger import RunRow
    from tunelab.core.study import Run, Study
    from tunelab.stages.data import Snapshot
    from tunelab.stages.export.merge import MergeTolerance


def new_export_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"export-{stamp}-{secrets.token_hex(3)}"


def _copy_files(src: Path, dst: Path, names: Sequence[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)


def _write_adapter(ckpt: Path, dst: Path, base_name: str) -> None:
    """Copy the checkpoint's peft adapter to the top of the export (`PeftModel.from_pretrained(
    base, EXPORT)` loads it); base_model_name_or_path names the base, not a local path of the
    training machine."""
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


def _write_full_model(study: Study, run: Run, ckpt: Path, dst: Path, method: str) -> None:
    """The whole model in safetensors: a full run's checkpoint as is; a freeze run's trained
    tensors merged into the base (save_pretrained)."""
    src = ckpt / "model"
    if method == "full" and (src / "config.json").exists():
        names = [p.name for p in sorted(src.iterdir()) if p.suffix in (".json", ".safetensors")]
        _copy_files(src, dst, names)
        return
    from tunelab.lib.models._quiet import quiet_transformers
    from tunelab.stages.train import load_run_model

    model, _, _ = load_run_model(study, run, device="cpu")  # merged and saved, not computed on
    with quiet_transformers():
        model.save_pretrained(dst, safe_serialization=True)


def _truncation(
    study: Study,
    run: Run,
    cfg: StudyConfig,
    base: BaseModel,
    snapshot: Snapshot,
    labels: list[str] | None,
) -> dict[str, Any]:
    """Share of train and validation examples cut by preprocess.max_seq_len.

    The run counted them when it encoded its splits (preprocess.json) with the tokenizer whose
    hash the export has just checked, its own config and its own snapshot: the same numbers as
    encoding again, without loading the tokenizer. Runs recorded before it counted both splits
    are encoded again."""
    path = run.path("preprocess.json")
    recorded = RunPreprocess.read(path) if path.exists() else RunPreprocess(path, {})
    splits = {s: recorded.split(s) for s in ("train", "validation")}
    if all(v is not None and v.truncated is not None and v.n is not None for v in splits.values()):
        return {
            s: {"n": v.n, "truncated": v.truncated, "share": v.share_truncated or 0.0}
            for s, v in splits.items()
        }
    from tunelab.lib.models import load_tokenizer
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    tokenizer = load_tokenizer(base)
    pre = Preprocessor(tokenizer, cfg, get_task(cfg, labels), base.architecture)
    out = {}
    for split in ("train", "validation"):
        rows = snapshot.rows(split)
        cut = sum(1 for r in rows if pre.encode(r).get("truncated"))
        out[split] = {"n": len(rows), "truncated": cut, "share": cut / len(rows) if rows else 0.0}
    return out


def _comparison(study: Study, run_id: str) -> tuple[ExportResults | None, str | None]:
    """The run against the latest baseline on validation (compare's record row, as the
    manifest's `results`), or why not."""
    from tunelab.stages.compare import stage as compare_stage

    try:
        # not saved: read as the record it would be
        record = Compare.of(study.records / "compare", compare_stage.run(study, [run_id]))
    except (EvaluationError, HypothesisError, RunError) as exc:
        return None, exc.message
    entry = next((e for e in record.runs if e.run_id == run_id), None)
    if entry is None or not entry.compared:
        return None, (entry.not_compared_reason if entry else None) or "no comparison row"
    return ExportResults.of(record.path, _results(entry, record), entry.where), None


def _results(entry: CompareEntry, record: Compare) -> dict[str, Any]:
    """The manifest's `results`: the run's row with the baseline and bootstrap it was set
    against, without its flipped example ids (in the compare records, not in the model card)."""
    row = {k: v for k, v in entry.raw.items() if k != "flips"}
    return {**row, "baseline": record.baseline.raw, "bootstrap": record.bootstrap}


def _latest_verify(run: Run) -> dict[str, Any] | None:
    """What the manifest says of the run's latest verification (None before any)."""
    found = latest(run.study, "verify", run_dir=run.dir)
    if found is None:
        return None
    v = Verify.read(found.path)
    return {
        "record": v.record,
        "passed": v.passed,
        "reason": v.reason,
        "finished_at": v.finished_at,
        "environment": v.environment,
    }


def _env_summary(env: RunEnv | None) -> dict[str, Any] | None:
    if env is None or not env.raw:
        return None
    return {
        "python": env.python,
        "torch": env.torch,
        "backend": env.backend,
        "cuda": env.cuda,
        "rocm": env.rocm,
        "gpus": [g.name for g in env.devices],
        "cpu": env.cpu_name,
        "packages": env.packages,
        "tunelab_git": env.tunelab_git,
    }


@dataclass
class _Source:
    """A completed training run as the export reads it: its config, checkpoint and base."""

    run: Run
    record: RunConfig  # the run's config.json
    cfg: StudyConfig
    ckpt: Path
    base: BaseModel
    identity: dict[str, Any]  # the base identity recorded at training, as written
    bound: ExportBase  # the same, read typed


@dataclass
class _Evidence:
    """What the records say about the run: the manifest's results and limitations."""

    snapshot: Snapshot
    hypothesis: dict[str, Any] | None
    comparison: ExportResults | None
    evaluation: Evaluation | None  # the run's validation evaluation
    predictions: list[Prediction]
    verdicts: list[dict[str, Any]]  # the comparison's guardrail verdicts, as written
    detail: dict[str, Any]
    run_env: RunEnv | None


def _check_exportable(row: RunRow) -> None:
    """Only a completed training run is exported."""
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


def _destination(study: Study, out: Path | str | None) -> tuple[str, Path]:
    """(export id, folder); an existing folder is refused."""
    export_id = new_export_id()
    final = Path(out).resolve() if out else study.records / "exports" / export_id
    if final.exists():
        raise ExportError(
            f"{final} already exists; an export is never written over another",
            hint="choose a new --out folder (or leave --out away for records/exports/<id>)",
        )
    return export_id, final


def _open_source(study: Study, run: Run) -> _Source:
    """The run's config, its final checkpoint (hashes checked) and its base (identity checked)."""
    row = run.row
    record, cfg = run.record, run.config
    ckpt = final_checkpoint(run.dir / "checkpoints")
    if ckpt is None:
        raise ExportError(f"run {row.id} has no final checkpoint", hint="the run is incomplete")
    files_check = CheckpointCheck.of(ckpt, check_checkpoint_files(ckpt))
    if not files_check.ok:
        raise ExportError(
            f"checkpoint {ckpt} does not match the sha256 recorded when it was written: "
            + ", ".join((files_check.changed or []) + (files_check.missing or [])),
            hint=f"the checkpoint is damaged; `tunelab verify {row.id}` records the check",
        )
    base = resolve_recorded(cfg.model, study.root, record.base_model)
    identity = record.base_model or base.identity
    try:
        verify_identity(identity, base.path)
    except Exception as exc:  # ModelError: say it as an export refusal
        raise ExportError(
            f"the base model changed since run {row.id} trained: {getattr(exc, 'message', exc)}",
            hint="restore the base the run was trained on, then export again",
        ) from None
    bound = ExportBase.of(record.path, identity, "base_model")
    return _Source(run, record, cfg, ckpt, base, identity, bound)


def _gather_evidence(study: Study, src: _Source, notes: Sequence[str]) -> _Evidence:
    """The hypothesis, the comparison with the baseline, the validation predictions and the
    limitations, read from the study's records."""
    row = src.run.row
    snapshot = load_snapshot(study, row.data_snapshot)
    hypothesis = _hypothesis(study, src.record)
    comparison, not_compared = _comparison(study, row.id)
    evaluation, predictions = _validation(study, row.id)
    judged = comparison.guardrails if comparison is not None else []
    openings = study.ledger.test_openings()
    labels = src.record.labels
    quantization = src.bound.quantization  # a QLoRA run's 4-bit base
    detail = {
        "not_compared": not_compared,
        "regressed": regressions(comparison),
        "guardrails_failed": [v.raw for v in judged if not v.passed],
        "failure_kinds": failure_kinds(predictions),
        "truncation": _truncation(study, src.run, src.cfg, src.base, snapshot, labels),
        "test_openings": len(openings),
        "test_openings_log": [o.to_dict() for o in openings],
        "verify": _latest_verify(src.run),
        "notes": [n for n in notes if n and n.strip()],
        "quantization": quantization.raw if quantization is not None else None,
        "merge": None,  # export.merge's figures, once merged
    }
    env_path = src.run.path("env.json")
    run_env = RunEnv.read(env_path) if env_path.exists() else None
    verdicts = [v.raw for v in judged]
    return _Evidence(
        snapshot, hypothesis, comparison, evaluation, predictions, verdicts, detail, run_env
    )


def _hypothesis(study: Study, record: RunConfig) -> dict[str, Any] | None:
    """The manifest's `hypothesis`: the version the run tested, the latest one, and the
    latest's statement (None when none is registered)."""
    hyp = latest_hypothesis(study.records)
    if hyp is None:
        return None
    return {
        "version": record.hypothesis_version,
        "sha256": record.hypothesis_sha256,
        "latest_version": hyp.version,
        **hyp.statement,
    }


def _validation(study: Study, run_id: str) -> tuple[Evaluation | None, list[Prediction]]:
    """The run's evaluation on validation and its predictions (None, [] before any)."""
    found = find_evaluation(study, run_id, "validation")
    if found is None:
        return None, []
    evaluation = FoundEvaluation.of(found, "validation")
    rows = load_predictions(found)
    return evaluation.record, Prediction.rows(rows, evaluation.predictions_path)


def _merge_rows(ev: _Evidence, first_id: str | None) -> list[dict[str, Any]]:
    """The validation examples a merge is checked on: the exported example first."""
    from tunelab.stages.export.merge import NUM_MERGE_EXAMPLES

    rows = ev.snapshot.rows("validation")
    rows = sorted(rows, key=lambda r: r["id"] != first_id)  # stable: the rest keep their order
    return rows[:NUM_MERGE_EXAMPLES]


def _write_files(
    study: Study,
    src: _Source,
    ev: _Evidence,
    tmp: Path,
    merge_dtype: str | None,
    tolerance: MergeTolerance | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The weights (at the top of `tmp`), the base's tokenizer files and the recorded example;
    returns (the example or None without a validation prediction, the merge record or None)."""
    method = src.cfg.adaptation.method
    first = ev.predictions[0] if ev.predictions else None
    merge, merged = None, None
    if merge_dtype is not None:
        from tunelab.stages.export.merge import merge_into

        rows = _merge_rows(ev, first.id if first else None)
        merge, predicted = merge_into(
            study, src.run, method, rows, tmp, dtype=merge_dtype, tolerance=tolerance
        )
        merged = Prediction.of(tmp / EXAMPLE_FILE, predicted, "merged")
    elif method in ("lora", "qlora"):
        _write_adapter(src.ckpt, tmp, src.bound.name or str(src.base.path))
    else:
        _write_full_model(study, src.run, src.ckpt, tmp, method)
    tok_names = [n for n in src.bound.files or {} if n in TOKENIZER_FILES]
    _copy_files(src.base.path, tmp / TOKENIZER_DIR, tok_names)
    example, row = None, None
    if first:
        # the snapshot's data rows, by id
        rows = {r["id"]: r for r in ev.snapshot.rows("validation")}
        if first.id in rows:
            row = _with_example_image(rows[first.id], tmp)
            example = {"example": row, "recorded": first.raw}
            if merged is not None and merged.id == first.id:
                example["merged"] = merged.raw  # what check-export expects of the merged model
            write_json_atomic(tmp / EXAMPLE_FILE, example)
    if src.base.architecture == "image":
        ev.detail["processor"] = _image_processor(src, tmp, row)
    pickled = pickle_files(tmp)
    if pickled:
        raise ExportError(
            f"the export would hold pickle files: {pickled}", hint="only safetensors and JSON"
        )
    return example, merge


def _image_processor(src: _Source, tmp: Path, row: dict[str, Any] | None) -> dict[str, Any]:
    """The exported preprocessor_config.json set to the training chain (see
    `image_transforms.processor_config_for`), and how far AutoImageProcessor loaded from it is
    from the chain's pixel values (the model card and check-export say so)."""
    from transformers import AutoImageProcessor

    from tunelab.lib.models._quiet import quiet_transformers
    from tunelab.lib.models.vision import load_image_processor
    from tunelab.lib.preprocess.images import processor_config_for, processor_gap, resolve_chain

    chain = resolve_chain(load_image_processor(src.base), src.cfg)
    path = tmp / TOKENIZER_DIR / "preprocessor_config.json"
    config = processor_config_for(read_json(path), chain, src.cfg.preprocess.image)
    path.unlink()  # the base's copy, replaced inside the export's temporary folder
    write_json_atomic(path, config)
    image = None
    if row and "image" in row:  # the exported example's data row
        from tunelab.lib.preprocess.decode import open_image

        image = open_image((tmp / row["image_path"]).read_bytes(), "example")
    with quiet_transformers():
        processor = AutoImageProcessor.from_pretrained(tmp / TOKENIZER_DIR)
    return processor_gap(processor, chain, image)


def _artifact(method: str, merged_dtype: str | None) -> dict[str, Any]:
    """What the export holds, at its top (ARTIFACT_DIR): a peft adapter or a whole model
    (`merged_dtype`: the adapter merged into its base in that dtype)."""
    adapter = method in ("lora", "qlora") and merged_dtype is None
    art = {
        "kind": "adapter" if adapter else "model",
        "dir": ARTIFACT_DIR,
        "method": method,
        "format": "peft" if adapter else "transformers",
        "weights": "safetensors",
    }
    if merged_dtype is not None:
        art.update(merged=True, dtype=merged_dtype)
    return art


def _with_example_image(row: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """An image example travels with its image file, named relative to the export."""
    if "image" not in row:
        return row
    name = "example-image" + Path(row["image"]).suffix
    write_bytes_atomic(tmp / name, Path(row["image_path"]).read_bytes())
    return {**row, "image_path": name}


def _build_manifest(
    src: _Source,
    ev: _Evidence,
    export_id: str,
    example: dict[str, Any] | None,
    merge: dict[str, Any] | None,
    merged_dtype: str | None,
) -> dict[str, Any]:
    """The manifest without its file hashes and its own sha256 (added once the card is written)."""
    row, cfg, method = src.run.row, src.cfg, src.cfg.adaptation.method
    comparison, evaluation = ev.comparison, ev.evaluation
    return {
        "format": FORMAT,
        "export_id": export_id,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "tunelab_version": __version__,
        "study": cfg.name,
        "run_id": row.id,
        "run_name": row.name,
        "run_parent": row.parent,
        "run_why": row.why,
        "artifact": _artifact(method, merged_dtype if merge is not None else None),
        "merge": merge,
        "tokenizer_dir": TOKENIZER_DIR,
        "base": {
            **{k: v for k, v in src.identity.items() if k != "path"},
            "architecture": src.base.architecture,
            "hub": hub_source(src.identity),  # {repo_id, revision, commit} of a hub base
            "path_at_export": str(src.base.path),
        },
        "task": {
            "kind": cfg.task.kind,
            "labels": src.record.labels,
            "fields": (cfg.task.json_schema or {}).get("required"),
        },
        "config": src.record.config,
        "config_sha256": src.record.config_sha256,
        "adaptation": cfg.adaptation.model_dump(mode="json"),
        "training": cfg.training.model_dump(mode="json"),
        "template_sha256": evaluation.template_sha256 if evaluation else None,
        "data_snapshot": row.data_snapshot,
        "hypothesis": ev.hypothesis,
        "environment": {
            "training": _env_summary(ev.run_env),
            "export": _env_summary(RunEnv.of(MANIFEST, capture_env(), "environment.export")),
        },
        "results": comparison.raw if comparison is not None else None,
        "evaluation_run": evaluation.path.parent.name if evaluation else None,
        "guardrails": {
            "pass": None if comparison is None else comparison.guardrails_pass,
            "verdicts": ev.verdicts,
        },
        "limitations": limitation_lines(ev.detail),
        "limitations_detail": ev.detail,
        "example": EXAMPLE_FILE if example else None,
    }


def run(
    study: Study,
    run_id: str,
    *,
    out: Path | str | None = None,
    notes: Sequence[str] = (),
    merge_dtype: str | None = None,
    merge_tolerance: MergeTolerance | None = None,
) -> tuple[Path, dict[str, Any]]:
    """`tunelab export RUN`: write the export folder; returns (folder, manifest).

    `merge_dtype` ("bf16" | "fp32"; `--merge`): a LoRA or QLoRA adapter merged into its base
    (dequantized for QLoRA), written only within `merge_tolerance` (default `MergeTolerance()`)
    of the adapted model. Refuses a run that is not a completed training run, a damaged checkpoint, a base model
    that changed since training, and an existing destination.
    """
    import torch  # noqa: F401 (capture_env reads its build; imported before the timer starts)

    # the export's own work, timed like the ledger times a run: after its libraries are imported
    started = time.perf_counter()
    run = study.get_run(run_id)
    _check_exportable(run.row)
    export_id, final = _destination(study, out)
    src = _open_source(study, run)
    ev = _gather_evidence(study, src, notes)
    tmp = temp_dir_beside(final)
    try:
        example, merge = _write_files(study, src, ev, tmp, merge_dtype, merge_tolerance)
        ev.detail["merge"] = merge
        export_id = export_id if not out else final.name
        manifest = _build_manifest(src, ev, export_id, example, merge, merge_dtype)
        card = model_card(ExportManifest.of(final / MANIFEST, manifest))
        (tmp / "README.md").write_text(card, encoding="utf-8")
        manifest["files"] = tree_hashes(tmp)
        manifest["manifest_sha256"] = manifest_sha256(manifest)
        write_bytes_atomic(tmp / MANIFEST, dumps_json(manifest).encode("utf-8"))
        path = publish_dir(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    # its duration, for `tunelab plan --review` (the manifest's created_at is taken mid-way)
    study.ledger.add_event(
        run.row.id,
        "export",
        {
            "export_id": export_id,
            "path": str(path),
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    return path, manifest
