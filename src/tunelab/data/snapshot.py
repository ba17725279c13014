"""Data snapshots: `records/data/<snapshot-id>/`, content-addressed, verified on every load.

build_snapshot reads the source, cleans, samples, splits, finds duplicates, applies the policy
and writes, into a temporary folder published in one rename:

    train.jsonl, validation.jsonl, test.jsonl   the examples {"id", "text", "label", "target"}
    duplicates.json                              every duplicate pair and every removed row
    dropped.jsonl                                rows the cleaning rules dropped, with the rule
    manifest.json                                sources and their sha256, rules, counts, ...
    DONE

The id hashes the source files' content, the field mapping, the rules, the split and dedup
settings and the sha256 of every output file: the same inputs and rules give the same id (and
the existing snapshot is reused), any change gives a new one. The test split is sealed: it is
read only through `open_test_split`, which logs who opened it, when and why in the ledger.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.config import sha256_json
from tunelab.data import checks, dedup
from tunelab.data.cleaning import clean_texts, compile_rules, rules_sha256
from tunelab.data.readers import SourceRow, read_source
from tunelab.data.splits import (
    SPLITS,
    check_user_splits,
    counts_by_category,
    ensure_coverage,
    sample_by_hash,
    split_by_hash,
)
from tunelab.errors import DataError, EvaluationError, SnapshotError, StudyError
from tunelab.ledger import utc_now
from tunelab.records import (
    dumps_json,
    publish_dir,
    read_json,
    remove_tree,
    sha256_bytes,
    temp_dir_beside,
    write_bytes_atomic,
)

if TYPE_CHECKING:
    from tunelab.study import Study

FORMAT_VERSION = 1
SPLIT_FILES = {s: f"{s}.jsonl" for s in SPLITS}
ID_CHARS = 16
NORMALIZATION = "NFKC, lower case, whitespace runs to one space"
# Show progress bars from this many rows (or files) on.
PROGRESS_FROM = 5000


def data_dir(study: Study) -> Path:
    return study.records / "data"


# ---------------------------------------------------------------- progress


class _Bar:
    """A rich progress bar on stderr for large inputs; silent when disabled or small."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _ensure(self) -> Any:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description:<12}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
        return self._progress

    def counter(self, name: str) -> Callable[[int], None]:
        """Advance by n items of unknown total; the bar appears once PROGRESS_FROM are seen."""
        seen = [0]

        def advance(n: int) -> None:
            seen[0] += n
            if not self.enabled or seen[0] < PROGRESS_FROM:
                return
            if name not in self._tasks:
                self._tasks[name] = self._ensure().add_task(name, total=None)
                n = seen[0]
            self._progress.advance(self._tasks[name], n)

        return advance

    def fraction(self, rows: int) -> Callable[[str, float], None]:
        def update(stage: str, fraction: float) -> None:
            if not self.enabled or rows < PROGRESS_FROM:
                return
            if stage not in self._tasks:
                self._tasks[stage] = self._ensure().add_task(stage, total=1.0)
            self._progress.update(self._tasks[stage], completed=fraction)

        return update


# ---------------------------------------------------------------- ids and labels


def _content_id(row: SourceRow) -> str:
    blob = "\x1f".join([row.text, row.label or "", row.target or ""])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def assign_ids(rows: list[SourceRow]) -> list[str]:
    """The mapped id (checked unique), else a content hash; repeats of one content get -2, -3."""
    seen: dict[str, str] = {}
    ids = []
    for row in rows:
        if row.id is not None:
            if row.id in seen:
                raise DataError(
                    f"{row.where}: id {row.id!r} (field id) repeats {seen[row.id]}",
                    hint="ids must be unique; fix the data or map data.fields.id to another "
                    "column (null: content hashes)",
                )
            seen[row.id] = row.where
            ids.append(row.id)
        else:
            base = _content_id(row)
            rid, k = base, 1
            while rid in seen:
                k += 1
                rid = f"{base}-{k}"
            seen[rid] = row.where
            ids.append(rid)
    return ids


def _check_labels(rows: list[SourceRow], known: list[str] | None, has_label: bool) -> list[str]:
    notes = []
    if not has_label:
        return notes
    if known:
        allowed = set(known)
        for row in rows:
            if row.label not in allowed:
                raise DataError(
                    f"{row.where}: unknown label {row.label!r} (field label); task.labels "
                    f"lists {sorted(allowed)}",
                    hint="fix the row, or add the label to task.labels in study.yaml",
                )
        missing = sorted(allowed - {r.label for r in rows})
        if missing:
            notes.append(f"labels in task.labels with no example: {missing}")
    return notes


# ---------------------------------------------------------------- build


def _identity(m: dict[str, Any]) -> str:
    """The snapshot id: a hash of the inputs, the settings and the outputs."""
    return sha256_json(
        {
            "format_version": m["format_version"],
            "source": {
                "format": m["source"]["format"],
                "files": [[f["path"], f["sha256"]] for f in m["source"]["files"]],
            },
            "fields": m["fields"],
            "task_labels": m["task_labels"],
            "cleaning": m["cleaning"]["sha256"],
            "transforms": m["transforms"]["sha256"],
            "splits": m["splits"]["sha256"],
            "dedup": m["dedup"]["sha256"],
            "files": m["files"],
        }
    )[:ID_CHARS]


def _content_sha(manifest: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in manifest.items() if k != "content_sha256"})


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def build_snapshot(study: Study, progress: bool = True) -> dict[str, Any]:
    """Build (or find unchanged) the data snapshot of the study's `data` config.

    Returns the manifest, plus `"unchanged": True` when an identical snapshot already existed.
    Raises DataError on bad input (naming file, line or row, and field), ConfigError on a bad
    rule, SnapshotError when an existing snapshot with the same id fails verification. Nothing
    is left behind on error.
    """
    cfg = study.config.data
    task_labels = sorted(study.config.task.labels) if study.config.task.labels else None
    compile_rules(cfg.cleaning)  # a bad regular expression fails before any reading
    source_path = study.resolve(cfg.source.path)
    with _Bar(progress) as bar:
        src = read_source(source_path, cfg, bar.counter("reading"))
        rows = src.rows
        if not rows:
            raise DataError(
                f"{source_path}: the data set is empty (no rows)",
                hint="point data.source.path at the data, or check data.source.format and glob",
            )
        notes = list(src.notes)
        has_label = cfg.fields.label is not None or cfg.source.format == "folder"
        unified = checks.check_labels(rows, task_labels, cfg.cleaning)
        notes += _check_labels(rows, task_labels, has_label)
        notes += checks.check_targets(rows, study.config.task, cfg)
        ids = assign_ids(rows)

        cleaned = clean_texts([r.text for r in rows], cfg.cleaning)
        for effect in cleaned.effects:
            effect["changed"] += unified if effect["rule"] == "unify_labels" else 0
        if not cleaned.kept:
            by_rule = ", ".join(
                f"{e['rule']} dropped {e['dropped']}" for e in cleaned.effects if e["dropped"]
            )
            raise DataError(
                f"{source_path}: all {len(rows)} rows were dropped by the cleaning rules "
                f"({by_rule})",
                hint="loosen data.cleaning (e.g. drop_longer_than max_chars)",
            )
        empty = [i for i, t in zip(cleaned.kept, cleaned.texts, strict=True) if not t.strip()]
        if empty:
            first = rows[empty[0]]
            raise DataError(
                f"{first.where}: field {cfg.fields.text!r} (text) is empty"
                + (" after the cleaning rules" if first.text.strip() else "")
                + (f" ({len(empty)} rows in all)" if len(empty) > 1 else ""),
                hint="fix the row, or add `- rule: drop_empty` to data.cleaning to drop such rows",
            )
        kept = cleaned.kept
        texts = cleaned.texts
        notes += checks.control_notes(texts, [rows[i] for i in kept], "text")
        targets = [(rows[i].target, rows[i]) for i in kept if rows[i].target is not None]
        notes += checks.control_notes([t for t, _ in targets], [r for _, r in targets], "target")
        normalized = dedup.normalize_texts(texts)
        keys = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in normalized.to_pylist()]
        # (the same keys as splits.content_keys(texts), without normalizing twice)

        sampled_out = 0
        if cfg.max_examples is not None and cfg.max_examples < len(kept):
            pick = sample_by_hash(keys, cfg.max_examples, cfg.splits.seed)
            sampled_out = len(kept) - len(pick)
            kept = [kept[i] for i in pick]
            texts = [texts[i] for i in pick]
            keys = [keys[i] for i in pick]
            normalized = normalized.take(pick)

        labels = [rows[i].label for i in kept]
        moved: list[dict[str, Any]] = []
        if cfg.fields.split:
            splits = [rows[i].split or "" for i in kept]
            method = "column"
            notes += check_user_splits(splits)
        else:
            splits = split_by_hash(keys, cfg.splits)
            method = "hash"
            splits, moved, warnings = ensure_coverage(
                splits, keys, labels, cfg.splits, strict=cfg.splits.stratify and has_label
            )
            notes += warnings
        if "train" not in splits:
            raise DataError(
                f"{source_path}: no row in the train split ({len(kept)} rows)",
                hint="check data.splits fractions or your split column",
            )

        d = cfg.dedup
        if d.exact or d.near:
            pairs, lsh = dedup.find_duplicates(
                normalized,
                exact=d.exact,
                near=d.near,
                threshold=d.threshold,
                num_perm=d.num_perm,
                shingle_size=d.shingle_size,
                progress=bar.fraction(len(kept)),
            )
        else:
            pairs, lsh = [], {}
        removed = dedup.apply_policy(pairs, splits, d.policy)

    row_ids = [ids[i] for i in kept]
    examples: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for k, i in enumerate(kept):
        if k in removed:
            continue
        r = rows[i]
        examples[splits[k]].append(
            {"id": row_ids[k], "text": texts[k], "label": r.label, "target": r.target}
        )
    final_labels = {s: {e["label"] for e in examples[s]} for s in SPLITS}
    fractions = cfg.splits.model_dump()
    for lab in sorted({lab for lab in labels if lab is not None}) if method == "hash" else []:
        gone = [s for s in SPLITS if fractions[s] > 0 and lab not in final_labels[s]]
        if gone and not any(f"category {lab!r}" in n for n in notes):
            notes.append(f"category {lab!r} has no row left in {', '.join(gone)} after dedup")
    removed_list = [
        {
            "id": row_ids[k],
            "split": splits[k],
            "duplicate_of": row_ids[other],
            "duplicate_split": splits[other],
            "kind": p.kind if p else "cluster",
            "similarity": round(p.similarity, 4) if p else None,
        }
        for k, (other, p) in sorted(removed.items())
    ]
    pair_rows = [
        {
            "a": row_ids[p.a],
            "b": row_ids[p.b],
            "split_a": splits[p.a],
            "split_b": splits[p.b],
            "kind": p.kind,
            "similarity": round(p.similarity, 4),
            "label_a": labels[p.a],
            "label_b": labels[p.b],
        }
        for p in pairs
    ]
    summary = dedup.summarize(pairs, splits, labels)
    removed_by_split = {s: sum(1 for x in removed_list if x["split"] == s) for s in SPLITS}
    summary.update(removed=len(removed_list), removed_by_split=removed_by_split)
    dedup_config = d.model_dump(mode="json")
    duplicates = {
        "policy": d.policy,
        "threshold": d.threshold,
        "summary": summary,
        "removed": removed_list,
        "pairs": pair_rows,
    }
    dropped_rows = [
        {"id": ids[i], "rule": rule, "where": rows[i].where} for i, rule in cleaned.dropped
    ]
    outputs = {SPLIT_FILES[s]: _jsonl(examples[s]) for s in SPLITS}
    outputs["duplicates.json"] = dumps_json(duplicates).encode("utf-8")
    outputs["dropped.jsonl"] = _jsonl(dropped_rows)

    label_set = (
        task_labels
        if task_labels
        else (sorted({lab for lab in labels if lab is not None}) if has_label else None)
    )
    fields = cfg.fields.model_dump(mode="json")
    transforms = {
        "id": "data.fields.id, else sha256(text, label, target)[:16]"
        if cfg.source.format != "folder"
        else "path of the file inside data.source.path",
        "split_key": "sha256 of the normalized text",
        "normalization": NORMALIZATION,
        "max_examples": cfg.max_examples,
        "encoding_errors": cfg.source.encoding_errors,
        "glob": cfg.source.glob if cfg.source.format == "folder" else None,
    }
    manifest: dict[str, Any] = {
        "snapshot_id": "",
        "format_version": FORMAT_VERSION,
        "created_at": utc_now(),
        "source": {
            "format": cfg.source.format,
            "path": cfg.source.path,
            "resolved_path": str(source_path),
            "num_files": len(src.files),
            "files": src.files,
            "replaced_invalid_utf8_bytes": src.replaced_bytes,
            "links_followed": src.links,
        },
        "fields": fields,
        "task_labels": task_labels,
        "cleaning": {
            "rules": cleaned.effects,
            "sha256": rules_sha256(cfg.cleaning),
            "dropped": len(cleaned.dropped),
        },
        "transforms": {**transforms, "sha256": sha256_json(transforms)},
        "splits": {
            "config": cfg.splits.model_dump(mode="json"),
            "method": method,
            "sha256": sha256_json({"config": cfg.splits.model_dump(mode="json"), "m": method}),
            "moved_to_cover_small_categories": [
                {**mv, "row": ids[kept[mv["row"]]]} for mv in moved
            ],
        },
        "dedup": {
            "config": dedup_config,
            "policy": d.policy,
            "sha256": sha256_json(dedup_config),
            "normalization": NORMALIZATION,
            "algorithm": {
                "version": dedup.DEDUP_ALGORITHM_VERSION,
                "minhash_seed": 1,
                "verification": "exact Jaccard of word shingle sets",
                **lsh,
            },
        },
        "counts": {
            "rows_read": len(rows),
            "dropped_by_cleaning": len(cleaned.dropped),
            "sampled_out": sampled_out,
            "removed_as_duplicates": len(removed_list),
            "before_dedup": counts_by_category(splits, labels),
            "final": {s: len(examples[s]) for s in SPLITS},
            "per_category": counts_by_category(
                [s for s in SPLITS for _ in examples[s]],
                [e["label"] for s in SPLITS for e in examples[s]],
            ),
        },
        "duplicates": summary,
        "labels": label_set,
        "files": {name: sha256_bytes(data) for name, data in sorted(outputs.items())},
        "notes": notes,
    }
    snapshot_id = _identity(manifest)
    manifest["snapshot_id"] = snapshot_id

    final_dir = data_dir(study) / snapshot_id
    if final_dir.exists():
        existing = load_snapshot(study, snapshot_id)  # raises if it was tampered with
        _record_event(study, existing.manifest, reused=True)
        return {**existing.manifest, "unchanged": True}

    manifest["content_sha256"] = _content_sha(manifest)
    tmp = temp_dir_beside(final_dir)
    try:
        for name, data in outputs.items():
            write_bytes_atomic(tmp / name, data)
        write_bytes_atomic(tmp / "manifest.json", dumps_json(manifest).encode("utf-8"))
        publish_dir(tmp, final_dir)
    except (StudyError, OSError):
        remove_tree(tmp)
        if not (final_dir / "DONE").exists():
            raise
        # a concurrent `tunelab data` published the same snapshot first (one atomic rename)
        existing = load_snapshot(study, snapshot_id)
        _record_event(study, existing.manifest, reused=True)
        return {**existing.manifest, "unchanged": True}
    except BaseException:
        remove_tree(tmp)
        raise
    _record_event(study, manifest, reused=False)
    return manifest


def _record_event(study: Study, manifest: dict[str, Any], reused: bool) -> None:
    study.ledger.add_event(
        None,
        "data:snapshot",
        {
            "snapshot_id": manifest["snapshot_id"],
            "reused": reused,
            "counts": manifest["counts"]["final"],
            "removed_as_duplicates": manifest["counts"]["removed_as_duplicates"],
        },
    )


# ---------------------------------------------------------------- load and verify


@dataclass
class Snapshot:
    """A verified snapshot. `rows("train" | "validation")`; the test split is sealed."""

    id: str
    dir: Path
    manifest: dict[str, Any]

    @property
    def labels(self) -> list[str] | None:
        return self.manifest["labels"]

    @property
    def counts(self) -> dict[str, int]:
        return self.manifest["counts"]["final"]

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The examples of a split, re-checked against the manifest's sha256 as they are read."""
        if split == "test":
            raise EvaluationError(
                f"the test split of snapshot {self.id} is sealed",
                hint="evaluate on it only with `tunelab eval RUN --final`, which logs the "
                "opening (library code: tunelab.data.open_test_split)",
            )
        if split not in SPLITS:
            raise SnapshotError(
                f"no split {split!r} in snapshot {self.id}", hint="use train or validation"
            )
        return self._read(split)

    def _read(self, split: str) -> list[dict[str, Any]]:
        name = SPLIT_FILES[split]
        data = _verified_bytes(self.dir, name, self.manifest["files"].get(name), self.id)
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _tampered(snapshot_id: str, what: str) -> SnapshotError:
    return SnapshotError(
        f"snapshot {snapshot_id}: {what}; the snapshot was modified after it was made",
        hint="never edit snapshot files: rebuild with `tunelab data` (a new snapshot id) and "
        "rerun the stages that used this one",
    )


def _verified_bytes(folder: Path, name: str, expected: str | None, snapshot_id: str) -> bytes:
    path = folder / name
    if expected is None:
        raise _tampered(snapshot_id, f"{name} is not listed in its manifest")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _tampered(snapshot_id, f"{path} is missing") from None
    if sha256_bytes(data) != expected:
        raise _tampered(snapshot_id, f"{path} no longer matches its sha256 in manifest.json")
    return data


def list_snapshots(study: Study) -> list[str]:
    root = data_dir(study)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def latest_snapshot_id(study: Study) -> str | None:
    """The snapshot of the most recent `tunelab data` (ledger), else the newest on disk."""
    present = set(list_snapshots(study))
    for event in reversed(study.ledger.events()):
        if event["kind"] == "data:snapshot" and event["detail"]:
            sid = json.loads(event["detail"]).get("snapshot_id")
            if sid in present:
                return sid
    best: tuple[str, str] | None = None
    for sid in present:
        try:
            created = read_json(data_dir(study) / sid / "manifest.json")["created_at"]
        except Exception:  # noqa: BLE001 - an unreadable folder is not a candidate
            continue
        if best is None or created > best[0]:
            best = (created, sid)
    return best[1] if best else None


def _resolve_id(study: Study, snapshot_id: str | None) -> str:
    if snapshot_id is None:
        sid = latest_snapshot_id(study)
        if sid is None:
            raise SnapshotError(
                f"{study.root}: no data snapshot yet", hint=f"run `tunelab data -s {study.root}`"
            )
        return sid
    present = list_snapshots(study)
    if snapshot_id in present:
        return snapshot_id
    matches = [s for s in present if s.startswith(snapshot_id)]
    if len(matches) == 1:
        return matches[0]
    raise SnapshotError(
        f"no data snapshot {snapshot_id!r}"
        + (f" (ambiguous: {matches})" if matches else "")
        + f" in {data_dir(study)}",
        hint="snapshots: " + (", ".join(present) or "none; run `tunelab data`"),
    )


def load_snapshot(study: Study, snapshot_id: str | None = None) -> Snapshot:
    """Open a snapshot (None: the latest) after checking every file against its manifest.

    Raises SnapshotError when it is missing, unfinished or tampered with.
    """
    sid = _resolve_id(study, snapshot_id)
    folder = data_dir(study) / sid
    if not (folder / "DONE").exists():
        raise SnapshotError(
            f"snapshot {sid} is incomplete (no DONE marker)",
            hint="rebuild it with `tunelab data`",
        )
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        raise _tampered(sid, "manifest.json is missing or not valid JSON") from None
    if manifest.get("content_sha256") != _content_sha(manifest):
        raise _tampered(sid, "manifest.json no longer matches its content_sha256")
    try:
        identity = _identity(manifest)
    except (KeyError, TypeError):
        raise _tampered(sid, "manifest.json lacks fields its id is made of") from None
    if identity != sid or manifest.get("snapshot_id") != sid:
        raise _tampered(sid, "the folder name, the manifest's snapshot_id and its content disagree")
    listed = set(manifest["files"]) | {"manifest.json", "DONE"}
    extra = sorted(p.name for p in folder.iterdir() if p.name not in listed)
    if extra:
        raise _tampered(sid, f"unexpected file(s) {extra} in {folder}")
    for name, sha in manifest["files"].items():
        _verified_bytes(folder, name, sha, sid)
    return Snapshot(sid, folder, manifest)


def open_test_split(
    study: Study,
    snapshot: Snapshot | str,
    who: str,
    why: str,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """The sealed test split: verified, then the opening (who, when, why) logged in the ledger."""
    if not who or not who.strip() or not why or not why.strip():
        raise EvaluationError(
            "opening the test split needs who opens it and why",
            hint="e.g. open_test_split(study, snap, who='tunelab eval --final', why='final "
            "evaluation of the chosen variant')",
        )
    snap = snapshot if isinstance(snapshot, Snapshot) else load_snapshot(study, snapshot)
    name = SPLIT_FILES["test"]
    _verified_bytes(snap.dir, name, snap.manifest["files"].get(name), snap.id)
    study.ledger.log_test_opening(who, why, snap.id, run_id)
    return snap._read("test")
