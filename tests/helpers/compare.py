"""A study with hand-made evaluation records for comparison tests."""

from __future__ import annotations

from tunelab.lib import metrics as M


def _cls_rows(golds, preds):
    return [
        {"id": f"e{i}", "gold": g, "prediction": p, "correct": g == p}
        for i, (g, p) in enumerate(zip(golds, preds, strict=True))
    ]


def _study(tmp_path):
    from helpers.study import build_study
    from tunelab.core.study import Study

    root = build_study(
        tmp_path / "study",
        "classification",
        name="cmp",
        set={"task.labels": ["a", "b"], "evaluation.bootstrap_samples": 200},
        register=True,
        snapshot=False,
    )
    return Study.open(root)


def _record(study, run, golds, preds, spec="spec-1"):
    from tunelab.stages.evaluate.stage import record_evaluation

    rows = _cls_rows(golds, preds)
    record = {
        "split": "validation",
        "spec_sha256": spec,
        "template_sha256": "t",
        "hypothesis_version": 1,
        "task_kind": "classification",
        "labels": ["a", "b"],
        "fields": None,
        "n": len(rows),
        "metrics": M.classification_metrics(golds, preds, ["a", "b"]),
    }
    record_evaluation(run, record, rows)


GOLDS = ["a", "a", "b", "b"] * 10


BASE_P = ["a", "b", "a", "b"] * 10  # 50 %


GOOD_P = ["a", "a", "b", "b"] * 9 + ["a", "b", "a", "b"]  # 95 %


def _populate(study):
    from tunelab.core.study import Study

    base = study.create_run("baseline", name="baseline", data_snapshot="snap1")
    _record(study, base, GOLDS, BASE_P)
    base.set_status("completed")
    good = study.create_run(
        "train",
        name="r16",
        data_snapshot="snap1",
        why="more capacity",
        config=Study.open(study.root, ["adaptation.rank=16"]).config,
    )
    good.set_status("completed")
    ev = study.create_run("eval", parent=good.id, data_snapshot="snap1")
    _record(study, ev, GOLDS, GOOD_P)
    ev.set_status("completed")
    messy = study.create_run(
        "train",
        parent=good.id,
        data_snapshot="snap1",
        config=Study.open(
            study.root, ["adaptation.rank=16", "training.lr=1e-3", "training.seed=7"]
        ).config,
    )
    _record(study, messy, GOLDS, BASE_P)  # a run that recorded its own evaluation
    messy.set_status("completed")
    failed = study.create_run("train", name="oom", data_snapshot="snap1")
    failed.set_status("failed", "CUDA out of memory at step 3")
    other = study.create_run("train", name="other-spec", data_snapshot="snap1")
    _record(study, other, GOLDS, GOOD_P, spec="spec-2")
    other.set_status("completed")
    pending = study.create_run("train", name="pending", data_snapshot="snap1")
    pending.set_status("completed")
    return base, good, messy, failed, other, pending
