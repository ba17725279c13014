"""A plan study with hand-made sizing and finished-run records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from tunelab.core.records import write_json_atomic
from tunelab.core.study import Study


def _study(root: Path, model_dir: Path) -> Study:
    from helpers.study import build_study

    training = {
        "micro_batch_size": 4,
        "grad_accum_steps": 1,
        "max_steps": 20,
        "eval_every_steps": 10,
        "checkpoint_every_steps": 10,
    }
    build_study(
        root,
        "extraction",
        name="plan-test",
        model_dir=model_dir,
        set={"data.source": {"format": "jsonl", "path": "mail.jsonl"}},
        training=training,
        register=True,
        snapshot=False,
    )
    return Study.open(root)


def _sizing_record(study: Study, step_s: float = 0.5) -> dict:
    """A sizing record as `tunelab size` writes it (the fields the planner reads)."""
    record = {
        "id": "size-20260101-000000-abcdef",
        "device": "cpu",
        "seconds": 40.0,
        "facts": {"architecture": "causal_lm"},
        "lengths": {
            "p50": 60,
            "p95": 100,
            "max": 120,
            "mean": 64.0,
            "quantiles": list(range(20, 121)),
            "encode_train_s": 2.0,
            "split_counts": {"train": 160, "validation": 20, "test": 20},
        },
        "configurations": [
            {
                "label": "config @100",
                "status": "ok",
                "options": {"seq_len": 100, "micro_batch": 4, "grad_accum": 1},
                "measured": {"forward_s": 0.1, "load_s": 1.5, "projected_step_s": step_s},
            }
        ],
        "throughput": {"row": "config @100", "step_s": step_s, "tokens_per_s": 800.0},
    }
    write_json_atomic(study.records / "sizing" / f"{record['id']}.json", record)
    return record


def _finished_run(study: Study, kind: str, seconds: float, status: str = "completed") -> str:
    run = study.create_run(kind, name=kind)
    run.set_status(status)
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def iso(t: datetime) -> str:
        return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    end = start + timedelta(seconds=seconds)
    study.ledger.update_run(run.id, created_at=iso(start), finished_at=iso(end))
    return run.id
