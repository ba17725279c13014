"""`tunelab demo`: every stage of the protocol on a real model and real data, on CPU, in minutes.

The demo writes a real study (study.yaml pointing at the packaged assets), then runs each stage
as the user would: one `tunelab ...` command per stage, each in its own process, so what the demo
shows is exactly what the commands do. The dossier at the end is built from the records alone.

- classification (default): all-MiniLM-L6-v2 + a classification head, LoRA on query/value,
  BBC News topics; variant 2 changes one thing (the LoRA rank).
- extraction: SmolLM2-135M-Instruct + LoRA on all linear layers, SpamAssassin emails -> JSON
  {sender, subject, date, list}; variant 2 changes the learning rate.

After the comparison, the variant it adopts (the dossier's rule) is verified, evaluated once on
the sealed test split (`tunelab eval RUN --split test --final`, logged) and exported; without an
adopted variant the test split stays sealed.

`run_stages(study_dir, demo_stages(change, why), log) -> {study, dossier, timings_s, total_s,
runs}`; `runs["adopted"]` is {run_id, name, adopted}; the test opening's reason is `FINAL_WHY`.
`run_demo(task, dir)`; `DEMO_TASKS` includes "image" (`tunelab.demo.studies.image_study`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tunelab.core.errors import StudyError
from tunelab.demo.studies import classification_study, extraction_study, image_study

DEMO_TASKS = ("classification", "extraction", "image")
STUDIES = {
    "classification": classification_study,
    "extraction": extraction_study,
    "image": image_study,
}


# The one change of variant 2 and the question it asks, by demo task.
VARIANT_CHANGE = {
    "classification": (["--set", "adaptation.rank=16"], "does a larger LoRA rank help?"),
    "extraction": (["--set", "training.lr=2e-3"], "does a larger learning rate help?"),
    "image": (["--set", "training.lr=1e-3"], "does a smaller learning rate help?"),
}
FINAL_WHY = "final evaluation of the variant the comparison adopts"


@dataclass
class Stage:
    title: str
    args: list[str]
    capture: str | None = None  # key under which the JSON result (or `then`'s) is kept
    then: Callable[[Path, dict[str, Any]], Any] | None = None  # reads the records after it
    skip: str | None = None  # why the stage does not run


StageFn = Callable[[dict[str, Any]], Stage]


def adopted_variant(study: Path, results: dict[str, Any]) -> dict[str, Any]:
    """The variant the latest comparison adopts, by the dossier's rule; when none is, variant 1
    (verified and exported all the same, `adopted` False, with the reasons)."""
    from tunelab.core.record_types import Compare
    from tunelab.stages.report.decision import choose_variant

    latest = sorted((study / "records" / "compare").glob("*.json"))[-1]
    row, reasons = choose_variant(Compare.read(latest))
    if row is None:
        return {"run_id": results["v1"]["run_id"], "name": "v1", "adopted": False, "why": reasons}
    return {"run_id": row.run_id, "name": row.label, "adopted": True}


def _final_test(r: dict[str, Any]) -> Stage:
    """The sealed test split, opened once for the adopted variant (and not at all without one)."""
    v = r["adopted"]
    title = f"open the sealed test split once: {v['name']}"
    args = ["eval", v["run_id"], "--split", "test", "--final", "--why", FINAL_WHY]
    if not v["adopted"]:
        return Stage(title, args, skip="no variant is adopted: " + "; ".join(v["why"]))
    return Stage(title, args)


def demo_stages(change: list[str], why: str) -> list[StageFn]:
    """Every stage of the protocol, as commands; variant 2 changes `change` (asking `why`)."""
    return [
        lambda r: Stage("register the hypothesis", ["register"]),
        lambda r: Stage("data snapshot", ["data"]),
        lambda r: Stage("inspect the preprocessing", ["inspect", "--per-category", "1"]),
        lambda r: Stage("baseline of the untouched model", ["baseline"]),
        lambda r: Stage("smoke: two steps, eval, fresh-process reload", ["smoke"]),
        lambda r: Stage("size a full training step", ["size"]),
        # planned from the initial check, before any experiment: the dossier sets it against
        # what the later stages took
        lambda r: Stage("rental plan", ["plan", "--days", "3"]),
        lambda r: Stage("train variant 1", ["train", "--name", "v1", "--json"], capture="v1"),
        lambda r: Stage(
            "train variant 2 (one change)",
            ["train", "--name", "v2", "--parent", r["v1"]["run_id"], "--why", why, *change]
            + ["--json"],
            capture="v2",
        ),
        lambda r: Stage("evaluate variant 1", ["eval", r["v1"]["run_id"]]),
        lambda r: Stage("evaluate variant 2", ["eval", r["v2"]["run_id"]]),
        lambda r: Stage(
            "compare with guardrails", ["compare"], capture="adopted", then=adopted_variant
        ),
        lambda r: Stage(
            f"verify {r['adopted']['name']} in a fresh process", ["verify", r["adopted"]["run_id"]]
        ),
        _final_test,
        lambda r: Stage(
            f"export {r['adopted']['name']} bound to its base", ["export", r["adopted"]["run_id"]]
        ),
        lambda r: Stage("dossier", ["report"]),
    ]


def _run_stage(stage: Stage, study: Path) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "tunelab", *stage.args[:1], "--study", str(study), *stage.args[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if stage.capture is None or stage.then is not None:
        proc = subprocess.run(cmd, env=env)
        out = None
    else:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        out = proc.stdout
    if proc.returncode != 0:
        raise StudyError(
            f"demo stage '{stage.title}' failed (exit {proc.returncode}): {' '.join(cmd[2:])}",
            hint=f"the study is in {study}; rerun that command to see the error",
        )
    if out is not None:
        start = out.find("{")
        return json.loads(out[start:]) if start >= 0 else None
    return None


def run_stages(
    study: Path, stages: list[StageFn], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the stages in order on the study folder; returns durations and the dossier path."""
    results: dict[str, Any] = {}
    timings = []
    t_all = time.perf_counter()
    for make in stages:
        stage = make(results)
        if stage.skip:
            log(f"\n=== {stage.title}: skipped, {stage.skip}")
            continue
        log(f"\n=== {stage.title}: tunelab {' '.join(stage.args)}")
        t0 = time.perf_counter()
        out = _run_stage(stage, study)
        if stage.then is not None:
            out = stage.then(study, results)
        if stage.capture:
            results[stage.capture] = out
        timings.append((stage.title, time.perf_counter() - t0))
    return {
        "study": str(study),
        "dossier": str(study / "report" / "dossier.html"),
        "timings_s": timings,
        "total_s": time.perf_counter() - t_all,
        "runs": results,
    }


def run_demo(task: str, directory: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Create the study in `directory` and run every stage; returns durations and the dossier path."""
    if task not in DEMO_TASKS:
        raise StudyError(
            f"unknown demo task {task!r}", hint=f"choose one of {', '.join(DEMO_TASKS)}"
        )
    directory = Path(directory)
    if (directory / "study.yaml").exists():
        raise StudyError(f"{directory} already holds a study", hint="pass --dir to a new folder")
    directory.mkdir(parents=True, exist_ok=True)
    study = STUDIES[task](directory)
    (directory / "study.yaml").write_text(
        "# Written by `tunelab demo`: a real study on packaged assets.\n"
        + yaml.safe_dump(study, sort_keys=False)
    )
    if task == "image":
        from tunelab.demo.images import DIGITS_NOTE

        log(f"image demo: {DIGITS_NOTE}")
    return run_stages(directory, demo_stages(*VARIANT_CHANGE[task]), log)
