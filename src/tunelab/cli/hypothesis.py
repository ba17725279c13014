"""Stage 1, the hypothesis: init (a commented study.yaml), register (lock the question)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tunelab.cli.common import JsonOpt, SetOpt, StudyDir, app, console, emit_json, open_study, table
from tunelab.core.evidence import pins_of
from tunelab.core.record_base import mapping_of
from tunelab.core.record_types import Hypothesis
from tunelab.core.run_parts import Pin, PowerEstimate
from tunelab.stages.hypothesis import stage as hyp
from tunelab.stages.hypothesis.pins import resolve_pins
from tunelab.stages.hypothesis.power import registration_power
from tunelab.stages.hypothesis.template import TASK_KINDS, init_study


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="Folder of the new study.")],
    task: Annotated[
        str, typer.Option(help=f"Task kind: {' | '.join(TASK_KINDS)}.")
    ] = "classification",
    name: Annotated[str | None, typer.Option(help="Study name (default: folder name).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Create a study folder with a commented study.yaml for the task kind."""
    path = init_study(directory, task, name)
    if json_out:
        emit_json({"study_yaml": str(path)})
        return
    console.print(f"wrote [bold]{path}[/]")
    console.print("next: edit hypothesis, guardrails, data and model, then `tunelab validate`")


@app.command()
def register(
    study: StudyDir = Path("."),
    sets: SetOpt = None,
    repin: Annotated[
        bool, typer.Option("--repin", help="Resolve hub refs (main, tags) to their commit again.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Lock the hypothesis, guardrails and evaluation procedure (a new version when changed);
    a base or data set named by hub id is pinned to the commit its revision resolves to."""
    s = open_study(study, sets)
    hyp.check_registrable(s.config, s.overrides)  # before any download
    pins, notes = resolve_pins(s.config, pins_of(s.root), repin=repin)
    power = registration_power(s, s.config)
    record, created = hyp.run(s.root, s.config, pins, power)
    h = Hypothesis.of(s.records / f"hypothesis-v{record.get('version')}.json", record)
    if created:
        s.ledger.add_event(
            None, "hypothesis:registered", {"version": h.version, "sha256": h.sha256}
        )
    if json_out:
        emit_json({"created": created, "notes": notes, "power": power, **record})
        return
    for key, pin in mapping_of(Pin, "pins", pins, "pins").items():
        line = f"  {key}: {pin.repo_id}@{pin.revision} pinned to commit {pin.commit}"
        console.print(line, soft_wrap=True)  # a commit is copied whole, not cut at the margin
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    v, sha = h.version, h.sha256
    if not created:
        console.print(f"hypothesis v{v} already registered, unchanged (sha256 {sha[:12]})")
        print_power(power)
        return
    console.print(f"[green]registered[/] records/hypothesis-v{v}.json  sha256 {sha[:12]}")
    if h.changes:
        rows = [[d.key, d.old, d.new] for d in h.changes]
        console.print(table(f"amendment of v{v - 1}", ["field", "was", "now"], rows))
    for g in s.config.guardrails:
        console.print(f"  guardrail: {g.describe()}")
    print_power(power)


def print_power(estimate: dict[str, Any]) -> None:
    """The detectable effect and the warnings it earns (register, validate, baseline)."""
    power = PowerEstimate.of("power", estimate)
    effect = power.detectable_effect
    if effect is None:
        console.print(f"detectable effect: not known ({power.note or 'no estimate'})")
    else:
        console.print(
            f"detectable effect: {power.metric} {effect:+.4f} on {power.n} validation "
            f"examples (one-sided level {power.level:.3g}, {power.power:.0%} power; "
            f"from {power.source})",
            soft_wrap=True,
        )
    for warning in power.warnings or []:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
