"""Verdicts in a comparison: guardrails on bounds, Holm, point rules, the primary test, TOST,
the locked settings (and their defaults for records locked before them), power warnings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from helpers import MINIMAL_HYPOTHESIS
from tunelab.core.config import StudyConfig
from tunelab.core.config_sections import GuardrailRule, HypothesisConfig
from tunelab.core.record_types import Compare
from tunelab.lib import metrics as M
from tunelab.lib.statistics import Estimate
from tunelab.stages.compare.evaluations import compare_evaluations
from tunelab.stages.compare.guardrails import check_guardrails, judge_guardrails
from tunelab.stages.compare.stage import study_decision
from tunelab.stages.compare.verdicts import DecisionTests
from tunelab.stages.hypothesis.power import power_warnings
from tunelab.stages.report.decision import choose_variant, decide

LABELS = ["a", "b", "c"]
F1_RULE = {"metric": "f1", "scope": "every_category", "value": -0.02, "relative_to": "baseline"}


def _rows(golds, preds):
    return [
        {"id": f"e{i}", "gold": g, "prediction": p, "correct": g == p}
        for i, (g, p) in enumerate(zip(golds, preds, strict=True))
    ]


def _pair(n, base_acc, var_acc, seed=0):
    rng = random.Random(seed)
    golds = [LABELS[i % 3] for i in range(n)]

    def predict(acc):
        return [
            g if rng.random() < acc else rng.choice([x for x in LABELS if x != g]) for g in golds
        ]

    return golds, predict(base_acc), predict(var_acc)


def _compare(golds, base, var, rules, **kw):
    return compare_evaluations(
        "classification",
        _rows(golds, base),
        _rows(golds, var),
        baseline_metrics={"metrics": M.classification_metrics(golds, base, LABELS)},
        variant_metrics={"metrics": M.classification_metrics(golds, var, LABELS)},
        guardrails=rules,
        primary_metric="macro_f1",
        labels=LABELS,
        samples=600,
        **kw,
    )


def test_a_clear_gain_on_many_examples_is_adopted_with_its_bounds():
    golds, base, var = _pair(1500, 0.55, 0.9)
    out = _compare(golds, base, var, [F1_RULE, {"metric": "accuracy", "value": 0.6}])
    assert out["primary"]["verdict"] == "better" and out["decision"] == "adopt"
    for g in out["guardrails"]:
        assert g["verdict"] == "pass" and g["judged_bound"] >= g["margin"]
        assert g["ci_low"] <= g["ci_high"] and g["level"] == pytest.approx(0.025)
    acc = out["guardrails"][-1]  # absolute rate: Wilson interval of the run's accuracy
    assert acc["ci_low"] < acc["value"] < acc["ci_high"] and acc["judged_bound"] == acc["ci_low"]
    assert (
        sum(v["improved"] for v in out["flips"]["by_category"].values())
        == out["flips"]["num_improved"]
    )


def test_per_category_precision_and_recall_are_judged_on_intervals():
    golds, base, var = _pair(1500, 0.55, 0.9)
    rules = [{**F1_RULE, "metric": m} for m in ("precision", "recall")]
    out = _compare(golds, base, var, rules)
    assert all(g["verdict"] == "pass" and g["ci_low"] is not None for g in out["guardrails"])
    a = out["per_category"]["a"]["precision"]
    assert a["ci_low"] <= a["delta"] <= a["ci_high"]


def test_a_small_split_is_inconclusive_and_says_what_would_settle_it():
    golds, base, var = _pair(60, 0.6, 0.62, seed=3)
    out = _compare(golds, base, var, [F1_RULE], min_improvement=0.02)
    assert out["decision"] == "inconclusive"
    open_items = [g for g in out["guardrails"] if g["verdict"] == "inconclusive"]
    assert open_items and all(g["settle_n"] > 60 for g in open_items if g["settle_n"])
    entry = {"compared": True, "run_id": "r1", **out}
    record = {"primary_metric": "macro_f1", "decision": study_decision([entry])}
    record["runs"] = [{"compared": True, "run_id": "r1", "name": "v1", **out}]
    compare = Compare.of("compare.json", record)
    assert choose_variant(compare)[0] is None
    sentence = decide(compare)
    assert sentence.startswith("Inconclusive") and "--final" in sentence


def test_a_clear_loss_fails_and_is_rejected():
    golds, base, var = _pair(1500, 0.9, 0.5)
    out = _compare(golds, base, var, [F1_RULE])
    assert out["primary"]["verdict"] == "not better"
    assert all(g["verdict"] == "fail" for g in out["guardrails"])
    failed = out["guardrails"][0]
    assert failed["judged_bound"] < failed["margin"] and failed["adjusted_level"] < 0.025
    assert out["decision"] == "reject" and "guardrail fails" in " ".join(out["decision_reasons"])


def test_a_point_rule_is_judged_on_the_point_estimate():
    golds, base, var = _pair(60, 0.6, 0.62, seed=3)
    out = _compare(golds, base, var, [{**F1_RULE, "test": "point"}])
    for g in out["guardrails"]:
        assert g["test"] == "point" and g["verdict"] in ("pass", "fail")
        assert g["verdict"] == ("pass" if g["point_pass"] else "fail") and "ci_low" not in g


def test_holm_adjusts_the_fail_side_only():
    """Three items just below their margin: unadjusted, each fails at 0.025; Holm tests the
    first at 0.025/3 and stops there."""
    items = check_guardrails(
        [F1_RULE],
        {"per_category": {c: {"f1": 0.8} for c in LABELS}},
        {"per_category": {c: {"f1": 0.75} for c in LABELS}},
    )
    draws = np.random.default_rng(0).normal(-0.05, 0.014, 4000)  # bound -0.0226, Holm -0.0165

    def estimate_of(metric, scope, item, relative):
        return Estimate(point=-0.05, draws=draws)

    none = judge_guardrails(items, estimate_of, n=100, multiplicity="none")
    holm = judge_guardrails(items, estimate_of, n=100, multiplicity="holm")
    assert [g["verdict"] for g in none] == ["fail"] * 3
    assert [g["verdict"] for g in holm] == ["inconclusive"] * 3
    assert [g["adjusted_level"] for g in holm] == pytest.approx([0.025 / 3] * 3)


def test_equivalence_goal_by_tost():
    golds, base, _ = _pair(1500, 0.8, 0.8)
    tests = DecisionTests(goal="equivalence", equivalence_margin=0.05)
    out = _compare(golds, base, list(base), [F1_RULE], tests=tests)
    assert out["primary"]["verdict"] == "equivalent" and out["decision"] == "adopt"
    assert out["primary"]["tost_p_value"] < 0.025
    far = _compare(*_pair(1500, 0.5, 0.9)[0:3], [F1_RULE], tests=tests)
    assert far["primary"]["verdict"] == "not equivalent" and far["decision"] == "reject"


def test_records_locked_before_the_settings_read_the_defaults():
    old = {"hypothesis": {"primary_metric": "macro_f1"}, "evaluation_spec": {"evaluation": {}}}
    tests = DecisionTests.from_locked(old)
    assert (tests.confidence, tests.interval_method, tests.multiplicity, tests.goal) == (
        0.95,
        "wilson",
        "holm",
        "superiority",
    )
    # and the defaults are absent from what is locked, so earlier sha256s still match
    assert "test" not in GuardrailRule(metric="f1").model_dump()
    hyp = {"behaviour": "b", "rationale": "r", "expected_effect": "e", "primary_metric": "m"}
    assert "goal" not in HypothesisConfig(**hyp).model_dump()
    locked = DecisionTests.from_locked(
        {
            "hypothesis": {**hyp, "goal": "equivalence", "equivalence_margin": 0.01},
            "evaluation_spec": {"evaluation": {"confidence": 0.9, "multiplicity": "bonferroni"}},
        }
    )
    assert locked.alpha == pytest.approx(0.05) and locked.multiplicity == "bonferroni"
    with pytest.raises(ValueError, match="go together"):
        HypothesisConfig(**hyp, goal="equivalence")


def test_power_warnings_name_the_split_size_needed():
    cfg = _config(0.02, [F1_RULE, {"metric": "accuracy", "value": 0.6, "test": "point"}])
    power = {
        "metric": "macro_f1",
        "n": 127,
        "detectable_effect": 0.12,
        "per_category": {
            "a": {"n": 40, "detectable_effect": 0.3},
            "b": {"n": 87, "detectable_effect": 0.01},
        },
    }
    warnings = power_warnings(cfg, power)
    assert "about 4572 validation examples" in warnings[0]  # 127 x (0.12 / 0.02)^2
    assert "1 of 2 categories cannot tell a loss of 0.02" in warnings[1]
    assert "test: point" in warnings[2] and "luck of the draw" in warnings[2]
    assert power_warnings(_config(0.2, [F1_RULE]), {**power, "per_category": {}}) == []


def _config(min_improvement, rules):
    raw = {
        "name": "s",
        "hypothesis": {**MINIMAL_HYPOTHESIS, "min_improvement": min_improvement},
        "guardrails": rules,
        "data": {"source": {"format": "jsonl", "path": "d.jsonl"}},
        "model": {"path": "m"},
    }
    return StudyConfig.model_validate(raw)


def test_register_on_the_demo_study_states_and_records_the_detectable_effect(tmp_path, capsys):
    """Before any snapshot: the source cut by data.splits and data.max_examples, a stand-in
    baseline; the record keeps it outside its hashed content."""
    import json

    import yaml

    from helpers import run_cli
    from tunelab.core.hashing import sha256_json
    from tunelab.demo.studies import classification_study

    root = tmp_path / "demo"
    root.mkdir()
    (root / "study.yaml").write_text(yaml.safe_dump(classification_study(root), sort_keys=False))
    code, out, _ = run_cli(capsys, "register", "-s", root)
    assert code == 0 and "detectable effect: macro_f1 +0." in out
    assert "min_improvement 0.05 is below the smallest macro_f1 effect" in out
    record = json.loads((root / "records" / "hypothesis-v1.json").read_text())
    effect = record["detectable_effect"]
    assert 0.1 < effect < 0.25 and record["power"]["n"] > 100
    assert record["sha256"] == sha256_json(record["content"])
    assert "detectable_effect" not in record["content"]
