"""`tunelab demo`'s stages end to end on the tiny BERT: the comparison adopts a variant, which is
verified, evaluated once on the sealed test split and exported, and the dossier's decision shows
its test figure. Each stage runs as the command a user would type, in its own process."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers.study import build_study
from tunelab.core.ledger import RunRow, SealedOpening
from tunelab.core.record_types import Compare, Evaluation
from tunelab.core.study import Study
from tunelab.demo.run import FINAL_WHY, Stage, demo_stages, run_stages
from tunelab.stages.report.collect import RunEvidence
from tunelab.stages.report.decision import choose_variant, decide, final_test

WORDS = {
    "business": "markets bank shares profits investors prices budget interest rates".split(),
    "sport": "striker match team coach goal race champion penalty final".split(),
    "tech": "smartphone chip software battery robot processor browser update".split(),
}


def write_separable_study(root: Path, model_dir: Path) -> Path:
    """Three topics told apart by their words (16 train, 10 validation, 5 test each, the
    user's own split): a trained head separates them, the untrained one does not."""
    rng = random.Random(0)
    rows = []
    for label, words in WORDS.items():
        for i in range(31):
            split = "train" if i < 16 else "validation" if i < 26 else "test"
            text = " ".join(rng.choice(words) for _ in range(8))
            rows.append({"id": f"{label[:3]}{i}", "text": text, "label": label, "split": split})
    root.mkdir(parents=True)
    return build_study(
        root,
        "classification",
        name="demo-tiny",
        model_dir=model_dir,
        rows=rows,
        set={"task.labels": list(WORDS), "model.architecture": "encoder"},
        adaptation={"target_modules": ["query", "value"]},
        preprocess={"max_seq_len": 32},
        training={
            "micro_batch_size": 8,
            "max_steps": 40,
            "lr": 2e-2,
            "warmup_steps": 0,
            "eval_every_steps": None,
            "checkpoint_every_steps": None,
        },
        evaluation={"batch_size": 16, "bootstrap_samples": 200},
    )


def _row(name, delta, guardrail_pass=True, significant=True):
    return {
        "run_id": f"train-{name}",
        "name": name,
        "compared": True,
        "primary": {
            "baseline": 0.2,
            "variant": 0.2 + delta,
            "delta": delta,
            "ci_low": delta / 2,
            "ci_high": delta * 2,
            "meets_min_improvement": delta >= 0.05,
            "significant": significant,
        },
        "guardrails": [{"rule": "f1 >= baseline", "item": "sport", "pass": guardrail_pass}],
    }


def test_the_decision_rule_and_its_test_figure():
    record = {
        "primary_metric": "macro_f1",
        "min_improvement": 0.05,
        "runs": [_row("v1", 0.3), _row("v2", 0.5, guardrail_pass=False), _row("v3", 0.4)],
    }
    compare = Compare.of("compare.json", record)
    chosen, reasons = choose_variant(compare)
    assert chosen.name == "v3" and reasons == [
        "v2: 1 guardrail(s) fail, e.g. f1 >= baseline on sport"
    ]
    assert decide(compare).startswith("Adopt v3 (run train-v3): macro_f1 0.2000 -> 0.6000")
    assert final_test(compare, [], []) == (
        "v3 is not yet evaluated on the sealed test split: "
        "`tunelab eval train-v3 --split test --final` opens it, once."
    )
    test_eval = RunEvidence(
        row=RunRow("eval-1", "eval", parent="train-v3"),
        evaluations={
            "test": Evaluation(
                Path("metrics-test.json"), {}, "test", 15, metrics={"macro_f1": 0.75}
            )
        },
    )
    other = RunEvidence(row=RunRow("eval-0", "eval", parent="train-v1"))
    opening = SealedOpening("t", "x", "y", "eval-1")
    assert final_test(compare, [other, test_eval], [opening]) == (
        "On the sealed test split (15 examples, eval run eval-1, its only opening): "
        "v3 macro_f1 0.7500 (validation 0.6000)."
    )
    twice = final_test(compare, [test_eval], [opening, SealedOpening("t", "x", "y", "eval-2")])
    assert "opened 2 times in all: no longer an untouched control" in twice
    keep = Compare.of("compare.json", {**record, "runs": [_row("v1", 0.01)]})
    assert choose_variant(keep)[0] is None and final_test(keep, [test_eval], [opening]) is None


@pytest.mark.slow
def test_demo_opens_the_test_split_once_for_the_adopted_variant(tmp_path, tiny_bert_dir):
    root = write_separable_study(tmp_path / "demo", tiny_bert_dir)
    lines: list[str] = []
    result = run_stages(root, demo_stages(["--set", "adaptation.rank=16"], "rank?"), lines.append)

    adopted = result["runs"]["adopted"]
    assert adopted["adopted"], lines
    study = Study.open(root)
    openings = study.ledger.test_openings()
    assert len(openings) == 1, openings
    assert openings[0].who == "tunelab eval --final" and openings[0].why == FINAL_WHY
    test_run = study.get_run(openings[0].run_id)
    assert test_run.row.kind == "eval" and test_run.row.parent == adopted["run_id"]
    record = json.loads(test_run.path("metrics-test.json").read_text())
    assert record["split"] == "test" and record["n"] == 15

    dossier = (root / "report" / "dossier.md").read_text()
    decision = dossier.split("## Decision", 1)[1].split("\n## ", 1)[0]
    assert f"Adopt {adopted['name']} (run {adopted['run_id']})" in decision
    figure = f"{record['metrics']['macro_f1']:.4f}"
    assert (
        f"On the sealed test split (15 examples, eval run {test_run.id}, its only opening): "
        f"{adopted['name']} macro_f1 {figure}"
    ) in decision
    export = next((study.records / "exports").iterdir())
    manifest = json.loads((export / "tunelab-manifest.json").read_text())
    assert manifest["run_id"] == adopted["run_id"]
    assert "the sealed test split was opened once" in manifest["limitations"]
    titles = [t for t, _ in result["timings_s"]]
    assert (
        titles.index("compare with guardrails")
        < titles.index(f"open the sealed test split once: {adopted['name']}")
        < titles.index("dossier")
    )


def test_without_an_adopted_variant_the_test_split_stays_sealed(tmp_path):
    (tmp_path / "records" / "compare").mkdir(parents=True)
    compare = {"primary_metric": "macro_f1", "min_improvement": 0.05, "runs": [_row("v1", 0.0)]}
    (tmp_path / "records" / "compare" / "compare-1.json").write_text(json.dumps(compare))
    stages = demo_stages([], "why")
    results = {"v1": {"run_id": "train-v1"}, "v2": {"run_id": "train-v2"}}
    compare_stage = next(s(results) for s in stages if s(results).title.startswith("compare"))
    results["adopted"] = compare_stage.then(tmp_path, results)
    assert results["adopted"]["adopted"] is False and results["adopted"]["run_id"] == "train-v1"
    final: Stage = stages[
        [s(results).title for s in stages].index("open the sealed test split once: v1")
    ](results)
    assert final.skip and "no variant is adopted" in final.skip
