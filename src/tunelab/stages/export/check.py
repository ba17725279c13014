"""`tunelab check-export DIR --base PATH|org/repo[@rev]`: an export checked against its manifest
and a base folder (or a hub base, resolved through the hub cache) by sha256, loaded with plain
transformers / peft, and run on its recorded example."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunelab.core.errors import ExportError, StudyError, preview
from tunelab.core.hashing import sha256_file
from tunelab.core.record_export import ExportBase, StoredExample
from tunelab.core.record_types import ExportManifest
from tunelab.core.records import read_json, safe_join
from tunelab.core.run_parts import Prediction, Reproduced
from tunelab.core.safetensors_header import safetensors_problems
from tunelab.stages.export.manifest import (
    FORMAT,
    MANIFEST,
    READABLE_FORMATS,
    as_manifest,
    manifest_sha256,
    pickle_files,
    tree_hashes,
)


class ExampleMismatch(ExportError):
    """The exported model's output on the recorded example differs from the recording (exit 1)."""

    exit_code = 1


def _read_manifest(export_dir: Path) -> dict[str, Any]:
    """The manifest as written: its format is known and its seal (`check_files`) is checked on
    these bytes before it is read as a record."""
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
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ExportError(
            f"{path}: unknown manifest format {found!r}",
            hint=f"expected {FORMAT} (or an older {', '.join(READABLE_FORMATS[:-1])})",
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


def escaping_links(root: Path) -> list[str]:
    """Symbolic links under `root` (listed in a manifest or not) that lead outside it or
    nowhere, as problem lines; nothing is followed to find them."""
    root = root.resolve()
    problems = []
    for folder, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            target = path.resolve()
            if target != root and root not in target.parents:
                problems.append(f"{rel}: a symbolic link to {target}, outside the export")
            elif not target.exists():
                problems.append(f"{rel}: a broken symbolic link (to {target})")
    return problems


def check_files(export_dir: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """No link leaving the export, the manifest's own sha256, each exported file's sha256, no
    extra and no pickle file, and every safetensors header sound."""
    links = escaping_links(export_dir)
    if links:  # checked first: nothing outside the export is read, even to hash it
        raise ExportError(
            f"export {export_dir} holds links that leave it:\n"
            + "\n".join(f"  - {p}" for p in links),
            hint="an export is self-contained; export the run again",
        )
    problems = []
    if manifest.get("manifest_sha256") != manifest_sha256(manifest):
        problems.append(f"{MANIFEST}: content does not match its manifest_sha256 (edited)")
    listed = manifest.get("files") or {}
    if not isinstance(listed, dict):
        problems.append(f"{MANIFEST}: files is not a mapping of paths to sha256 (edited)")
        listed = {}
    for rel, digest in sorted(listed.items()):
        f = _safe(export_dir, rel)
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{rel}: sha256 {sha256_file(f)[:12]}..., expected {digest[:12]}...")
        elif rel.endswith(".safetensors") and (damage := safetensors_problems(f)):
            problems.append(f"{rel}: damaged safetensors ({'; '.join(damage[:3])})")
    for rel in sorted(set(tree_hashes(export_dir)) - set(listed)):
        problems.append(f"{rel}: not in the manifest (added after export)")
    pickled = pickle_files(export_dir)
    for rel in pickled:
        problems.append(f"{rel}: pickle format, refused")
    if problems:
        raise ExportError(
            f"export {export_dir} does not match its manifest:\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="the export was changed after it was written; export the run again",
        )
    return {"files_checked": len(listed), "manifest_sha256": manifest["manifest_sha256"]}


def check_binding(export_dir: Path, manifest: ExportManifest | Mapping[str, Any]) -> dict[str, Any]:
    """An adapter's own adapter_config.json must name the manifest's base and the adaptation
    its config records (target modules, rank, alpha): a resealed manifest cannot rebind it."""
    m = as_manifest(manifest)
    art = m.contents
    if art is None or art.kind != "adapter":
        return {"checked": False}
    path = _safe(export_dir, art.dir or ".") / "adapter_config.json"
    try:
        adapter = read_json(path)  # peft's own config file
    except StudyError as exc:
        raise ExportError(exc.message, hint="the adapter is damaged; export again") from None
    adaptation = m.adaptation_settings
    expected = {"base_model_name_or_path": m.bound_base.name, "r": adaptation.rank}
    expected["lora_alpha"] = adaptation.alpha
    problems = [
        f"{key} is {preview(adapter.get(key))}, the manifest says {preview(value)}"
        for key, value in expected.items()
        if value is not None and adapter.get(key) != value
    ]
    targets = adaptation.target_modules
    own = adapter.get("target_modules")
    if isinstance(targets, list) and sorted(own or []) != sorted(targets):
        problems.append(f"target_modules are {preview(own)}, the manifest says {preview(targets)}")
    if problems:
        raise ExportError(
            f"{path} does not match the export's manifest:\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="the adapter belongs to another base or configuration; export the run again",
        )
    return {"checked": True, "base_model_name_or_path": adapter.get("base_model_name_or_path")}


def resolve_base_arg(spec: Path | str, manifest: ExportManifest | Mapping[str, Any]) -> Path:
    """The base folder `--base` names: a folder, or a hub id `org/repo[@revision]` resolved
    through the hub cache (default revision: the commit the export was trained on). Refuses a
    hub base at another commit than the manifest's."""
    from tunelab.core.config import resolve_path
    from tunelab.core.config_sections import HUB_ID

    base = as_manifest(manifest).bound_base
    text = str(spec)
    repo, _, rev = text.partition("@")
    if text.startswith("asset:"):
        return _gguf_converted(resolve_path(text), base)
    if Path(text).expanduser().exists() or not HUB_ID.fullmatch(repo) or "/" not in repo:
        return _gguf_converted(Path(text).expanduser(), base)
    from tunelab.core.hub import download

    hub = base.hub
    trained = hub.commit if hub is not None and hub.repo_id == repo else None
    patterns = [base.gguf_file.rsplit("/", 1)[-1]] if base.gguf_file else None
    snap = download(
        repo,
        rev or trained or "main",
        allow_patterns=patterns or base.patterns,
        field="--base",
    )
    if trained and snap.commit != trained:
        raise ExportError(
            f"refusing base {text}: it resolves to commit {snap.commit}, the export was trained "
            f"on {repo} at commit {trained}",
            hint=f"pass --base {repo}@{trained} (or --base {repo}: the recorded commit)",
        )
    if patterns:  # a GGUF base: the folder it was converted to
        from tunelab.lib.models.gguf import convert_gguf

        return convert_gguf(snap.path, patterns[0])
    return snap.path


def _gguf_converted(folder: Path, base: ExportBase) -> Path:
    """For a base converted from GGUF, the folder the study named (the one holding the .gguf
    file) stands for its converted folder, once the GGUF's sha256 is the recorded one."""
    name = str(base.gguf_file or "").rsplit("/", 1)[-1]
    if not name or not (folder / name).is_file():
        return folder
    from tunelab.lib.models.gguf import convert_gguf, gguf_sha256

    digest = gguf_sha256(folder / name)
    if digest != base.gguf_sha256:
        raise ExportError(
            f"refusing base {folder}: {name} has sha256 {digest[:16]}..., the export was trained "
            f"on a conversion of a GGUF with sha256 {str(base.gguf_sha256)[:16]}...",
            hint="pass --base the folder holding the exact GGUF file the run trained on",
        )
    return convert_gguf(folder, name)


def check_base(base_path: Path, manifest: ExportManifest | Mapping[str, Any]) -> dict[str, Any]:
    """Every recorded base file (weights, tokenizer, config) must be in `base_path` with the
    recorded sha256, and no unrecorded weight file may be there."""
    from tunelab.lib.models.identity import WEIGHT_SUFFIXES, identity_files

    base = as_manifest(manifest).bound_base
    recorded = base.files or {}
    base_path = Path(base_path).resolve()
    if not base_path.is_dir():
        raise ExportError(
            f"--base {base_path}: not a folder",
            hint="pass the base model folder (for a GGUF base, the folder holding the .gguf)",
        )
    problems = []
    for name, digest in sorted(recorded.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            _safe(base_path, name)  # raises: a recorded name that leaves the folder
        f = base_path / name  # a hub snapshot's files are symlinks into its blobs/
        if not f.is_file():
            problems.append(f"{name}: missing")
            continue
        got = sha256_file(f)
        if got != digest:
            problems.append(f"{name}: sha256 {got[:16]}..., expected {digest[:16]}...")
    extra = [
        n
        for n in identity_files(base_path, base.patterns)
        if n.endswith(WEIGHT_SUFFIXES) and n not in recorded
    ]
    problems += [f"{n}: weight file not in the recorded base" for n in extra]
    if problems:
        raise ExportError(
            f"refusing base {base_path}: it is not the base this export was trained on "
            f"({base.name}, identity sha256 {str(base.sha256)[:16]}...):\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="pass --base the exact folder the run trained on (every weight and tokenizer "
            "file must match byte for byte)",
        )
    return {
        "path": str(base_path),
        "files_checked": len(recorded),
        "hub": hub.raw if (hub := base.hub) is not None else None,
    }


def load_export(export_dir: Path, base_path: Path, manifest: ExportManifest | Mapping[str, Any]):
    """(model, tokenizer) from an export: the base plus the adapter through plain
    `PeftModel.from_pretrained` (a QLoRA adapter onto the base loaded in 4 bits with the
    recorded settings, as it was trained and evaluated), or the exported whole model (a merged
    one in the dtype it was merged in). safetensors only."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from tunelab.lib.models._quiet import quiet_transformers

    m = as_manifest(manifest)
    arch, art = m.bound_base.architecture, m.contents
    # the saved study config's model section (core.config validated it when the run started)
    dtype = getattr(torch, m.config["model"].get("dtype", "float32"))
    if art.merged:
        from tunelab.stages.export.merge import MERGE_DTYPES

        dtype = getattr(torch, MERGE_DTYPES[art.dtype])
    remote = bool(m.bound_base.trust_remote_code)
    labels = m.task.labels
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": remote}
    auto = AutoModelForSequenceClassification if arch == "encoder" else AutoModelForCausalLM
    quantized = art.kind == "adapter" and art.method == "qlora"
    if quantized:
        from tunelab.core.config_training import QuantizationConfig
        from tunelab.lib.models.quantize import quantization_config

        q = QuantizationConfig.model_validate(m.adaptation_settings.quantization)
        kwargs["quantization_config"] = quantization_config(q, arch)
    art_dir = _safe(export_dir, art.dir)
    loader = AutoTokenizer
    if arch == "image":
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        auto, loader = AutoModelForImageClassification, AutoImageProcessor
    with quiet_transformers():
        tokenizer = loader.from_pretrained(
            _safe(export_dir, m.tokenizer_dir), trust_remote_code=remote
        )
        if art.kind == "adapter":
            from peft import PeftModel

            if arch in ("encoder", "image"):
                kwargs.update(
                    num_labels=len(labels),
                    id2label=dict(enumerate(labels)),
                    label2id={label: i for i, label in enumerate(labels)},
                )
            base = auto.from_pretrained(base_path, **kwargs)
            if quantized:
                from tunelab.lib.models.quantize import keep_weights_as_loaded

                keep_weights_as_loaded(base)
            model = PeftModel.from_pretrained(base, art_dir)
        else:
            model = auto.from_pretrained(art_dir, **kwargs)
    if arch != "image" and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def run_example(
    model: Any, tokenizer: Any, manifest: ExportManifest | Mapping[str, Any], example: dict
) -> dict:
    """The recorded example through the exported model with the study's evaluation procedure."""
    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import predict_rows

    m = as_manifest(manifest)
    cfg = validate_config(m.config, source=MANIFEST)
    arch = m.bound_base.architecture
    task = get_task(cfg, m.task.labels)
    pre = Preprocessor(tokenizer, cfg, task, arch)
    import torch

    torch.manual_seed(cfg.evaluation.seed)
    with torch.inference_mode():
        return predict_rows(model, tokenizer, pre, task, cfg, [example], arch, lambda n: None)[0]


def check_export(
    export_dir: Path | str, base_path: Path | str, *, atol: float = 2e-4
) -> dict[str, Any]:
    """`tunelab check-export DIR --base PATH|org/repo[@rev]`: files, base, load, one example.

    Raises ExportError for an edited export or a mismatched base. Returns {export, manifest
    summary, files, base, load_s, example: {id, gold, recorded, output, scores_max_diff,
    matches_recorded}} (`core.record_export_check.ExportCheck` reads it).
    """
    export_dir = Path(export_dir).resolve()
    raw = _read_manifest(export_dir)
    files = check_files(export_dir, raw)
    m = ExportManifest.of(export_dir / MANIFEST, raw)  # sealed: read as its record
    binding = check_binding(export_dir, m)
    given = str(base_path)
    base_path = resolve_base_arg(base_path, m)
    base = {**check_base(base_path, m), "given": given}
    started = time.perf_counter()
    model, tokenizer = load_export(export_dir, base_path.resolve(), m)
    load_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "export": str(export_dir),
        "run_id": m.run_id,
        "artifact": m.contents.raw if m.contents is not None else None,
        "base_name": m.bound_base.name,
        "base_sha256": m.bound_base.sha256,
        "files": files,
        "binding": binding,
        "base": base,
        "load_s": round(load_s, 3),
        "example": None,
    }
    stored = StoredExample.read(_safe(export_dir, m.example)) if m.example else None
    if stored is not None:
        result["example"] = _example_check(export_dir, m, stored, model, tokenizer, atol)
    if m.bound_base.architecture == "image":
        result["processor"] = _processor_check(tokenizer, m, stored, export_dir)
    return result


def _example_check(
    export_dir: Path,
    m: ExportManifest,
    stored: StoredExample,
    model: Any,
    tokenizer: Any,
    atol: float,
) -> dict[str, Any]:
    """The stored example through the exported model, against the recorded prediction."""
    from tunelab.stages.verify.checks import compare_predictions

    row = stored.example  # a data row of the snapshot
    if "image" in row:  # the example's image file lies in the export
        row = {**row, "image_path": str(_safe(export_dir, row["image_path"]))}
    started = time.perf_counter()
    fresh = Prediction.of(stored.path, run_example(model, tokenizer, m, row), "fresh output")
    # a merged model is held to its own output at export (the run's is in manifest.merge)
    recorded = stored.merged or stored.recorded
    cmp = compare_predictions([recorded.raw], [fresh.raw], atol=atol)
    reproduced = Reproduced.of(stored.path, cmp, "against the fresh output")
    return {
        "id": fresh.id,
        "gold": fresh.gold,
        "recorded": recorded.prediction,
        "output": fresh.prediction,
        "raw_output": fresh.raw_output,
        "scores_max_diff": reproduced.max_score_diff,
        "matches_recorded": reproduced.ok,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _processor_check(
    processor: Any, m: ExportManifest, stored: StoredExample | None, export_dir: Path
) -> dict[str, Any]:
    """The exported AutoImageProcessor against the study's chain (`processor_gap`), on the
    example's image when there is one."""
    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.decode import open_image
    from tunelab.lib.preprocess.images import processor_gap, resolve_chain

    chain = resolve_chain(processor, validate_config(m.config, source=MANIFEST))
    image = None
    if stored is not None and "image_path" in stored.example:
        name = stored.example["image_path"]  # relative to the export
        image = open_image(_safe(export_dir, name).read_bytes(), name)
    return processor_gap(processor, chain, image)
