"""Metrics against hand-worked examples and scikit-learn on random data; guardrail checking."""

from __future__ import annotations

import json
import random

import pytest
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
)

from tunelab.core.config_sections import GuardrailRule
from tunelab.lib import metrics as M
from tunelab.stages.compare.guardrails import all_pass, check_guardrails

# ---------------------------------------------------------------- classification


def test_classification_hand_worked():
    # gold: a a a b b c ; pred: a a b b c c
    golds = ["a", "a", "a", "b", "b", "c"]
    preds = ["a", "a", "b", "b", "c", "c"]
    m = M.classification_metrics(golds, preds, ["a", "b", "c"])
    # a: tp 2, predicted 2, support 3 -> P 1, R 2/3, F1 0.8
    # b: tp 1, predicted 2, support 2 -> P 1/2, R 1/2, F1 1/2
    # c: tp 1, predicted 2, support 1 -> P 1/2, R 1, F1 2/3
    assert m["per_category"]["a"] == pytest.approx(
        {"precision": 1.0, "recall": 2 / 3, "f1": 0.8, "support": 3}
    )
    assert m["per_category"]["b"] == pytest.approx(
        {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2}
    )
    assert m["per_category"]["c"] == pytest.approx(
        {"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 1}
    )
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["macro_f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert m["weighted_f1"] == pytest.approx((0.8 * 3 + 0.5 * 2 + 2 / 3 * 1) / 6)
    assert m["confusion"]["matrix"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert m["confusion"]["predicted"] == ["a", "b", "c"]


def test_classification_prediction_outside_labels_gets_a_column():
    m = M.classification_metrics(["a", "b"], ["a", None], ["a", "b"])
    assert m["confusion"]["predicted"] == ["a", "b", M.NO_PREDICTION]
    assert m["confusion"]["matrix"] == [[1, 0, 0], [0, 0, 1]]
    assert m["per_category"]["b"]["recall"] == 0.0
    assert m["accuracy"] == 0.5


def test_classification_rejects_unknown_gold():
    with pytest.raises(ValueError, match="outside the label set"):
        M.classification_metrics(["z"], ["a"], ["a", "b"])


@pytest.mark.parametrize("seed", range(8))
def test_classification_matches_sklearn_on_random_data(seed):
    rng = random.Random(seed)
    labels = [f"c{i}" for i in range(rng.randint(2, 7))]
    n = rng.randint(1, 300)
    golds = [rng.choice(labels) for _ in range(n)]
    # biased predictions so some categories are never predicted (zero_division paths)
    preds = [
        g if rng.random() < 0.5 else rng.choice(labels[: max(1, len(labels) // 2)]) for g in golds
    ]
    m = M.classification_metrics(golds, preds, labels)
    p, r, f, s = precision_recall_fscore_support(
        golds, preds, labels=labels, zero_division=0, average=None
    )
    for i, label in enumerate(labels):
        assert m["per_category"][label]["precision"] == pytest.approx(p[i])
        assert m["per_category"][label]["recall"] == pytest.approx(r[i])
        assert m["per_category"][label]["f1"] == pytest.approx(f[i])
        assert m["per_category"][label]["support"] == s[i]
    assert m["accuracy"] == pytest.approx(accuracy_score(golds, preds))
    assert m["macro_f1"] == pytest.approx(
        f1_score(golds, preds, labels=labels, average="macro", zero_division=0)
    )
    assert m["weighted_f1"] == pytest.approx(
        f1_score(golds, preds, labels=labels, average="weighted", zero_division=0)
    )
    mp, mr, _, _ = precision_recall_fscore_support(
        golds, preds, labels=labels, zero_division=0, average="macro"
    )
    assert m["macro_precision"] == pytest.approx(mp)
    assert m["macro_recall"] == pytest.approx(mr)
    assert m["confusion"]["matrix"] == confusion_matrix(golds, preds, labels=labels).tolist()


# ---------------------------------------------------------------- format


def test_format_metrics_counts_failures():
    m = M.format_metrics(
        [True, False, False, True, False],
        [None, "parse_error", "schema_error", None, "parse_error"],
        json_valid=[True, False, True, True, False],
        schema_valid=[True, False, False, True, False],
        exact=[True, False, False, False, False],
    )
    assert m["format_valid_rate"] == pytest.approx(0.4)
    assert m["failure_counts"] == {"parse_error": 2, "schema_error": 1}
    assert m["json_valid_rate"] == pytest.approx(0.6)
    assert m["schema_valid_rate"] == pytest.approx(0.4)
    assert m["exact_match"] == pytest.approx(0.2)


# ---------------------------------------------------------------- extraction


def _task(fields):
    from tunelab.lib.tasks import ExtractionTask

    return ExtractionTask("x", {"type": "object", "required": list(fields)})


def _verdicts(task, preds, golds):
    """The task's verdicts of answers given as objects (None: an output that is not JSON)."""
    out = []
    for i, (p, g) in enumerate(zip(preds, golds, strict=True)):
        raw = "garbage" if p is None else json.dumps(p)
        out.append(task.verdicts(task.parse(raw), {"id": str(i), "target": json.dumps(g)}))
    return out


def test_extraction_metrics_hand_worked():
    """Flat string fields score as they did before scoring followed the schema's paths."""
    fields = ["sender", "subject"]
    golds = [
        {"sender": "a@x.org", "subject": "Hi"},
        {"sender": "b@x.org", "subject": "Lunch"},
        {"sender": "c@x.org", "subject": "Report"},
        {"sender": "d@x.org", "subject": "News"},
    ]
    preds = [
        {"sender": "a@x.org", "subject": "Hi"},  # both exact
        {"sender": "B@x.org", "subject": "Dinner"},  # sender normalized only, subject wrong
        None,  # unparsable
        {"sender": "d@x.org"},  # subject missing (schema error)
    ]
    task = _task(fields)
    m = M.extraction_metrics(_verdicts(task, preds, golds), fields, task.paths)
    assert m["json_valid_rate"] == 0.75
    assert m["schema_valid_rate"] == 0.5
    pf = m["per_field"]
    assert pf["sender"]["presence_rate"] == 0.75
    assert pf["sender"]["exact_match"] == 0.5  # examples 1 and 4
    assert pf["sender"]["normalized_match"] == 0.75  # 1, 2, 4
    assert pf["subject"]["presence_rate"] == 0.5
    assert pf["subject"]["exact_match"] == 0.25
    # sender: tp 3, predicted 3, gold 4 -> P 1, R 3/4
    assert pf["sender"]["precision"] == 1.0 and pf["sender"]["recall"] == 0.75
    assert pf["sender"]["f1"] == pytest.approx(2 * 0.75 / 1.75)
    # subject: tp 1, predicted 2, gold 4
    assert pf["subject"]["precision"] == 0.5 and pf["subject"]["recall"] == 0.25
    assert m["field_presence_rate"] == pytest.approx((0.75 + 0.5) / 2)
    assert m["field_exact_match"] == pytest.approx((0.5 + 0.25) / 2)
    # micro: tp 4, predicted 5, gold 8
    assert m["field_micro_precision"] == pytest.approx(4 / 5)
    assert m["field_micro_recall"] == pytest.approx(4 / 8)
    assert m["field_micro_f1"] == pytest.approx(8 / 13)
    assert m["exact_match"] == 0.25
    assert m["all_fields_match_rate"] == 0.25
    # the failed slots, by kind: subject wrong in 2, missing in 4, not JSON in 3
    assert pf["subject"]["failures"] == {
        "missing": 1, "wrong_type": 0, "wrong_value": 1, "not_json": 1
    }  # fmt: skip
    assert m["failure_counts"] == {"no_json": 1, "schema_error": 1}


def test_field_micro_f1_matches_sklearn_on_random_data():
    """Micro-F1 over (example, field) slots equals sklearn's binary F1 on the pooled slots."""
    rng = random.Random(3)
    fields = ["f1", "f2", "f3"]
    values = ["x", "y", "z"]
    golds, preds, y_true, y_pred = [], [], [], []
    for _ in range(200):
        gold = {f: rng.choice(values + [None]) for f in fields}
        pred = {f: rng.choice(values + [None, None]) for f in fields}
        golds.append(gold), preds.append(pred)
        for f in fields:
            # a slot: gold positive when gold present; predicted positive when predicted
            # present; a predicted value that is wrong is a false positive AND a false negative
            g, p = gold[f], pred[f]
            if p is not None and g is not None and p == g:
                y_true.append(1), y_pred.append(1)
            else:
                if p is not None:
                    y_true.append(0), y_pred.append(1)
                if g is not None:
                    y_true.append(1), y_pred.append(0)
    task = _task(fields)
    m = M.extraction_metrics(_verdicts(task, preds, golds), fields, task.paths)
    assert m["field_micro_f1"] == pytest.approx(f1_score(y_true, y_pred))


# ---------------------------------------------------------------- guardrails


BASE = {
    "macro_f1": 0.70,
    "per_category": {
        "a": {"f1": 0.80, "precision": 0.9, "recall": 0.7},
        "b": {"f1": 0.60, "precision": 0.5, "recall": 0.75},
    },
    "per_field": {"sender": {"presence_rate": 0.9}, "subject": {"presence_rate": 0.5}},
    "json_valid_rate": 0.9,
}


def test_guardrail_relative_per_category_with_numbers():
    run = {
        "metrics": {
            "per_category": {"a": {"f1": 0.79}, "b": {"f1": 0.57}},
        }
    }
    rule = GuardrailRule(
        metric="f1", scope="every_category", op=">=", value=-0.02, relative_to="baseline"
    )
    out = check_guardrails([rule], BASE, run)
    by = {v["item"]: v for v in out}
    assert by["a"]["pass"] is True and by["a"]["bound"] == pytest.approx(0.78)
    assert by["b"]["pass"] is False and by["b"]["value"] == 0.57
    assert by["b"]["baseline"] == 0.60 and by["b"]["bound"] == pytest.approx(0.58)
    assert not all_pass(out)


def test_a_category_without_a_gold_example_is_not_judged_a_pass():
    """f1 0 against a baseline's 0 passed a relative rule for a category the split lacks."""
    empty = {"f1": 0.0, "precision": 0.0, "recall": 0.0, "support": 0}
    base = {"per_category": {"a": {"f1": 0.8, "support": 5}, "c": dict(empty)}}
    run = {"per_category": {"a": {"f1": 0.8, "support": 5}, "c": dict(empty)}}
    rule = {"metric": "f1", "scope": "every_category", "value": -0.02, "relative_to": "baseline"}
    by = {v["item"]: v for v in check_guardrails([rule], base, run)}
    assert by["a"]["pass"] is True and by["a"]["note"] is None
    assert by["c"]["pass"] is False
    assert by["c"]["note"] == "'c' has no examples in this split: its f1 cannot be judged"
    # the count itself is judged as any metric; a field is empty when it has no slot
    support = {"metric": "support", "scope": "every_category", "op": ">=", "value": 0}
    assert all_pass(check_guardrails([support], None, run))
    fields = {"per_field": {"sender": {"presence_rate": 0.0, "slots": 0}}}
    presence = {"metric": "field_presence_rate", "scope": "every_field", "op": ">=", "value": 0}
    (verdict,) = check_guardrails([presence], None, fields)
    assert verdict["pass"] is False and "'sender' has no slots" in verdict["note"]


def test_guardrail_bound_equal_to_value_passes_despite_float_noise():
    run = {"per_category": {"a": {"f1": 0.78}, "b": {"f1": 0.58}}}
    rule = {"metric": "f1", "scope": "every_category", "value": -0.02, "relative_to": "baseline"}
    assert all_pass(check_guardrails([rule], BASE, run))


def test_guardrail_absolute_and_field_prefix():
    run = {
        "json_valid_rate": 0.95,
        "per_field": {"sender": {"presence_rate": 0.92}, "subject": {"presence_rate": 0.40}},
    }
    rules = [
        {"metric": "json_valid_rate", "scope": "overall", "op": ">=", "value": 0.99},
        {
            "metric": "field_presence_rate",
            "scope": "every_field",
            "op": ">=",
            "value": -0.02,
            "relative_to": "baseline",
        },
    ]
    out = check_guardrails(rules, BASE, run)
    assert [(v["metric"], v["item"], v["pass"]) for v in out] == [
        ("json_valid_rate", None, False),
        ("field_presence_rate", "sender", True),
        ("field_presence_rate", "subject", False),
    ]
    assert out[0]["bound"] == 0.99 and out[0]["value"] == 0.95


def test_guardrail_missing_metric_fails_with_note():
    out = check_guardrails([{"metric": "nonsense_rate"}], BASE, {"macro_f1": 0.9})
    assert out[0]["pass"] is False and "no nonsense_rate" in out[0]["note"]
    # a category the run lost entirely fails too
    rule = {"metric": "f1", "scope": "every_category", "value": -0.1, "relative_to": "baseline"}
    out = check_guardrails([rule], BASE, {"per_category": {"a": {"f1": 0.9}}})
    by = {v["item"]: v for v in out}
    assert by["a"]["pass"] and not by["b"]["pass"] and "for 'b'" in by["b"]["note"]


def test_guardrail_relative_without_baseline_fails():
    rule = {"metric": "macro_f1", "value": 0.0, "relative_to": "baseline"}
    out = check_guardrails([rule], None, {"macro_f1": 0.9})
    assert out[0]["pass"] is False and "baseline has no macro_f1" in out[0]["note"]


def test_metric_names_are_those_the_task_records():
    from tunelab.lib.metrics import known_metrics, metric_problems

    assert known_metrics("format", "overall", regex=True) == ("format_valid_rate", "exact_match")
    assert "json_valid_rate" in known_metrics("format", "overall")
    assert known_metrics("image_classification", "every_category") == known_metrics(
        "classification", "every_category"
    )
    assert known_metrics("format", "every_category") == ()
    assert metric_problems("classification", "macro_f1", [("f1", "every_category")]) == []
    assert (
        metric_problems("extraction", "field_micro_f1", [("field_presence_rate", "every_field")])
        == []
    )
    problems = metric_problems(
        "format",
        "format_valid_rte",
        [("json_valid_rate", "overall"), ("f1", "every_category")],
        regex=True,
    )
    assert [p.split(":")[0] for p in problems] == [
        "hypothesis.primary_metric",
        "guardrails[0].metric",
        "guardrails[1].scope",
    ]
    assert "did you mean format_valid_rate?" in problems[0]
