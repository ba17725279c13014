"""Stage 2, data: `run(study, progress=None)` builds a snapshot `records/data/<snapshot-id>/`.

It reads the source, cleans, samples, splits, finds duplicates, applies the policy and writes,
into a temporary folder published in one rename:

    train.jsonl, validation.jsonl, test.jsonl   the examples {"id", "text", "label", "target"}
    duplicates.json                              every duplicate pair and every removed row
    dropped.jsonl                                rows the cleaning rules dropped, with the rule
    manifest.json                                sources and their sha256, rules, counts, ...
    DONE

The id hashes the source files' content, the field mapping, the rules, the split and dedup
settings and the sha256 of every output file: the same inputs and rules give the same id (and
the existing snapshot is reused), any change gives a new one. Reading a snapshot back:
`tunelab.stages.data.snapshot`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.config_sections import DataConfig, DedupConfig
from tunelab.core.errors import DataError, StudyError
from tunelab.core.hashing import sha256_text
from tunelab.core.progress import Progress
from tunelab.core.records import (
    dumps_json,
    publish_dir,
    remove_tree,
    temp_dir_beside,
    write_bytes_atomic,
)
from tunelab.stages.data import dedup
from tunelab.stages.data.checks import RowsRead, control_notes, labels_changed, run_checks
from tunelab.stages.data.cleaning import CleaningResult, clean_texts, compile_rules
from tunelab.stages.data.hub import source_root
from tunelab.stages.data.manifest import Duplicates, Kept, Split, build_manifest
from tunelab.stages.data.readers import read_source
from tunelab.stages.data.snapshot import SPLIT_FILES, content_sha256, data_dir, load_snapshot
from tunelab.stages.data.source_files import SourceRow
from tunelab.stages.data.splits import (
    SPLITS,
    check_user_splits,
    counts_by_kinds,
    ensure_coverage,
    ensure_kind_coverage,
    kind_gaps,
    sample_by_hash,
    split_by_hash,
)

if TYPE_CHECKING:
    from tunelab.core.study import Study

# Show progress bars from this many rows (or files) on.
PROGRESS_FROM = 5000


# ---------------------------------------------------------------- progress


class _Bar:
    """Turns the readers' row counts and the duplicate search's progress into the caller's
    callback (core.progress: "reading" counts rows of an unknown total, the duplicate search's
    stages, "minhash", ..., a fraction of 1); silent without one or on small inputs (below
    PROGRESS_FROM rows)."""

    def __init__(self, progress: Progress | None):
        self.progress = progress

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def rows(self) -> Progress:
        """The readers' rows read, reported once PROGRESS_FROM are seen."""

        def update(what: str, done: float, total: float | None = None, text: str = "") -> None:
            if self.progress and done >= PROGRESS_FROM:
                self.progress(what, done, total, text)

        return update

    def fraction(self, rows: int) -> Progress:
        def update(what: str, done: float, total: float | None = None, text: str = "") -> None:
            if self.progress and rows >= PROGRESS_FROM:
                self.progress(what, done, total, text)

        return update


# ---------------------------------------------------------------- ids and labels


def _content_id(row: SourceRow) -> str:
    blob = "\x1f".join([row.text, row.label or "", row.target or ""])
    return sha256_text(blob)[:16]


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


# ---------------------------------------------------------------- build


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def run(study: Study, progress: Progress | None = None) -> dict[str, Any]:
    """Build (or find unchanged) the data snapshot of the study's `data` config.

    `progress(what, done, total)` (core.progress) hears of large inputs (the CLI draws the
    bars). Returns the manifest, plus `"unchanged": True` when an identical snapshot already existed.
    Raises DataError on bad input (naming file, line or row, and field), ConfigError on a bad
    rule, SnapshotError when an existing snapshot with the same id fails verification. Nothing
    is left behind on error.
    """
    cfg = study.config.data
    compile_rules(cfg.cleaning)  # a bad regular expression fails before any reading
    source_path = source_root(study)
    images = None
    with _Bar(progress) as bar:
        if study.config.task.kind == "image_classification":
            from tunelab.stages.data.image_sources import read_image_source

            src, images = read_image_source(source_path, cfg)
        else:
            src = read_source(source_path, cfg, bar.rows())
        read = RowsRead(src.rows, study.config, source_path)
        notes = list(src.notes) + run_checks(read)
        rows = src.rows
        ids = assign_ids(rows)
        cleaned = _clean(rows, cfg, source_path)
        kept = _keep(cleaned, cfg)
        if images is not None:  # an image's split key is its decoded pixels' hash
            kept.keys = [images.facts[i].pixel_sha256 for i in kept.index]
        notes += control_notes(kept.texts, [rows[i] for i in kept.index], "text")
        labels = [rows[i].label for i in kept.index]
        kinds = _target_kinds(study, [rows[i] for i in kept.index])
        split = _split(kept, labels, rows, cfg, read.has_label, source_path, kinds)
        notes += split.notes
        if images is not None:
            dups = _find_image_duplicates(kept, images, split.splits, cfg.dedup)
        else:
            dups = _find_duplicates(kept, split.splits, cfg.dedup, bar.fraction(len(kept.index)))

    row_ids = [ids[i] for i in kept.index]
    examples = _examples(rows, kept, row_ids, split.splits, dups.removed)
    image_outputs = _add_images(examples, images, kept, row_ids) if images else {}
    if split.method == "hash":
        notes += _emptied_categories(examples, labels, cfg, notes)
    duplicates = _duplicates_record(dups, row_ids, split.splits, labels, cfg.dedup)
    dropped_rows = [
        {"id": ids[i], "rule": rule, "where": rows[i].where} for i, rule in cleaned.dropped
    ]
    outputs = {SPLIT_FILES[s]: _jsonl(examples[s]) for s in SPLITS}
    outputs["duplicates.json"] = dumps_json(duplicates).encode("utf-8")
    outputs["dropped.jsonl"] = _jsonl(dropped_rows)
    outputs.update(image_outputs)
    kind_counts = None
    if kinds is not None:
        final = [k for k in range(len(kept.index)) if k not in dups.removed]
        final_splits, final_kinds = [split.splits[k] for k in final], [kinds[k] for k in final]
        kind_counts = counts_by_kinds(final_splits, final_kinds)
        notes += kind_gaps(final_splits, final_kinds, cfg.splits)
    manifest = build_manifest(
        read, src, cleaned, kept, split, dups, duplicates, examples, labels, ids, outputs, notes
    )
    manifest["counts"]["target_kinds"] = kind_counts  # not part of the id (see snapshot_identity)
    return _publish(study, manifest, outputs)


def _target_kinds(study: Study, rows: list[SourceRow]) -> list[list[str]] | None:
    """Each row's target kinds that extraction scoring treats apart; None for other tasks."""
    if study.config.task.kind != "extraction":
        return None
    from tunelab.lib.tasks import get_task

    task = get_task(study.config)
    return [task.target_kinds({"id": r.where, "target": r.target}) for r in rows]


def _clean(rows: list[SourceRow], cfg: DataConfig, source_path: Path) -> CleaningResult:
    """The cleaning rules over the texts; refuses when they drop every row or leave one empty."""
    cleaned = clean_texts([r.text for r in rows], cfg.cleaning)
    for effect in cleaned.effects:  # a rule on labels: check_label_spellings applied it
        effect["changed"] += labels_changed(rows) if effect["rule"] == "unify_labels" else 0
    if not cleaned.kept:
        by_rule = ", ".join(
            f"{e['rule']} dropped {e['dropped']}" for e in cleaned.effects if e["dropped"]
        )
        raise DataError(
            f"{source_path}: all {len(rows)} rows were dropped by the cleaning rules ({by_rule})",
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
    return cleaned


def _keep(cleaned: CleaningResult, cfg: DataConfig) -> Kept:
    """The cleaned rows with their split keys, sampled down to data.max_examples by hash."""
    kept, texts = cleaned.kept, cleaned.texts
    normalized = dedup.normalize_texts(texts)
    # the same keys as splits.content_keys(texts), without normalizing twice
    keys = [sha256_text(t) for t in normalized.to_pylist()]
    if cfg.max_examples is None or cfg.max_examples >= len(kept):
        return Kept(kept, texts, keys, normalized, 0)
    pick = sample_by_hash(keys, cfg.max_examples, cfg.splits.seed)
    return Kept(
        [kept[i] for i in pick],
        [texts[i] for i in pick],
        [keys[i] for i in pick],
        normalized.take(pick),
        len(kept) - len(pick),
    )


def _split(
    kept: Kept,
    labels: list[str | None],
    rows: list[SourceRow],
    cfg: DataConfig,
    has_label: bool,
    source_path: Path,
    kinds: list[list[str]] | None = None,
) -> Split:
    """The user's split column, else seeded hash splits that cover every small category (and,
    with stratify: target_kind, every kind of extraction target)."""
    if cfg.fields.split:
        splits = [rows[i].split or "" for i in kept.index]
        result = Split(splits, "column", [], check_user_splits(splits))
    else:
        splits, moved, warnings = ensure_coverage(
            split_by_hash(kept.keys, cfg.splits),
            kept.keys,
            labels,
            cfg.splits,
            strict=cfg.splits.stratify and has_label,
        )
        if kinds is not None and cfg.splits.stratify == "target_kind":
            splits, kind_moves = ensure_kind_coverage(splits, kept.keys, kinds, cfg.splits)
            moved += kind_moves
        result = Split(splits, "hash", moved, warnings)
    if "train" not in result.splits:
        raise DataError(
            f"{source_path}: no row in the train split ({len(kept.index)} rows)",
            hint="check data.splits fractions or your split column",
        )
    return result


def _find_duplicates(
    kept: Kept, splits: list[str], d: DedupConfig, progress: Progress
) -> Duplicates:
    """Exact and near duplicates of the kept rows, and the rows the policy removes."""
    if d.exact or d.near:
        pairs, lsh = dedup.find_duplicates(
            kept.normalized,
            exact=d.exact,
            near=d.near,
            threshold=d.threshold,
            num_perm=d.num_perm,
            shingle_size=d.shingle_size,
            progress=progress,
        )
    else:
        pairs, lsh = [], {}
    return Duplicates(pairs, lsh, dedup.apply_policy(pairs, splits, d.policy))


def _find_image_duplicates(
    kept: Kept, images: Any, splits: list[str], d: DedupConfig
) -> Duplicates:
    """Exact (decoded pixels) and near (dHash) duplicates of the kept images."""
    from tunelab.stages.data.images import find_image_duplicates

    facts = [images.facts[i] for i in kept.index]
    pairs, info = find_image_duplicates(facts, exact=d.exact, near=d.near, threshold=d.threshold)
    return Duplicates(pairs, info, dedup.apply_policy(pairs, splits, d.policy))


def _add_images(
    examples: dict[str, list[dict[str, Any]]], images: Any, kept: Kept, row_ids: list[str]
) -> dict[str, bytes]:
    """Each image example gains its stored file name and sha256; returns the files to store
    (`images/<sha256>.<ext>`) and `images.jsonl`, the facts of the train and validation images."""
    from tunelab.stages.data.images import stored_name

    by_id = {row_ids[k]: images.facts[i] for k, i in enumerate(kept.index)}
    out: dict[str, bytes] = {}
    facts_rows = []
    for s in SPLITS:
        for e in examples[s]:
            f = by_id[e["id"]]
            name = stored_name(f)
            e.update(image=name, image_sha256=f.sha256)
            out[name] = images.data[name]
            if s != "test":  # the sealed split's labels stay in test.jsonl alone
                facts_rows.append({"id": e["id"], "split": s, "label": e["label"], **f.to_dict()})
    out["images.jsonl"] = _jsonl(facts_rows)
    return out


def _examples(
    rows: list[SourceRow],
    kept: Kept,
    row_ids: list[str],
    splits: list[str],
    removed: dict[int, Any],
) -> dict[str, list[dict[str, Any]]]:
    """The examples of each split, in source order, without the removed duplicates."""
    examples: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for k, i in enumerate(kept.index):
        if k in removed:
            continue
        r = rows[i]
        examples[splits[k]].append(
            {"id": row_ids[k], "text": kept.texts[k], "label": r.label, "target": r.target}
        )
    return examples


def _emptied_categories(
    examples: dict[str, list[dict[str, Any]]],
    labels: list[str | None],
    cfg: DataConfig,
    notes: list[str],
) -> list[str]:
    """Notes for the categories that dedup left without a row in a split that has a share."""
    final_labels = {s: {e["label"] for e in examples[s]} for s in SPLITS}
    fractions = cfg.splits.model_dump()
    out = []
    for lab in sorted({lab for lab in labels if lab is not None}):
        gone = [s for s in SPLITS if fractions[s] > 0 and lab not in final_labels[s]]
        if gone and not any(f"category {lab!r}" in n for n in notes + out):
            out.append(f"category {lab!r} has no row left in {', '.join(gone)} after dedup")
    return out


def _duplicates_record(
    dups: Duplicates,
    row_ids: list[str],
    splits: list[str],
    labels: list[str | None],
    d: DedupConfig,
) -> dict[str, Any]:
    """duplicates.json: the policy, a summary, every removed row and every pair found."""
    removed_list = [
        {
            "id": row_ids[k],
            "split": splits[k],
            "duplicate_of": row_ids[other],
            "duplicate_split": splits[other],
            "kind": p.kind if p else "cluster",
            "similarity": round(p.similarity, 4) if p else None,
        }
        for k, (other, p) in sorted(dups.removed.items())
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
        for p in dups.pairs
    ]
    summary = dedup.summarize(dups.pairs, splits, labels)
    removed_by_split = {s: sum(1 for x in removed_list if x["split"] == s) for s in SPLITS}
    summary.update(removed=len(removed_list), removed_by_split=removed_by_split)
    return {
        "policy": d.policy,
        "threshold": d.threshold,
        "summary": summary,
        "removed": removed_list,
        "pairs": pair_rows,
    }


def _publish(study: Study, manifest: dict[str, Any], outputs: dict[str, bytes]) -> dict[str, Any]:
    """Write the snapshot folder in one rename; an identical snapshot already there is reused."""
    snapshot_id = manifest["snapshot_id"]
    final_dir = data_dir(study) / snapshot_id
    if final_dir.exists():
        existing = load_snapshot(study, snapshot_id)  # raises if it was tampered with
        _record_event(study, existing.manifest, reused=True)
        return {**existing.manifest, "unchanged": True}

    manifest["content_sha256"] = content_sha256(manifest)
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
