"""`tunelab data`: build (or verify) the study's data snapshot and print what happened."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import (
    JsonOpt,
    SetOpt,
    StudyDir,
    app,
    console,
    emit_json,
    open_study,
    table,
)
from tunelab.cli.progress import ProgressBoard
from tunelab.core.record_data import DataManifest, DuplicatePair, Duplicates
from tunelab.stages.data import load_snapshot
from tunelab.stages.data import stage as data_stage
from tunelab.stages.data.splits import SPLITS


@app.command()
def data(
    study: StudyDir = Path("."),
    sets: SetOpt = None,
    verify: Annotated[
        bool,
        typer.Option("--verify", help="Only check a snapshot's files against its manifest."),
    ] = False,
    snapshot: Annotated[
        str | None, typer.Option(help="Snapshot id (or prefix) for --verify; default latest.")
    ] = None,
    pairs: Annotated[int, typer.Option(help="How many duplicate pairs to show.")] = 10,
    progress: Annotated[bool, typer.Option(help="Progress bar on large inputs.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Read, clean, split and deduplicate the data into a sealed, content-addressed snapshot."""
    s = open_study(study, sets)
    if verify:
        snap = load_snapshot(s, snapshot)
        files = snap.record.files
        if json_out:
            emit_json({"snapshot_id": snap.id, "verified": True, "files": files})
            return
        console.print(
            f"[green]verified[/] snapshot {snap.id}: {len(files)} files match their sha256"
        )
        return
    with ProgressBoard(enabled=progress and not json_out, transient=True) as board:
        written = data_stage.run(s, progress=board.update)
    manifest = DataManifest.of(s.records / "data", written)  # as the stage wrote it
    path = s.records / "data" / manifest.snapshot_id
    if json_out:
        emit_json({**written, "path": str(path)})
        return
    _print_summary(manifest, path, pairs)


def _print_summary(m: DataManifest, path: Path, num_pairs: int) -> None:
    c, src = m.counts, m.source
    if m.unchanged:
        console.print(f"snapshot [bold]{m.snapshot_id}[/] unchanged (same inputs and rules)")
    console.print(
        f"read {c.rows_read} rows from {src.num_files} file(s) ({src.format}: {src.location})"
    )
    if src.replaced_invalid_utf8_bytes:
        console.print(
            f"[yellow]replaced {src.replaced_invalid_utf8_bytes} invalid UTF-8 byte(s)[/]"
        )

    if rules := m.cleaning.rules:
        rows = [[r.rule, _params(r.arguments), r.changed, r.dropped] for r in rules]
        console.print(
            table("cleaning rules (in order)", ["rule", "args", "changed", "dropped"], rows)
        )
    if c.sampled_out:
        console.print(f"max_examples: {c.sampled_out} rows left out by the seeded sample")
    console.print(_split_table(m))
    _print_duplicates(m, path, num_pairs)
    for note in m.notes or []:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"snapshot [bold]{m.snapshot_id}[/] in")
    console.print(f"  {path}", soft_wrap=True)  # kept whole for copying, however long
    console.print("the test split is sealed; it opens only with (each opening logged):")
    console.print("  tunelab eval RUN --split test --final")


def _split_table(m: DataManifest) -> Any:
    """Examples per split and category, with what dedup removed from each."""
    c, splits = m.counts, m.splits
    before, final = c.before_dedup or {}, c.per_category or {}
    labels = sorted({lab for s in SPLITS for lab in before[s]})
    rows = []
    for lab in labels:
        row: list[Any] = [lab]
        for s in SPLITS:
            b, f = before[s].get(lab, 0), final[s].get(lab, 0)
            row.append(f"{f}" if b == f else f"{f} (-{b - f})")
        rows.append(row)
    rows.append(["[bold]total[/]", *(str((c.final or {})[s]) for s in SPLITS)])
    cfg = splits.settings
    title = (
        "examples per split and category (split by "
        f"{'your column' if splits.method == 'column' else 'hash'}"
        + (
            f", {cfg.train:g}/{cfg.validation:g}/{cfg.test:g} seed {cfg.seed})"
            if splits.method == "hash"
            else ")"
        )
    )
    return table(title, ["category", *SPLITS], rows)


def _print_duplicates(m: DataManifest, path: Path, num_pairs: int) -> None:
    """Pairs within a split apart from pairs across splits; the pairs and label conflicts."""
    d, dedup = m.duplicates, m.dedup
    within = [[f"  {k}", v] for k, v in d.by_split(within=True).items()]
    across = [[f"  {k}", v] for k, v in d.by_split(within=False).items()]
    removed = ", ".join(f"{s} {n}" for s, n in (d.removed_by_split or {}).items())
    cfg = dedup.settings
    near = (
        f"dHash similarity >= {cfg.threshold:g}, at most "
        f"{dedup.max_hamming_distance} of 64 bits apart"
        if dedup.images
        else f"Jaccard >= {cfg.threshold:g} on word {cfg.shingle_size}-shingles"
    )
    console.print(
        table(
            f"duplicates (policy {dedup.policy}, near = {near})",
            ["", "pairs"],
            [
                ["exact", d.exact_pairs],
                ["near", d.near_pairs],
                ["within a split", d.within_split_pairs],
                *within,
                ["across splits", d.across_split_pairs],
                *across,
                ["rows involved", d.rows_involved],
                ["pairs with different labels", d.label_conflicts],
                ["[bold]removed[/]", f"{d.removed} ({removed})"],
            ],
        )
    )
    if not (d.exact_pairs or d.near_pairs):
        return
    pairs = Duplicates.read(path / "duplicates.json").pairs
    if num_pairs > 0:
        _print_pairs(pairs, num_pairs, dedup.images)
    if d.label_conflicts:
        _print_label_conflicts(pairs, str(dedup.policy), dedup.images)


def _print_pairs(pairs: list[DuplicatePair], num_pairs: int, images: bool) -> None:
    """The first `num_pairs` pairs: across splits first, then the most alike."""
    shown = sorted(pairs, key=lambda p: (p.split_a == p.split_b, -p.similarity))[:num_pairs]
    t = table(f"duplicate pairs (first {len(shown)}; all in duplicates.json)", [], [])
    for name in ("a", "b"):
        t.add_column(name, overflow="fold")  # ids wrap, never cut
    for name in ("splits", "kind", "similarity" if images else "jaccard"):
        t.add_column(name, no_wrap=True)
    for p in shown:
        t.add_row(p.a, p.b, p.splits, p.kind, f"{p.similarity:.3f}")
    console.print(t)


def _print_label_conflicts(
    pairs: list[DuplicatePair], policy: str, images: bool, worst: int = 5
) -> None:
    from tunelab.stages.data.dedup import label_conflict_groups

    groups = label_conflict_groups([p.raw for p in pairs])
    console.print(
        f"[bold yellow]warning:[/] {len(groups)} group(s) of identical or near-identical "
        f"{'images' if images else 'texts'} carry different labels; the worst:"
    )
    t = table(None, [], [])
    t.add_column("rows", justify="right", no_wrap=True)
    t.add_column("labels", overflow="fold")
    t.add_column("ids", overflow="fold")
    t.add_column("similarity" if images else "jaccard", no_wrap=True)
    for g in groups[:worst]:
        ids = sorted(g["rows"])
        t.add_row(
            str(len(ids)),
            ", ".join(f"{lab} x{n}" for lab, n in g["labels"].items()),
            "\n".join(ids[:6]) + (f"\n(+{len(ids) - 6} more)" if len(ids) > 6 else ""),
            f"{g['similarity']:.3f}",
        )
    console.print(t)
    keep = "" if policy == "drop_all_but_one" else " or set data.dedup.policy: drop_all_but_one"
    fix = (
        "move each image to its category's folder (or fix its label in the source), remove it"
        if images
        else "correct the labels in the source file, add a cleaning rule that drops or rewrites "
        "these rows"
    )
    console.print(
        f"[yellow]hint:[/] {fix}{keep} (every pair with its labels is in duplicates.json)"
    )


def _params(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items())
