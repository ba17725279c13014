"""The top-level help: commands in the protocol's order, grouped by stage, one line each."""

from __future__ import annotations

from typing import Any

import typer.core

# (panel, [(command, one-line summary)]) in the protocol's order. A summary fits the 80-column
# help's command panel (about 60 characters); the command's own --help keeps the full docstring.
PROTOCOL: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "1 Hypothesis",
        [
            ("init", "Create a study folder with a commented study.yaml"),
            ("validate", "Check study.yaml and its data; every problem at once"),
            ("register", "Lock the hypothesis, guardrails and evaluation procedure"),
        ],
    ),
    (
        "2-3 Data",
        [
            ("data", "Clean, split, deduplicate into a sealed snapshot"),
            ("inspect", "Show examples after training's exact preprocessing"),
        ],
    ),
    (
        "4-6 Baseline, adaptation, sizing",
        [
            ("baseline", "Evaluate the untouched base model on validation"),
            ("smoke", "A few examples through train, eval and a reload"),
            ("size", "Measure steps against the memory model; recommend a batch"),
        ],
    ),
    (
        "7 Train",
        [
            ("train", "Train a run with a new id and atomic checkpoints"),
            ("resume", "Continue an interrupted run to the same result"),
            ("launch", "A SkyPilot task or Slurm script that trains a run"),
        ],
    ),
    (
        "8-10 Evaluate, compare, verify",
        [
            ("eval", "Evaluate a run with the baseline's procedure"),
            ("compare", "Runs against the baseline: deltas, intervals, guardrails"),
            ("verify", "Reload a checkpoint in a new process; same predictions"),
        ],
    ),
    (
        "11-13 Export, plan, report",
        [
            ("export", "Export the adapter or model with its manifest"),
            ("check-export", "Verify an export against its manifest and base"),
            ("plan", "A rental plan by phase from measured times"),
            ("report", "Build the dossier (HTML and Markdown) from the records"),
        ],
    ),
    (
        "Records and environment",
        [
            ("runs", "List every attempt, failed ones included, with reasons"),
            ("track", "Mirror the study's runs into MLflow"),
            ("env", "Python, OS, torch, CUDA/ROCm, GPUs, attention kernels"),
            ("models", "The models and data sets in the hub cache"),
            ("hub-cache", "Put a local folder into the hub cache as a repo id"),
            ("demo", "Every stage on a real small model and data set"),
        ],
    ),
]


def _name(info: Any) -> str:
    return info.name or info.callback.__name__.replace("_", "-")


def arrange_commands(app: typer.Typer) -> None:
    """Order `app`'s commands as the protocol runs, each under its stage's panel with a one-line
    summary; a command missing from PROTOCOL is listed last under "Other"."""
    place: dict[str, tuple[int, str, str]] = {}
    for panel, items in PROTOCOL:
        for name, summary in items:
            place[name] = (len(place), panel, summary)
    for info in app.registered_commands:
        _, panel, summary = place.get(_name(info), (len(place), "Other", None))
        info.rich_help_panel = panel
        if summary and not info.short_help:
            info.short_help = summary
    app.registered_commands.sort(key=lambda info: place.get(_name(info), (len(place),))[0])
    _hide_flag_types()


def _hide_flag_types() -> None:
    """A flag takes no value: the help shows no `<bool>` type beside `--json` or `--help`."""
    option = typer.core.TyperOption
    if getattr(option, "_tunelab_flags_hidden", False) or not hasattr(option, "display_type_rich"):
        return  # a typer without this column (before 0.2x) shows no type for a flag
    shown = option.display_type_rich

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    option.display_type_rich = display_type_rich  # type: ignore[method-assign]
    option._tunelab_flags_hidden = True  # type: ignore[attr-defined]
