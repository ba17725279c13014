"""Paired bootstrap, McNemar, flips, config diff grouping and flags, the comparison record."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from scipy import stats as scipy_stats

from helpers import MINIMAL_HYPOTHESIS
from helpers.compare import BASE_P, GOLDS, _cls_rows, _populate, _record, _study
from tunelab.core.config import StudyConfig
from tunelab.lib import metrics as M
from tunelab.lib.statistics import f1_stats, mcnemar, mean_stat, paired_bootstrap
from tunelab.stages.compare.diffs import config_diff, flips, group_of
from tunelab.stages.compare.evaluations import compare_evaluations, example_stats

# ---------------------------------------------------------------- bootstrap


def test_bootstrap_constant_difference_has_a_point_interval():
    base = [0.0, 1.0, 0.0, 1.0, 1.0] * 20
    var = [x + 0.25 for x in base]
    out = paired_bootstrap({"m": (mean_stat(base), mean_stat(var))}, len(base), samples=300)
    assert out["m"]["delta"] == pytest.approx(0.25)
    assert out["m"]["ci_low"] == pytest.approx(0.25) and out["m"]["ci_high"] == pytest.approx(0.25)


def test_bootstrap_mean_difference_matches_the_normal_interval():
    """Known case: for a mean of n paired differences, the percentile bootstrap interval is close
    to mean +- 1.96 sd / sqrt(n) (CLT), and the pairing removes the shared example effect."""
    rng = np.random.default_rng(0)
    n = 2000
    shared = rng.normal(0, 5, n)  # example difficulty, common to both: must cancel
    base = shared + rng.normal(0, 1, n)
    var = shared + 0.3 + rng.normal(0, 1, n)
    out = paired_bootstrap({"m": (mean_stat(base), mean_stat(var))}, n, samples=4000, seed=1)["m"]
    d = var - base
    half = 1.96 * d.std(ddof=1) / math.sqrt(n)
    assert out["delta"] == pytest.approx(d.mean())
    assert out["ci_low"] == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert out["ci_high"] == pytest.approx(d.mean() + half, abs=0.15 * half)
    # an unpaired interval would be ~5x wider; the paired one is not
    assert out["ci_high"] - out["ci_low"] < 2.5 * half


def test_bootstrap_agrees_with_scipy_for_macro_f1():
    rng = random.Random(0)
    labels = ["a", "b", "c"]
    golds = [rng.choice(labels) for _ in range(300)]
    p1 = [g if rng.random() < 0.6 else rng.choice(labels) for g in golds]
    p2 = [g if rng.random() < 0.75 else rng.choice(labels) for g in golds]
    s1, s2 = f1_stats(golds, p1, labels), f1_stats(golds, p2, labels)
    out = paired_bootstrap(
        {"macro_f1": (s1["macro_f1"], s2["macro_f1"])}, len(golds), samples=2000, seed=0
    )["macro_f1"]
    exact = (
        M.classification_metrics(golds, p2, labels)["macro_f1"]
        - (M.classification_metrics(golds, p1, labels)["macro_f1"])
    )
    assert out["delta"] == pytest.approx(exact)

    def delta(idx):
        idx = np.asarray(idx, dtype=int)
        g = [golds[i] for i in idx]
        return (
            M.classification_metrics(g, [p2[i] for i in idx], labels)["macro_f1"]
            - (M.classification_metrics(g, [p1[i] for i in idx], labels)["macro_f1"])
        )

    ref = scipy_stats.bootstrap(
        (np.arange(len(golds)),),
        lambda idx, axis=-1: np.apply_along_axis(delta, axis, idx),
        n_resamples=600,
        method="percentile",
        random_state=np.random.default_rng(5),
        vectorized=True,
    ).confidence_interval
    assert out["ci_low"] == pytest.approx(ref.low, abs=0.02)
    assert out["ci_high"] == pytest.approx(ref.high, abs=0.02)


def test_bootstrap_is_seeded():
    x, y = [0, 1, 1, 0, 1] * 10, [1, 1, 1, 0, 0] * 10
    pair = {"m": (mean_stat(x), mean_stat(y))}
    a = paired_bootstrap(pair, 50, samples=200, seed=3)
    b = paired_bootstrap(pair, 50, samples=200, seed=3)
    c = paired_bootstrap(pair, 50, samples=200, seed=4)
    assert a == b and a != c


def test_f1_stats_with_unit_weights_equal_the_metrics():
    rng = random.Random(1)
    labels = ["x", "y", "z", "w"]
    golds = [rng.choice(labels) for _ in range(100)]
    preds = [rng.choice(labels[:3]) for _ in range(100)]
    s = f1_stats(golds, preds, labels)
    m = M.classification_metrics(golds, preds, labels)
    ones = np.ones((1, 100))
    assert s["macro_f1"](ones)[0] == pytest.approx(m["macro_f1"])
    assert s["weighted_f1"](ones)[0] == pytest.approx(m["weighted_f1"])
    assert s["per_category_f1"](ones)[0].tolist() == pytest.approx(
        [m["per_category"][c]["f1"] for c in labels]
    )


# ---------------------------------------------------------------- McNemar and flips


def test_mcnemar_exact_hand_worked():
    # b = 1 (baseline right, variant wrong), c = 9: p = 2 * (C(10,0) + C(10,1)) / 2^10
    base = [True] * 1 + [False] * 9 + [True] * 5
    var = [False] * 1 + [True] * 9 + [True] * 5
    out = mcnemar(base, var)
    assert (out["b"], out["c"], out["method"]) == (1, 9, "exact")
    assert out["p_value"] == pytest.approx(22 / 1024)
    assert mcnemar([True, False], [True, False])["p_value"] == 1.0


def test_mcnemar_chi2_with_continuity():
    base = [True] * 10 + [False] * 30
    var = [False] * 10 + [True] * 30
    out = mcnemar(base, var)
    chi2 = (abs(10 - 30) - 1) ** 2 / 40
    assert out["method"] == "chi2_continuity" and out["statistic"] == pytest.approx(chi2)
    assert out["p_value"] == pytest.approx(scipy_stats.chi2.sf(chi2, 1))


def test_flips_lists_ids():
    out = flips(["a", "b", "c", "d"], [True, False, True, False], [True, True, False, False])
    assert out == {"improved": ["b"], "regressed": ["c"], "num_improved": 1, "num_regressed": 1}


# ---------------------------------------------------------------- config diff


def _config(**sections):
    raw = {
        "name": "s",
        "hypothesis": MINIMAL_HYPOTHESIS,
        "guardrails": [{"metric": "f1", "scope": "every_category"}],
        "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
        "model": {"path": "m"},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return StudyConfig.model_validate(raw).to_dict()


@pytest.mark.parametrize(
    "path,group",
    [
        ("adaptation.rank", "adaptation"),
        ("adaptation.target_modules", "adaptation"),
        ("training.lr", "optimizer and schedule"),
        ("training.max_steps", "optimizer and schedule"),
        ("training.precision", "precision and memory"),
        ("training.activation_checkpointing", "precision and memory"),
        ("data.splits.seed", "data"),
        ("preprocess.max_seq_len", "data"),
        ("data_snapshot", "data"),
        ("evaluation.batch_size", "evaluation"),
        ("training.checkpoint_every_steps", "bookkeeping"),
        ("model.path", "other"),
    ],
)
def test_group_of(path, group):
    assert group_of(path) == group


def test_one_change_is_not_flagged():
    parent = _config()
    child = _config(adaptation={"rank": 16, "alpha": 32})
    out = config_diff(parent, child, why=None, parent_snapshot="s1", child_snapshot="s1")
    assert {(c["path"], c["old"], c["new"]) for c in out["changes"]} == {
        ("adaptation.rank", 8, 16),
        ("adaptation.alpha", 16.0, 32.0),
    }
    assert out["groups"] == ["adaptation"] and out["flags"] == []


def test_two_groups_are_flagged_even_with_why():
    out = config_diff(
        _config(), _config(adaptation={"rank": 16}, training={"lr": 1e-3}), why="faster"
    )
    assert out["groups"] == ["adaptation", "optimizer and schedule"]
    assert len(out["flags"]) == 1 and "2 parameter groups" in out["flags"][0]


def test_seed_budget_and_data_need_a_why():
    child = _config(training={"seed": 1})
    flagged = config_diff(_config(), child)["flags"]
    assert flagged == ["seed changed (training.seed) without a --why"]
    assert config_diff(_config(), child, why="seed replicate")["flags"] == []
    flagged = config_diff(_config(), _config(training={"max_steps": 500}))["flags"]
    assert any("training budget" in f for f in flagged)
    flagged = config_diff(_config(), _config(), parent_snapshot="s1", child_snapshot="s2")["flags"]
    assert flagged == ["data changed (data_snapshot) without a --why"]


def test_micro_batch_split_with_same_effective_batch_is_memory():
    child = _config(training={"micro_batch_size": 4, "grad_accum_steps": 2})
    out = config_diff(_config(), child)
    assert out["groups"] == ["precision and memory"] and out["flags"] == []
    out = config_diff(_config(), _config(training={"micro_batch_size": 16}))
    assert out["groups"] == ["optimizer and schedule"]


def test_bookkeeping_changes_do_not_count():
    out = config_diff(
        _config(), _config(adaptation={"rank": 4}, training={"checkpoint_every_steps": 10})
    )
    assert out["groups"] == ["adaptation"] and out["flags"] == []


# ---------------------------------------------------------------- a whole comparison


def test_compare_evaluations_classification():
    labels = ["a", "b"]
    golds = ["a", "a", "b", "b", "a", "b"] * 10
    base_p = ["a", "b", "b", "a", "a", "a"] * 10
    var_p = ["a", "a", "b", "b", "a", "a"] * 10
    base_m = M.classification_metrics(golds, base_p, labels)
    var_m = M.classification_metrics(golds, var_p, labels)
    out = compare_evaluations(
        "classification",
        _cls_rows(golds, base_p),
        list(reversed(_cls_rows(golds, var_p))),  # pairing is by id, not by order
        baseline_metrics={"metrics": base_m},
        variant_metrics={"metrics": var_m},
        guardrails=[
            {"metric": "f1", "scope": "every_category", "value": -0.02, "relative_to": "baseline"}
        ],
        primary_metric="macro_f1",
        min_improvement=0.05,
        labels=labels,
        samples=500,
    )
    assert out["n_paired"] == 60
    assert out["metrics"]["accuracy"]["delta"] == pytest.approx(
        var_m["accuracy"] - base_m["accuracy"]
    )
    assert out["primary"]["delta"] == pytest.approx(var_m["macro_f1"] - base_m["macro_f1"])
    assert out["primary"]["meets_min_improvement"] is True
    assert out["primary"]["ci_low"] <= out["primary"]["delta"] <= out["primary"]["ci_high"]
    a = out["per_category"]["a"]["f1"]
    assert a["delta"] == pytest.approx(
        var_m["per_category"]["a"]["f1"] - base_m["per_category"]["a"]["f1"]
    )
    assert a["ci_low"] <= a["delta"] <= a["ci_high"]
    assert out["flips"]["num_improved"] == 20 and out["flips"]["num_regressed"] == 0
    assert out["mcnemar"]["c"] == 20 and out["mcnemar"]["p_value"] < 1e-4
    assert out["guardrails_pass"] is True and len(out["guardrails"]) == 2


def test_example_stats_extraction_reproduce_the_metrics():
    """The bootstrap statistics at weight one equal the recorded metrics, every path of a
    nested schema included (lists of objects, their sub-fields, a nested object)."""
    from tunelab.lib.tasks import ExtractionTask

    schema = {
        "type": "object",
        "required": ["s", "items", "meta"],
        "properties": {
            "s": {"type": "string"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["v", "u"],
                    "properties": {"v": {"type": "number"}, "u": {"type": "string"}},
                },
            },
            "meta": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}}},
        },
    }
    task = ExtractionTask("x", schema)
    rng = random.Random(2)

    def items():
        return [{"v": rng.choice([1, 2]), "u": rng.choice("ab")} for _ in range(rng.randint(0, 3))]

    rows = []
    for i in range(80):
        gold = {"s": rng.choice("xyz"), "items": items(), "meta": {"k": rng.choice("pq")}}
        pred = {"s": rng.choice("xyzuvw"), "items": items(), "meta": {"k": rng.choice("pq")}}
        raw = "garbage" if rng.random() < 0.2 else json.dumps(pred)
        ex = {"id": str(i), "target": json.dumps(gold)}
        v = task.verdicts(task.parse(raw), ex)
        rows.append({"id": str(i), "verdicts": v, "correct": v["correct"]})
    m = M.extraction_metrics([r["verdicts"] for r in rows], task.fields, task.paths)
    paths = list(m["per_field"])
    assert paths == ["s", "items", "items[].v", "items[].u", "meta", "meta.k"]
    overall, _, per_field = example_stats("extraction", rows, [], task.fields, paths)
    ones = np.ones((1, 80))
    for name, stat in overall.items():
        assert stat(ones)[0] == pytest.approx(m[name]), name
    for name, stat in per_field.items():
        assert stat(ones)[0].tolist() == pytest.approx([m["per_field"][p][name] for p in paths])


# ---------------------------------------------------------------- the study edge and the CLI


def test_compare_study_rows_and_record(tmp_path):
    from tunelab.stages.compare import stage as compare_stage
    from tunelab.stages.compare.stage import save_compare

    study = _study(tmp_path)
    base, good, messy, failed, other, pending = _populate(study)
    record = compare_stage.run(study)
    by = {r["run_id"]: r for r in record["runs"]}
    assert set(by) == {good.id, messy.id, failed.id, other.id, pending.id}
    g = by[good.id]
    assert g["compared"] and g["primary"]["metric"] == "macro_f1"
    assert g["metrics"]["accuracy"]["delta"] == pytest.approx(0.45)
    assert g["metrics"]["accuracy"]["ci_low"] > 0
    assert g["flips"]["num_improved"] == 18 and g["flips"]["num_regressed"] == 0
    assert g["config_diff"]["against"] == base.id
    assert [c["path"] for c in g["config_diff"]["changes"]] == ["adaptation.rank"]
    assert g["flags"] == [] and g["guardrails_pass"]
    m = by[messy.id]
    assert m["config_diff"]["against"] == good.id
    assert m["config_diff"]["groups"] == ["optimizer and schedule"]
    assert m["flags"] == ["seed changed (training.seed) without a --why"]
    assert m["metrics"]["accuracy"]["delta"] == 0.0
    assert not by[failed.id]["compared"]
    assert "CUDA out of memory" in by[failed.id]["not_compared_reason"]
    assert "evaluation spec differs" in by[other.id]["not_compared_reason"]
    assert "tunelab eval" in by[pending.id]["not_compared_reason"]
    path = save_compare(study, record)
    assert path.parent == study.records / "compare" and path.name == f"{record['id']}.json"


def test_compare_refuses_a_named_run_of_another_spec(tmp_path):
    from tunelab.core.errors import EvaluationError
    from tunelab.stages.compare import stage as compare_stage

    study = _study(tmp_path)
    _, good, _, _, other, _ = _populate(study)
    assert compare_stage.run(study, [good.id])["runs"][0]["compared"]
    with pytest.raises(EvaluationError, match="refusing to compare.*evaluation spec differs"):
        compare_stage.run(study, [other.id])


def test_compare_without_baseline_says_what_to_run(tmp_path):
    from tunelab.core.errors import EvaluationError
    from tunelab.stages.compare import stage as compare_stage

    study = _study(tmp_path)
    with pytest.raises(EvaluationError) as err:
        compare_stage.run(study)
    assert "tunelab baseline" in err.value.hint


def test_compare_before_any_training_run_says_what_to_run(tmp_path, capsys):
    from helpers import run_cli

    study = _study(tmp_path)
    base = study.create_run("baseline", name="baseline", data_snapshot="snap1")
    _record(study, base, GOLDS, BASE_P)
    base.set_status("completed")
    code, out, err = run_cli(capsys, "compare", "--study", study.root)
    assert code == 2, (out, err)
    assert f"no training run to compare with the baseline {base.id} yet" in err
    assert "tunelab train" in err and not (study.records / "compare").exists()


def test_compare_cli_json_and_tables(tmp_path, capsys):
    import json

    from helpers import run_cli

    study = _study(tmp_path)
    _, good, *_ = _populate(study)
    study.ledger.log_test_opening("a", "first", "snap1", None)
    study.ledger.log_test_opening("b", "again", "snap1", None)
    code, out, err = run_cli(capsys, "compare", "-s", study.root, "--json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["test_openings"] == 2 and "opened 2 times" in err
    assert (study.records / "compare" / f"{rec['id']}.json").exists()
    code, out, err = run_cli(capsys, "compare", good.id, "-s", study.root)
    assert code == 0, err
    assert "guardrails" in out and "adaptation.rank" in out and "McNemar" in out
    code, out, err = run_cli(capsys, "compare", "nope", "-s", study.root)
    assert code == 2 and "not found" in err


def test_compare_rescores_extraction_records_of_an_earlier_scorer(make_study):
    """Rows recorded by a scorer that read `{...}` + a stray fence as not JSON are judged again
    from their raw outputs, so the baseline and the variant are scored by the same rules."""
    from tunelab.core.study import Study
    from tunelab.stages.compare import stage as compare_stage
    from tunelab.stages.evaluate.stage import record_evaluation

    root = make_study(
        "extraction", name="old", evaluation={"bootstrap_samples": 100}, register=True,
        snapshot=False,
    )  # fmt: skip
    study = Study.open(root)
    gold = {"sender": "a@x.org", "subject": "Hi"}
    answer = json.dumps(gold)

    def old_rows(outputs):  # the shape an earlier scorer recorded: no per-path counts
        return [
            {"id": str(i), "gold": gold, "raw_output": out, "prediction": None,
             "correct": False, "verdicts": {"json_valid": False, "schema_valid": False,
                                            "failure": "parse_error"}}
            for i, out in enumerate(outputs)
        ]  # fmt: skip

    runs = []
    for kind, outputs in (("baseline", [answer + "\n```", "no"]), ("train", [answer, "no"])):
        run = study.create_run(kind, name=kind, data_snapshot="s")
        record = {"split": "validation", "spec_sha256": "spec", "template_sha256": "t",
                  "hypothesis_version": 1, "task_kind": "extraction",
                  "fields": ["sender", "subject"], "n": 2,
                  "metrics": {"json_valid_rate": 0.0, "field_micro_f1": 0.0}}  # fmt: skip
        record_evaluation(run, record, old_rows(outputs))
        run.set_status("completed")
        runs.append(run)
    out = compare_stage.run(study)
    assert out["baseline"]["metrics"]["json_valid_rate"] == 0.5  # the stray fence reads now
    assert "judged again by tunelab-extraction/3" in out["warnings"][0]
    (row,) = out["runs"]
    assert row["metrics"]["json_valid_rate"]["delta"] == 0.0
    assert row["metrics"]["field_micro_f1"]["delta"] == 0.0
    assert any("judged again" in n for n in row["notes"])


def test_a_damaged_evaluation_or_prediction_line_stops_compare_naming_it(tmp_path, capsys):
    """A variant's metrics record with a field of the wrong type, or a prediction line without
    its id, stops `tunelab compare` with exit 2 naming the file, the line and the field (not a
    TypeError or KeyError), and no comparison is written."""
    import json

    from helpers import run_cli

    study = _study(tmp_path)
    _, _, messy, _, other, _ = _populate(study)
    metrics = other.dir / "metrics-validation.json"
    record = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**record, "spec_sha256": 7}))
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 2, (out, err)
    assert "metrics-validation.json" in err and "'spec_sha256' is 7, not a string" in err
    metrics.write_text(json.dumps(record))
    predictions = messy.dir / "predictions-validation.jsonl"
    lines = predictions.read_text().splitlines()
    lines[2] = json.dumps({k: v for k, v in json.loads(lines[2]).items() if k != "id"})
    predictions.write_text("\n".join(lines) + "\n")
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 2, (out, err)
    assert "predictions-validation.jsonl: line 3: field 'id' is missing" in err
    assert not (study.records / "compare").exists()
