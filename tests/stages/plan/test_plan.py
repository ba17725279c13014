"""The rental plan: phase arithmetic from the measured figures, what fits, the cost, the chart,
the refusals, and the review of planned against actual durations from the ledger."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helpers import filled_hypothesis, run_cli
from helpers.plan import _finished_run, _sizing_record, _study
from tunelab.core.config import StudyConfig, validate_config
from tunelab.core.record_types import Smoke
from tunelab.core.records import write_json_atomic
from tunelab.stages.plan.estimate import build_plan
from tunelab.stages.plan.figures import Figure, Figures, Lengths, SplitCounts, expected_max

TRAINING = {
    "micro_batch_size": 8,
    "grad_accum_steps": 2,
    "max_steps": 100,
    "num_epochs": 1.0,
    "eval_every_steps": 40,
    "checkpoint_every_steps": 50,
}
BUDGET = {"gpu_hour_price": 2.0, "gpu": "1x H100", "hours_per_day": 24.0, "num_variants": 4}


def smoke_timings(**timings: float) -> Smoke:
    """A smoke record holding only the timings a plan reads."""
    return Smoke(Path("smoke.json"), {}, **timings)


def config(training: dict | None = None, budget: dict | None = None) -> StudyConfig:
    """A valid study config with the training and budget sections of these tests."""
    from tunelab.stages.hypothesis.template import render_study_yaml

    raw = yaml.safe_load(render_study_yaml("extraction", "plan-unit"))
    raw["hypothesis"] = filled_hypothesis(raw)
    raw["training"].update(TRAINING if training is None else training)
    raw["budget"].update(BUDGET if budget is None else budget)
    return validate_config(raw)


CFG = config()


def plan_dict(f: Figures, cfg: StudyConfig = CFG, **kw) -> dict:
    """The plan as its record holds it."""
    return build_plan(f, cfg, **kw).to_dict()


def figures(step_s: float = 2.0, device: str = "cpu", **changes) -> Figures:
    """Figures as gather_figures returns them, with no baseline beside the variants."""
    f = Figures(
        device=device,
        sizing_id="size-x",
        step_s=Figure(step_s, "sizing"),
        forward_s=Figure(0.5, "sizing"),
        load_s=Figure(3.0, "sizing"),
        encode_s=Figure(4.0, "sizing"),
        sizing_s=Figure(60.0, "sizing"),
        tokens_per_s=Figure(None, "sizing"),
        counts=SplitCounts(train=800, validation=100, test=50),
        lengths=Lengths(),
        eval_s_per_example=Figure(0.2, "smoke"),
        checkpoint_save_s=Figure(1.5, "smoke"),
        reload_s=Figure(2.0, "smoke"),
        smoke_s=Figure(30.0, "ledger"),
        process_start_s=Figure(None, "no smoke record"),
        baseline_s=Figure(25.0, "ledger"),
        base_hash_s=Figure(None, "not measured"),
    )
    for key, value in changes.items():
        setattr(f, key, value)
    return f


def test_phase_arithmetic():
    plan = plan_dict(figures(), days=3)
    v = plan["variant"]
    assert v["steps"] == 100 and v["steps_s"] == pytest.approx(200.0)
    # validation losses at step 0, 40, 80 and the last; saves at 50 and 100
    assert v["validation_passes"] == 4
    assert v["validation_s"] == pytest.approx(4 * 13 * 0.5)  # ceil(100 / 8) forwards each
    assert v["checkpoint_saves"] == 2 and v["checkpoints_s"] == pytest.approx(3.0)
    assert v["startup_s"] == pytest.approx(4.0 * 900 / 800 + 3.0)
    assert v["total_s"] == pytest.approx(
        v["startup_s"] + v["steps_s"] + v["validation_s"] + v["checkpoints_s"]
    )
    names = [p["phase"] for p in plan["phases"]]
    assert names == ["initial check", "experiments", "evaluation", "resumption margin", "export"]
    exp = plan["phases"][1]
    assert exp["planned_s"] == pytest.approx(4 * v["total_s"])
    assert exp["margin_s"] == pytest.approx(0.15 * exp["planned_s"]) and exp["margin_pct"] == 15
    # phases follow each other; the evaluation holds one final test evaluation
    for a, b in zip(plan["phases"], plan["phases"][1:], strict=False):
        assert b["start_s"] == pytest.approx(a["start_s"] + a["total_s"])
    # an evaluation is the baseline's unit of work (25 s for 100 examples at 0.2 s each)
    assert plan["evaluation_run_s"] == pytest.approx(25.0)
    assert plan["final_test_s"] == pytest.approx(25.0 - 100 * 0.2 + 50 * 0.2)
    assert plan["verify_s"] == pytest.approx(25.0 + 3.0)  # no smoke figure: the default start
    assert plan["initial"] == {"environment": 5.0, "smoke": 30.0, "sizing": 60.0, "baseline": 25.0}
    assert plan["cost"]["rental_cost"] == pytest.approx(3 * 24 * 2.0)
    assert plan["cost"]["busy_cost"] == pytest.approx(plan["busy_s"] / 3600 * 2.0)
    assert plan["fits"] and plan["variants_that_fit"] > 4
    assert any("measured on CPU" in w for w in plan["warnings"])


def test_evaluation_and_export_estimates():
    base = plan_dict(figures(), days=3)
    # an evaluation run is the baseline's run again; an export copies and hashes the weights
    # and writes its records
    assert base["evaluation_run_s"] == pytest.approx(25.0)
    assert base["export_s"] == pytest.approx(1.5 + 0.05)
    changes = dict(
        adapted_extra_s_per_example=Figure(0.05, "LoRA's share of the parameters"),
        baseline_load_s=Figure(6.0, "the baseline's load"),
        eval_load_s=Figure(4.5, "the smoke's fresh-process load of its checkpoint"),
        process_start_s=Figure(2.5, "smoke's fresh process less its load and evaluation"),
        base_hash_s=Figure(0.5, "hash rate"),
    )
    f = figures(**changes, method="freeze")
    plan = plan_dict(f, days=3)
    # the baseline's run with a variant's load in place of its own, and the adapted model's
    # extra seconds per example over the 100 validation examples
    assert plan["evaluation_run_s"] == pytest.approx(25.0 - 6.0 + 4.5 + 100 * 0.05)
    # a faster GPU speeds up the evaluation, not the load (files and imports)
    fast = plan_dict(f, days=3, speedup=2.0)
    assert fast["evaluation_run_s"] == pytest.approx((25.0 - 6.0) / 2 + 4.5 + 100 * 0.05 / 2)
    # verify: the same evaluation in a new process, started as fast as the smoke's
    assert plan["verify_s"] == pytest.approx(plan["evaluation_run_s"] + 2.5)
    # the base hashed once; a freeze run loads the run's model to save it whole
    assert plan["export_s"] == pytest.approx(base["export_s"] + 0.5 + 3.0)
    full = plan_dict(figures(**changes, method="full"), days=3)
    assert full["export_s"] == pytest.approx(base["export_s"] + 0.5)  # the checkpoint copied


def test_a_baseline_measured_on_shared_cores_is_flagged():
    from tunelab.core.env import BUSY_CPU_SHARE, cpu_share

    # one of two cores busy with another process: the share falls to about 0.6
    assert cpu_share(5.9, 5.0, 2, "cpu") == pytest.approx(0.59)
    assert cpu_share(0.4, 5.0, 2, "cuda:0") is None  # the host thread waits on the device
    busy = plan_dict(figures(baseline_cpu_share=0.59), days=3)
    assert any("baseline's evaluation had 59 % of its threads' CPU" in w for w in busy["warnings"])
    steps = plan_dict(figures(step_cpu_share=0.6), days=3)
    assert any("timed steps had 60 %" in w and "tunelab size" in w for w in steps["warnings"])
    for share in (0.95, None):
        quiet = plan_dict(figures(baseline_cpu_share=share), days=3)
        assert not any("threads' CPU time" in w for w in quiet["warnings"])
    assert 0.59 < BUSY_CPU_SHARE < 0.95


def test_too_slow_warns_and_speedup_projects():
    slow = plan_dict(figures(step_s=900.0), days=3)
    assert not slow["fits"] and slow["variants_that_fit"] < 4
    assert any("do not fit" in w for w in slow["warnings"])
    fast = plan_dict(figures(step_s=900.0), days=3, speedup=30)
    assert fast["step_time_s"] == pytest.approx(30.0) and fast["fits"]
    assert not any("measured on CPU" in w for w in fast["warnings"])
    fixed = plan_dict(figures(), days=7, step_time_s=0.1)
    assert fixed["variant"]["steps_s"] == pytest.approx(10.0)
    assert fixed["window_s"] == 7 * 24 * 3600


def test_steps_are_trainings_own_count_and_padded_lengths():
    from tunelab.stages.train.stage import total_steps

    epochs = config({**TRAINING, "max_steps": None, "num_epochs": 2.0})
    assert total_steps(epochs, 800) == 100
    assert build_plan(figures(), epochs, days=3).variant.steps == 100
    assert build_plan(figures(), CFG, days=3).variant.steps == 100  # max_steps 100
    flat = [128] * 101
    assert expected_max(flat, 16) == pytest.approx(128)
    ramp = list(range(0, 101))
    assert expected_max(ramp, 1) == pytest.approx(50, abs=0.5)  # one example: the mean
    assert expected_max(ramp, 1) < expected_max(ramp, 4) < expected_max(ramp, 16) < 100


# ------------------------------------------------------------------ a study with records


def test_plan_cli_record_chart_and_refusals(tmp_path, tiny_llama_dir, capsys):
    study = _study(tmp_path / "s", tiny_llama_dir)
    code, _, err = run_cli(capsys, "plan", "-s", study.root)
    assert code == 2 and "tunelab size" in err  # no sizing yet
    _sizing_record(study)
    code, _, err = run_cli(capsys, "plan", "-s", study.root, "--days", "5")
    assert code == 2 and "3, 7 or 30" in err
    code, out, err = run_cli(
        capsys, "plan", "-s", study.root, "--days", "7", "--gpu-hour-price", "3", "--json"
    )
    assert code == 0, err
    plan = json.loads(out[out.index("{") :])
    assert Path(plan["path"]).parent == study.root / "records" / "plans"
    png = Path(plan["chart_path"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plan["cost"]["rental_cost"] == pytest.approx(7 * 24 * 3)
    # packed causal LM: the step time follows the mean length, 64 of the measured 100 tokens
    assert plan["step_time_s"] == pytest.approx(0.5 * 64 / 100)
    assert plan["figures"]["step_s"]["source"].startswith("sizing size-")
    assert plan["variant"]["steps"] == 20 and plan["variant"]["validation_passes"] == 3
    code, out, _ = run_cli(capsys, "plan", "-s", study.root)
    assert code == 0 and "initial check" in out and "variants fit" in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--days", "0"], "--days 0: plans are for 3, 7 or 30 days"),
        (["--gpu-hour-price", "-1"], "--gpu-hour-price -1: a price per GPU hour"),
        (["--gpu-hour-price", "nan"], "--gpu-hour-price nan"),
        (["--gpu-hour-price", "inf", "--gpu", "H200"], "--gpu-hour-price inf"),
        (["--step-time-s", "inf"], "--step-time-s inf"),
        (["--speedup", "nan"], "--speedup nan"),
        (["--utilization", "0.3"], "--utilization 0.3: only with --gpu"),
        (["--gpus", "2"], "--gpus 2: only with --gpu"),
        (["--strategy", "fsdp"], "--strategy fsdp: only with --gpu"),
        (["--review", "--gpu", "H200", "--days", "3"], "--days, --gpu would be ignored"),
    ],
)
def test_plan_refuses_options_it_would_ignore_or_misprice(
    tmp_path, tiny_llama_dir, capsys, args, fragment
):
    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    code, _, err = run_cli(capsys, "plan", "-s", study.root, *args)
    assert code == 2 and fragment in err and "hint:" in err, err
    assert not (study.records / "plans").exists() or not any((study.records / "plans").iterdir())


def test_plan_chart_of_many_variants_stays_one_page(tmp_path, tiny_llama_dir, capsys):
    from PIL import Image

    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    code, out, err = run_cli(
        capsys, "plan", "-s", study.root, "--set", "budget.num_variants=5000", "--json"
    )
    assert code == 0, err
    plan = json.loads(out[out.index("{") :])
    assert plan["num_variants"] == 5000
    assert Image.open(plan["chart_path"]).size[1] < 1000  # one bar for the experiments


def test_review_sets_planned_against_ledger(tmp_path, tiny_llama_dir, capsys):
    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    _finished_run(study, "smoke", 30.0)
    _finished_run(study, "baseline", 12.0)
    from tunelab.stages.plan import review_plan
    from tunelab.stages.plan import stage as plan_stage

    plan, _, _ = plan_stage.run(study, days=3)
    per_variant = plan["variant"]["total_s"]
    slow = _finished_run(study, "train", per_variant * 1.05)
    _finished_run(study, "train", per_variant * 1.15)
    _finished_run(study, "train", per_variant * 0.2, status="failed")  # time spent all the same
    # one run stepped twice as slowly as sized (a busier machine): the plan at its own speed
    step = plan["step_time_s"] * 2
    (study.runs_dir / slow / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 1.0, "seconds": step}) + "\n" for i in (1, 2))
    )
    review = review_plan(study)
    rows = {r["phase"]: r for r in review["rows"]}
    exp = rows["experiments"]
    assert exp["what"].startswith("3 of 4")
    assert exp["actual_s"] == pytest.approx(per_variant * 2.4, abs=0.01)
    assert exp["planned_s"] == pytest.approx(per_variant * 3)
    assert exp["error_pct"] == pytest.approx(100 * (3 - 2.4) / 2.4, abs=0.2)
    v = plan["variant"]
    compute = v["startup_s"] + v["steps_s"] + v["validation_s"]
    assert exp["planned_at_run_speed_s"] == pytest.approx(3 * per_variant + compute, rel=1e-6)
    assert exp["error_at_run_speed_pct"] is not None
    assert rows["initial check"]["actual_s"] == pytest.approx(30 + 40 + 12)
    # an export times itself in its ledger event
    study.ledger.add_event(slow, "export", {"export_id": "export-x", "seconds": 2.5})
    rows = {r["phase"]: r for r in review_plan(study)["rows"]}
    assert rows["export"]["actual_s"] == pytest.approx(2.5)
    assert rows["export"]["planned_s"] == pytest.approx(plan["export_s"])
    assert not rows["export"]["below_resolution"]
    # the stated margins: the training runs fit inside theirs, the export went past its 25 %
    assert rows["experiments"]["within_margin"] and rows["experiments"]["margin_pct"] == 15
    assert plan["export_s"] * 1.25 < 2.5 and rows["export"]["within_margin"] is False
    assert rows["resumption margin"]["within_margin"] is None  # nothing measured
    assert rows["resumption margin"]["what"] == "0 interrupted runs"
    # a run killed, then resumed to the end, still counts as interrupted once
    study.ledger.add_event(slow, "status:interrupted", "killed")
    rows = {r["phase"]: r for r in review_plan(study)["rows"]}
    assert rows["resumption margin"]["what"] == "1 interrupted run (1 resumed)"
    code, out, _ = run_cli(capsys, "plan", "-s", study.root, "--review")
    assert code == 0 and "planned vs actual" in out and "experiments" in out
    assert "export took" in out and "(margin 25%)" in out


def test_review_says_when_runs_took_other_steps_than_planned(tmp_path, tiny_llama_dir, capsys):
    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    from tunelab.stages.plan import review_plan
    from tunelab.stages.plan import stage as plan_stage

    plan, _, _ = plan_stage.run(study, days=3)
    planned = plan["variant"]["steps"]
    for steps in (planned, planned // 2, planned // 2):
        run = _finished_run(study, "train", 10.0)
        status = study.runs_dir / run / "status.json"
        rec = json.loads(status.read_text()) if status.exists() else {}
        status.write_text(json.dumps({**rec, "status": "completed", "steps": steps}))
    notes = review_plan(study)["notes"]
    assert notes == [
        f"2 training runs took {planned // 2} steps, the plan's variant {planned} "
        "(training.max_steps when it was planned): the experiments' error counts the "
        "difference in steps"
    ]
    code, out, _ = run_cli(capsys, "plan", "-s", study.root, "--review")
    assert code == 0 and f"took {planned // 2} steps" in " ".join(out.split())
    from tunelab.stages.report import stage as report_stage

    md = report_stage.run(study)["markdown"].read_text()
    section = md[md.index("## Rental plan") :]
    assert f"Note: {notes[0]}." in section[: section.index("\n## ")]


def test_review_shows_but_does_not_count_phases_under_a_second(tmp_path, tiny_llama_dir):
    from tunelab.stages.plan import RESOLUTION_S, review_plan
    from tunelab.stages.plan import stage as plan_stage

    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    _finished_run(study, "smoke", 30.0)
    _finished_run(study, "baseline", 12.0)
    plan, _, _ = plan_stage.run(study, days=3)
    run = _finished_run(study, "train", plan["variant"]["total_s"] * 1.05)
    study.ledger.add_event(run, "export", {"export_id": "export-x", "seconds": 0.2})
    review = review_plan(study, {**plan, "export_s": 0.1})
    rows = {r["phase"]: r for r in review["rows"]}
    assert rows["export"]["error_pct"] == pytest.approx(-50.0)
    assert rows["export"]["below_resolution"] and 0.2 < RESOLUTION_S
    assert not rows["experiments"]["below_resolution"]
    assert review["max_error_pct"] == pytest.approx(abs(rows["experiments"]["error_pct"]))
    # a phase with nothing measured is not an error under a second
    assert rows["evaluation"]["error_pct"] is None and not rows["evaluation"]["below_resolution"]


def test_review_measures_the_spread_of_repeated_evaluations():
    from tunelab.stages.plan import repeat_spread

    assert repeat_spread([8.0]) is None and repeat_spread([]) is None
    assert repeat_spread([8.0, 10.0]) == pytest.approx(22.2)
    assert repeat_spread([7.5, 9.9, 8.7]) == pytest.approx(100 * 2.4 / 8.7, abs=0.05)


def test_review_says_whether_an_error_lies_inside_the_repeats_spread():
    from tunelab.stages.plan import repeat_verdict

    row = {
        "phase": "evaluation",
        "what": "2 evaluations, 0 verifications",
        "planned_s": 46.0,
        "repeats_s": [50.8, 49.4],
        "repeat_spread_pct": 2.8,
    }
    outside = repeat_verdict({**row, "error_pct": -9.2, "within_repeat_spread": False})
    assert outside == (
        "evaluation: its 2 evaluations of one split took 50.8 and 49.4 s, a spread of 2.8 %; "
        "the phase's error -9.2 % is outside it"
    )
    inside = repeat_verdict({**row, "error_pct": 2.0, "within_repeat_spread": True})
    assert inside.endswith(
        "+2.0 % is inside it: the plan is as close as the runs are to each other"
    )
    # a unit that ran once, or a phase with nothing measured: nothing to say
    assert repeat_verdict({**row, "repeats_s": None, "repeat_spread_pct": None}) is None
    assert repeat_verdict({**row, "error_pct": None, "within_repeat_spread": None}) is None


def test_dossier_sets_a_plan_made_before_the_experiments_against_them(tmp_path, tiny_llama_dir):
    """The demo plans after the initial check; the dossier reviews that plan against the ledger
    as it is when the dossier is built, not as it was when the plan was made."""
    from tunelab.stages.plan import review_plan
    from tunelab.stages.plan import stage as plan_stage
    from tunelab.stages.report import stage as report_stage

    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    _finished_run(study, "smoke", 30.0)
    _finished_run(study, "baseline", 12.0)
    plan, _, _ = plan_stage.run(study, days=3)
    stored = {r["phase"]: r for r in plan["review"]["rows"]}
    assert stored["experiments"]["error_pct"] is None  # nothing trained yet when planned
    _finished_run(study, "train", plan["variant"]["total_s"] * 1.1)
    _finished_run(study, "eval", 8.0)
    _finished_run(study, "eval", 10.0)
    rows = {r["phase"]: r for r in review_plan(study)["rows"]}
    evaluation = rows["evaluation"]
    assert sorted(evaluation["repeats_s"]) == pytest.approx([8.0, 10.0])
    assert evaluation["repeat_spread_pct"] == pytest.approx(22.2)
    assert evaluation["within_repeat_spread"] == (abs(evaluation["error_pct"]) <= 22.2)
    assert rows["experiments"]["repeat_spread_pct"] is None  # one run: no spread
    md = report_stage.run(study)["markdown"].read_text()
    section = md[md.index("## Rental plan") :]
    section = section[: section.index("\n## ")]
    line = next(x for x in section.splitlines() if x.startswith("| experiments"))
    assert f"{rows['experiments']['error_pct']:g}" in line  # the actual, measured after planning
    assert "2 evaluations of one split took" in section and "a spread of 22.2 %" in section
    verdict = "inside it" if evaluation["within_repeat_spread"] else "outside it"
    assert f"error {evaluation['error_pct']:+.1f} % is {verdict}" in section
    fit, registered = plan["variants_that_fit"], plan["num_variants"]
    assert f"{fit} variants would fit, the study registers {registered};" in section


def test_verify_start_is_the_smoke_fresh_process_less_its_measured_parts(tmp_path, tiny_llama_dir):
    from tunelab.stages.plan import gather_figures
    from tunelab.stages.plan import stage as plan_stage

    study = _study(tmp_path / "s", tiny_llama_dir)
    _sizing_record(study)
    smoke = _finished_run(study, "smoke", 30.0)
    parts = {"reload_s": 3.0, "fresh_eval_s": 0.2, "fresh_checks_s": 0.8}
    write_json_atomic(
        study.runs_dir / smoke / "smoke.json",
        {"passed": True, "checks": [], **parts, "fresh_process_s": 7.0, "total_s": 30.0},
    )
    figures = gather_figures(study)
    assert figures.process_start_s.value == pytest.approx(3.0)
    plan, _, _ = plan_stage.run(study, days=3)
    assert plan["verify_s"] == pytest.approx(plan["evaluation_run_s"] + 3.0)


def _evaluation(**fields):
    """A validation metrics record (`core.record_types.Evaluation`) holding `fields`."""
    from tunelab.core.record_types import Evaluation

    return Evaluation.of(
        "metrics-validation.json", {"split": "validation", "metrics": {}, **fields}
    )


def _facts(**fields):
    """A sizing record's `facts` holding `fields`, as the plan reads them."""
    from tunelab.core.record_plan import PlanModelFacts

    return PlanModelFacts.of("size-x.json", fields, "facts")


def test_a_variants_evaluation_cost():
    """A variant's evaluation loads as the smoke's fresh process did (after the baseline, which
    reads the files first), faster or slower than the baseline; per example, LoRA adds what the
    smoke measured with its adapter off and on (else its share of the parameters), and full
    fine-tuning nothing: the smoke's one small batch is not a per-example figure."""
    from tunelab.stages.plan.figures import adapted_costs as _adapted_costs

    baseline = _evaluation(load_s=6.6, seconds=4.3, n=127)
    facts = _facts(num_params=1_010_000, trainable_params=10_000)
    smoke = smoke_timings(reload_s=5.1, eval_s_per_example=0.055)
    lora = _adapted_costs(smoke, "smoke-x", baseline, "base-x", facts, "lora")
    assert lora["eval_load_s"].value == pytest.approx(5.1)
    assert lora["baseline_load_s"].value == pytest.approx(6.6)
    assert lora["adapted_extra_s_per_example"].value == pytest.approx(4.3 / 127 * 0.01)
    slower = _adapted_costs(
        smoke_timings(reload_s=8.0), "smoke-x", baseline, "base-x", facts, "lora"
    )
    assert slower["eval_load_s"].value == pytest.approx(8.0)
    full = _adapted_costs(smoke, "smoke-x", baseline, "base-x", facts, "full")
    assert "adapted_extra_s_per_example" not in full
    alone = _adapted_costs(None, None, baseline, "base-x", facts, "lora")
    assert "eval_load_s" not in alone and alone["baseline_load_s"].value == pytest.approx(6.6)
    # measured by the smoke (adapter off, then on), the ratio replaces the parameter share
    timed = _adapted_costs(
        replace(smoke, adapter_time_ratio=1.22), "smoke-x", baseline, "base-x", facts, "lora"
    )
    assert timed["adapted_extra_s_per_example"].value == pytest.approx(4.3 / 127 * 0.22)
    assert "1.22 times as long" in timed["adapted_extra_s_per_example"].source
    noise = _adapted_costs(
        replace(smoke, adapter_time_ratio=0.97), "smoke-x", baseline, "base-x", facts, "lora"
    )
    assert noise["adapted_extra_s_per_example"].value == 0.0  # an adapter is never free


def test_an_evaluation_reads_at_most_max_examples():
    """`evaluation.max_examples` caps every evaluation (the variants', the final test), not the
    training run's validation passes (the extraction demo evaluates 20 of its 33 validation
    emails)."""
    extra = Figure(0.05, "measured")
    capped = plan_dict(figures(adapted_extra_s_per_example=extra, eval_max_examples=20), days=3)
    whole = plan_dict(figures(adapted_extra_s_per_example=extra), days=3)
    assert whole["evaluation_run_s"] == pytest.approx(25.0 + 100 * 0.05)
    assert capped["evaluation_run_s"] == pytest.approx(25.0 + 20 * 0.05)
    per_example = 0.2 + 0.05
    assert capped["final_test_s"] == pytest.approx(25.0 + 20 * 0.05)  # 20 of the 50 test rows
    assert whole["final_test_s"] == pytest.approx(
        whole["evaluation_run_s"] - 100 * per_example + 50 * per_example
    )
    assert capped["variant"]["validation_s"] == whole["variant"]["validation_s"]


def test_a_generating_variant_is_priced_at_its_answers_length():
    """The base model rambles to max_new_tokens; a variant stops after the answer it learned.
    The baseline's batches are priced again at the gold answers' longest per batch, at their
    own prefill and step times, then the adapter's ratio applies to that."""
    from tunelab.stages.plan.figures import adapted_costs as _adapted_costs
    from tunelab.stages.plan.figures import answer_length_cost as _answer_length_cost

    gen = {
        "steps": 75,
        "answer_steps": 51,
        "s_per_step": 0.1,
        "batches": [
            {"n": 2, "steps": 64, "answer_steps": 41, "prefill_s": 2.0, "decode_s": 6.3},
            {"n": 1, "steps": 11, "answer_steps": 10, "prefill_s": 1.0, "decode_s": 1.0},
        ],
    }
    baseline = _evaluation(load_s=5.0, seconds=10.3, n=3, generation=gen)
    length = _answer_length_cost(baseline, "base-x")
    answered = (2.0 + 40 * 6.3 / 63) + (1.0 + 9 * 1.0 / 10)
    assert length.value == pytest.approx((answered - 10.3) / 3)
    assert length.value < 0 and "75 generated tokens" in length.source
    assert _answer_length_cost(_evaluation(seconds=4.3, n=127), "base-x") is None  # classification
    facts = _facts(num_params=1_010_000, trainable_params=10_000)
    costs = _adapted_costs(
        smoke_timings(reload_s=5.1, adapter_time_ratio=1.25),
        "smoke-x",
        baseline,
        "base-x",
        facts,
        "lora",
    )
    assert costs["answer_length_s_per_example"].value == pytest.approx(length.value)
    # the adapter's matmuls on what the variant generates, not on what the base generated
    assert costs["adapted_extra_s_per_example"].value == pytest.approx(answered / 3 * 0.25)
    assert costs["variant_s_per_step"].value == pytest.approx(0.1 * 1.25)
    plan = plan_dict(
        figures(counts=SplitCounts(train=800, validation=3, test=3), **costs),
        days=3,
    )
    assert plan["evaluation_run_s"] == pytest.approx(25.0 - 5.0 + 5.1 + answered * 1.25 - 10.3)


def test_a_variant_evaluated_merged_is_priced_at_the_base_speed_plus_its_copy():
    """Where the smoke's evaluation chose the merged copy, a variant decodes as the base: no
    adapter ratio per step or example, but the copy and the first batch's check once per
    evaluation (the smoke's check on its 4 examples, scaled to a batch of 8)."""
    from tunelab.stages.plan.figures import adapted_costs as _adapted_costs
    from tunelab.stages.plan.figures import merged_evaluation

    gen = {
        "steps": 11,
        "answer_steps": 11,
        "s_per_step": 0.1,
        "batches": [{"n": 3, "steps": 11, "answer_steps": 11, "prefill_s": 1.0, "decode_s": 1.0}],
    }
    baseline = _evaluation(load_s=5.0, seconds=2.0, n=3, generation=gen)
    smoke_eval = {
        "run_id": "smoke-x",
        "n": 4,
        "merge": {"merged": True, "reason": "first batch: 4 outputs greedy", "merge_s": 0.5,
                  "check_s": 0.25},
    }  # fmt: skip
    merged = merged_evaluation(_evaluation(**smoke_eval), batch_size=8)
    assert merged.value == pytest.approx(0.5 + 0.25 * 2)
    assert merged_evaluation(_evaluation(**{**smoke_eval, "merge": {"merged": False}}), 8) is None
    assert merged_evaluation(_evaluation(n=4), 8) is None  # a smoke recorded before merging
    assert merged_evaluation(None, 8) is None  # no smoke
    facts = _facts(num_params=1_010_000, trainable_params=10_000)
    smoke = smoke_timings(reload_s=5.1, adapter_time_ratio=1.25)
    costs = _adapted_costs(smoke, "smoke-x", baseline, "base-x", facts, "lora", merged=merged)
    assert "adapted_extra_s_per_example" not in costs
    assert costs["variant_s_per_step"].value == pytest.approx(0.1)
    assert costs["eval_merge_s"].value == pytest.approx(1.0)
    unmerged = _adapted_costs(smoke, "smoke-x", baseline, "base-x", facts, "lora")
    counts = SplitCounts(train=800, validation=3, test=3)
    fast = plan_dict(figures(counts=counts, **costs), days=3)
    slow = plan_dict(figures(counts=counts, **unmerged), days=3)
    assert fast["evaluation_run_s"] == pytest.approx(25.0 - 5.0 + 5.1 + 2.0 - 2.0 + 1.0)
    assert slow["evaluation_run_s"] == pytest.approx(25.0 - 5.0 + 5.1 + 2.0 * 1.25 - 2.0)


PLAN_RECORD = {"id": "plan-x", "figures": {}, **build_plan(figures(), CFG, days=3).to_dict()}


def test_review_times_a_generating_evaluation_by_its_steps(tmp_path):
    """At the runs' own speed, a generating evaluation is scaled by its seconds per decoding
    step against the plan's (its number of steps is the plan's to get right); any other by its
    seconds per example."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tunelab.core.record_plan import PlanSchedule
    from tunelab.stages.plan.review import PlannedUnits, eval_speed_factor

    planned = replace(
        PlannedUnits.from_record(PlanSchedule.of("plan-x.json", PLAN_RECORD)),
        eval_s_per_example=0.5,
        variant_s_per_step=0.125,
    )
    gen = tmp_path / "eval-gen"
    write_json_atomic(
        gen / "metrics-validation.json",
        {
            "split": "validation",
            "metrics": {},
            "seconds": 30.0,
            "n": 20,
            "generation": {"s_per_step": 0.15},
        },  # fmt: skip
    )
    cls = tmp_path / "eval-cls"
    write_json_atomic(
        cls / "metrics-validation.json",
        {"split": "validation", "metrics": {}, "seconds": 12.0, "n": 20},
    )
    study = SimpleNamespace(runs_dir=tmp_path)
    assert eval_speed_factor(study, "eval-gen", planned) == pytest.approx(0.15 / 0.125)
    assert eval_speed_factor(study, "eval-cls", planned) == pytest.approx(12.0 / 20 / 0.5)
    assert eval_speed_factor(study, "eval-none", planned) == 1.0


def test_a_damaged_plan_or_sizing_piece_raises_the_located_error():
    """A plan's phase, or a sizing's peak, read back with a field of the wrong type raises the
    one located error of a damaged record: the file, the place in it and the field."""
    from tunelab.core.errors import StudyError
    from tunelab.core.record_plan import PlanSchedule
    from tunelab.core.record_sizing import peak_of
    from tunelab.core.record_types import Sizing

    phases = [dict(PLAN_RECORD["phases"][0], margin_pct="ten"), *PLAN_RECORD["phases"][1:]]
    with pytest.raises(StudyError, match=r"plan-x.json: phases\[0\]: field 'margin_pct' is 'ten'"):
        PlanSchedule.of("plan-x.json", {**PLAN_RECORD, "phases": phases})
    with pytest.raises(StudyError, match=r"plan-x.json: field 'variant' is missing"):
        PlanSchedule.of("plan-x.json", {k: v for k, v in PLAN_RECORD.items() if k != "variant"})
    sizing = Sizing.of("size-x.json", {"id": "size-x", "device": "cpu"})
    assert peak_of(sizing, "evaluation_peak") is None
    damaged = Sizing.of("size-x.json", {"id": "size-x", "device": "cpu",
                                        "evaluation_peak": {"status": 3}})  # fmt: skip
    with pytest.raises(StudyError, match=r"size-x.json: evaluation_peak: field 'status' is 3"):
        peak_of(damaged, "evaluation_peak")
    peak = {
        "status": "ok",
        "measured": {"peak_total": 7, "compared": 4},
        "predicted": {"compared": 2},
    }
    read = peak_of(Sizing.of("s.json", {"id": "s", "device": "cpu", "evaluation_peak": peak}),
                   "evaluation_peak")  # fmt: skip
    assert read is not None and read.total == 7 and read.scale == 2.0
