"""The dossier: built from records, escaped, self-contained, rendered by headless Chromium, and
laid out inside the page at 1280 px for a study of 40 categories."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from helpers import FILLED_HYPOTHESIS, run_cli, train_stopped_at
from helpers.study import build_study
from tunelab.core.ledger import LedgerEvent, RunRow, SealedOpening
from tunelab.core.record_types import Evaluation, RunConfig
from tunelab.core.study import Study
from tunelab.stages.report import stage as report_stage
from tunelab.stages.report.collect import Collected, RunEvidence

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def evaluation_on_test(n: int, metrics: dict) -> Evaluation:
    """An evaluation record on the test split holding only its size and metrics."""
    return Evaluation(Path("metrics-test.json"), {}, "test", n, metrics=metrics)


def render_dom(html_path, tmp_path, *extra: str) -> str:
    """The DOM Chromium builds from the page (headless, no network, fresh profile)."""
    out = subprocess.run(
        [
            CHROMIUM,
            *extra,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chrome-profile'}",
            "--dump-dom",
            html_path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture
def hostile_study(tmp_path, capsys):
    """A registered study whose strings try to inject HTML."""
    behaviour = "<img src=x onerror=\"document.body.setAttribute('data-pwned', '2')\">route"
    return build_study(
        tmp_path / "s",
        name="evil<script>document.body.setAttribute('data-pwned', '1')</script>",
        hypothesis={**FILLED_HYPOTHESIS, "behaviour": behaviour},
        register=True,
        snapshot=False,
    )


def test_report_from_records_escapes_everything(hostile_study, capsys):
    code, out, _ = run_cli(capsys, "report", "-s", hostile_study, "--json")
    assert code == 0
    html_text = (hostile_study / "report" / "dossier.html").read_text()
    assert "<script>document" not in html_text and "&lt;script&gt;" in html_text
    assert "<img src=x onerror" not in html_text
    md = (hostile_study / "report" / "dossier.md").read_text()
    assert "## Hypothesis and guardrails" in md and "Version 1 registered" in md
    assert "The sealed test split was opened 0 time(s)." in md


def test_report_is_rebuilt_not_recorded(hostile_study):
    s = Study.open(hostile_study)

    def body(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if not line.startswith("Built "))

    first = body(report_stage.run(s)["markdown"].read_text())
    second = body(report_stage.run(s)["markdown"].read_text())
    assert first == second and "Version 1" in first


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (make setup installs it as root)"
)
def test_dossier_renders_in_headless_chromium(hostile_study, tmp_path):
    paths = report_stage.run(Study.open(hostile_study))
    dom = render_dom(paths["html"], tmp_path)
    assert "tunelab dossier" in dom
    assert "Hypothesis and guardrails" in dom and "Limitations" in dom
    assert 'data-pwned="' not in dom, "a script from the data ran in the dossier"


# measures the page once it is laid out: what overflows the viewport, outside a scrolling box
_MEASURE = """<script>
window.addEventListener("load", () => {
  const page = document.documentElement, width = page.clientWidth;
  const outside = [...document.body.querySelectorAll("*")].filter(
    (e) => !e.closest(".wide") && e.getBoundingClientRect().right > width + 1);
  const tables = [...document.querySelectorAll("table")];
  document.body.setAttribute("data-layout", JSON.stringify({
    scrollWidth: page.scrollWidth, clientWidth: width,
    bodyScrollWidth: document.body.scrollWidth,
    outside: outside.map((e) => e.tagName + ":" + (e.textContent || "").slice(0, 40)),
    tables: tables.length, boxed: tables.filter((t) => t.parentElement.matches(".wide")).length,
    scrolling: tables.filter((t) => t.parentElement.scrollWidth > t.parentElement.clientWidth + 1)
      .map((t) => (t.caption || {}).textContent || t.rows[0].textContent.slice(0, 40)),
  }));
});
</script>"""

_CATEGORIES = [
    f"customer-support-{topic}-{k:02d}" for k in range(20) for topic in ("billing", "shipping")
]


def _many_category_study(root, model_dir):
    """A classification study of 40 categories with long names sharing a prefix, run through
    the real stages: register, data, baseline, a 2-step LoRA, its evaluation, compare."""
    from helpers.study import build_study

    rows = []
    for k, label in enumerate(_CATEGORIES):
        for i in range(5):
            split = "train" if i < 3 else "validation" if i < 4 else "test"
            text = f"ticket {i} of queue {k}: {label.replace('-', ' ')} question number {i}"
            rows.append({"id": f"q{k:02d}-{i}", "text": text, "label": label, "split": split})
    root.mkdir(parents=True)
    return build_study(
        root, "classification", name="forty-queues", model_dir=model_dir, rows=rows,
        set={"task.labels": _CATEGORIES, "model.architecture": "encoder"},
        adaptation={"method": "lora", "target_modules": ["query", "value"]},
        preprocess={"max_seq_len": 32},
        training={
            "micro_batch_size": 8, "max_steps": 2, "lr": 5e-3, "warmup_steps": 0,
            "eval_every_steps": None, "checkpoint_every_steps": None, "num_threads": 1,
        },
        evaluation={"batch_size": 16, "bootstrap_samples": 50},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (make setup installs it as root)"
)
def test_a_dossier_of_40_categories_stays_inside_a_1280_px_page(tmp_path, tiny_bert_dir, capsys):
    root = _many_category_study(tmp_path / "s", tiny_bert_dir)
    for args in (["register"], ["data"], ["baseline"], ["train", "--name", "v1"]):
        code, out, err = run_cli(capsys, *args, "-s", root)
        assert code == 0, err
    study = Study.open(root)
    v1 = next(r for r in study.list_runs() if r.kind == "train")
    for args in (["eval", v1.id], ["compare"]):
        code, out, err = run_cli(capsys, *args, "-s", root)
        assert code == 0, err
    paths = report_stage.run(study)
    md = paths["markdown"].read_text()
    # the decision comes first, then a table of contents naming every section
    assert md.index("Contents:") < md.index("## Decision") < md.index("## Hypothesis")
    assert "| adopted variant |" in md and "| guardrails |" in md
    assert "- [Comparisons and guardrails](#comparisons-and-guardrails)" in md
    # one row per category, not one column: the table of counts has 5 columns, not 42
    assert "| category | train | validation | test | total |" in md
    assert md.count("| 40. customer-support-shipping-19 |") == 2  # baseline's and v1's matrix
    page = paths["html"].read_text()
    assert '<a href="#comparisons-and-guardrails">' in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", _MEASURE + "</body>"))
    dom = render_dom(probe, tmp_path, "--window-size=1280,900", "--virtual-time-budget=10000")
    start = dom.index('data-layout="') + len('data-layout="')
    layout = json.loads(html.unescape(dom[start : dom.index('"', start)]))
    assert layout["clientWidth"] >= 1200, layout
    assert layout["scrollWidth"] <= layout["clientWidth"], layout  # no horizontal scroll bar
    assert layout["bodyScrollWidth"] <= layout["clientWidth"], layout
    assert layout["outside"] == [], layout
    assert layout["tables"] == layout["boxed"], layout
    # the confusion matrices are wider than the page: they scroll in their own box
    assert any("confusion matrix" in c for c in layout["scrolling"]), layout


def _decision_data(compare: dict, n: int, metrics: dict, why: str) -> Collected:
    """The collected records a decision section reads: the comparison `compare`, and the eval
    run of its variant train-a that opened the test split (`n` examples, `metrics`)."""
    from tunelab.core.record_types import Compare

    test_run = RunEvidence(
        row=RunRow("eval-t", "eval", parent="train-a"),
        evaluations={"test": evaluation_on_test(n, metrics)},
    )
    openings = [SealedOpening("t", "x", why, "eval-t")]
    compares = [Compare.of("compare/compare-1.json", compare)]
    return Collected(runs=[test_run], compares=compares, test_openings=openings)


def test_the_decision_summary_names_the_adopted_variant_its_interval_and_its_test_figure():
    from tunelab.stages.report.document import cell_text
    from tunelab.stages.report.sections.context import Dossier
    from tunelab.stages.report.sections.decision import decision_section

    compare = {
        "id": "compare-1",
        "split": "validation",
        "hypothesis_version": 1,
        "primary_metric": "macro_f1",
        "min_improvement": 0.05,
        "runs": [
            {"run_id": "train-a", "name": "v1", "compared": True, "flags": [],
             "primary": {"baseline": 0.3, "variant": 0.8, "delta": 0.5, "ci_low": 0.4,
                         "ci_high": 0.6, "meets_min_improvement": True, "significant": True},
             "guardrails": [{"rule": "f1", "pass": True}, {"rule": "acc", "pass": True}]},
            {"run_id": "train-b", "name": "v2", "compared": True, "flags": [],
             "primary": {"baseline": 0.3, "variant": 0.9, "delta": 0.6, "ci_low": 0.5,
                         "ci_high": 0.7, "meets_min_improvement": True, "significant": True},
             "guardrails": [{"rule": "f1", "pass": False, "item": "sport"}]},
        ],
    }  # fmt: skip
    data = _decision_data(compare, 120, {"macro_f1": 0.7912}, why="y")
    sec = decision_section(Dossier(None, data, None))
    rows = {r[0]: cell_text(r[1]) for r in sec.blocks[0].rows}
    assert rows["adopted variant"] == "v1 (run train-a)"  # v2 gains more but fails a guardrail
    assert rows["primary metric (macro_f1, validation)"].startswith(
        "0.3000 -> 0.8000, delta +0.5000, 95 % CI [+0.4000, +0.6000]"
    )
    assert rows["guardrails"] == "2 of 2 checks pass"
    assert rows["sealed test split"] == "macro_f1 0.7912 on 120 examples (its only opening)"
    sec = decision_section(Dossier(None, replace(data, test_openings=[], runs=[]), None))
    rows = {r[0]: cell_text(r[1]) for r in sec.blocks[0].rows}
    assert rows["sealed test split"].startswith("not opened yet: `tunelab eval train-a")


def test_the_decision_summary_never_says_not_opened_after_an_unadopted_run_opened_the_test():
    from tunelab.stages.report.document import cell_text
    from tunelab.stages.report.sections.context import Dossier
    from tunelab.stages.report.sections.decision import decision_section

    compare = {
        "id": "compare-1", "split": "validation", "hypothesis_version": 1,
        "primary_metric": "macro_f1", "min_improvement": 0.05,
        "runs": [
            {"run_id": "train-a", "name": "v1", "compared": True, "flags": [],
             "primary": {"baseline": 0.3, "variant": 0.29, "delta": -0.01, "ci_low": -0.06,
                         "ci_high": 0.04, "meets_min_improvement": False, "significant": False},
             "guardrails": [{"rule": "f1", "pass": False, "item": "tech"}]},
        ],
    }  # fmt: skip
    data = _decision_data(compare, 305, {"macro_f1": 0.28}, why="final decision")
    rows = {
        r[0]: cell_text(r[1]) for r in decision_section(Dossier(None, data, None)).blocks[0].rows
    }
    assert rows["adopted variant"].startswith("none")
    assert "not opened" not in rows["sealed test split"]
    assert rows["sealed test split"].startswith("opened once")
    data = replace(data, test_openings=[])
    rows = {
        r[0]: cell_text(r[1]) for r in decision_section(Dossier(None, data, None)).blocks[0].rows
    }
    assert rows["sealed test split"] == "not opened: no variant is adopted"


# ------------------------------------------------- a study with a resumed run and an amendment


@pytest.fixture(scope="module")
def amended_study(tmp_path_factory, tiny_bert_dir):
    """A real study on the tiny BERT: register (v1), data, inspect, baseline, a run stopped by
    SIGTERM after step 2 and resumed to the end, its evaluation and a comparison, all under
    hypothesis v1; then the hypothesis amended (v2) and the dossier built."""

    import torch

    from helpers import register_study, write_topic_study
    from tunelab.stages.compare import stage as compare_stage
    from tunelab.stages.compare.stage import save_compare
    from tunelab.stages.evaluate import stage as evaluate_stage
    from tunelab.stages.hypothesis import stage as hypothesis_stage
    from tunelab.stages.inspect import stage as inspect_stage
    from tunelab.stages.train import resume_run

    torch.set_num_threads(1)
    root = write_topic_study(
        tmp_path_factory.mktemp("amended") / "s",
        tiny_bert_dir,
        "amended",
        max_steps=4,
        training={"checkpoint_every_steps": 1, "num_threads": 1},
    )
    study = register_study(root)
    inspect_stage.run(study)
    evaluate_stage.run(study)
    stopped = train_stopped_at(study, 2, "lora", why="LoRA on query and value")
    resume_run(Study.open(root), stopped.id)
    evaluate_stage.run(study, stopped.id)
    save_compare(study, compare_stage.run(study))
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["hypothesis"]["rationale"] = "the encoder never saw these three topics"
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    study = Study.open(root)
    assert hypothesis_stage.run(study.root, study.config)[0]["version"] == 2
    return {"root": root, "run": stopped.id, "paths": report_stage.run(study)}


def _section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 1)
    return md[start : end if end >= 0 else None]


def test_the_dossier_shows_a_run_was_interrupted_and_resumed(amended_study):
    run = amended_study["run"]
    md = amended_study["paths"]["markdown"].read_text()
    runs = _section(md, "Every run, failed ones included")
    (row,) = [line for line in runs.splitlines() if line.startswith(f"| {run} |")]
    assert "completed, resumed 1x" in row  # the status alone says nothing of the stop
    assert "| train | lora r" in row  # how the run's model was adapted
    (base,) = [line for line in runs.splitlines() if "| baseline |" in line]
    assert "| baseline | base |" in base
    assert (
        f"lora ({run}): interrupted 1 time and resumed 1 time. Interrupted at " in runs
        and "stopped by SIGTERM after step 2; checkpoint step-000002 saved" in runs
        and "resumed from step-000002" in runs
    ), runs
    page = amended_study["paths"]["html"].read_text()
    assert "completed, resumed 1x" in page and "resumed from step-000002" in page


def test_the_dossier_says_which_records_an_earlier_hypothesis_made(amended_study):
    md = amended_study["paths"]["markdown"].read_text()
    page = amended_study["paths"]["html"].read_text()
    stale = "made under hypothesis v1; current is v2"
    for title in (
        "Decision",
        "Inspection of preprocessing",
        "Baseline and variants on the validation split",
        "Every run, failed ones included",
        "Comparisons and guardrails",
    ):
        assert stale in _section(md, title), title
    assert "| hypothesis | made under v1; current is v2 |" in _section(md, "Decision")
    assert page.count(stale) == md.count(stale)
    # a record of the current version says nothing
    assert "current is v2" not in _section(md, "Hypothesis and guardrails")


def test_each_interruption_is_paired_with_the_resume_that_followed_it():
    from tunelab.stages.report.sections.runs import _history, resumed_steps, stops_and_resumes

    events = [
        LedgerEvent("created", "t0", "running"),
        LedgerEvent("status:interrupted", "t1", "killed before a checkpoint"),
        LedgerEvent("status:running", "t2", "resumed from the start (no checkpoint yet)"),
        LedgerEvent("update_check", "t3", "{}"),
        LedgerEvent("status:interrupted", "t4", "stopped by SIGINT after step 6"),
        LedgerEvent("status:running", "t5", "resumed from step-000006"),
        LedgerEvent("status:interrupted", "t6", "stopped by SIGTERM after step 9"),
    ]
    stops = stops_and_resumes(events)
    assert [(s["at"], s["resumed_at"]) for s in stops] == [("t1", "t2"), ("t4", "t5"), ("t6", None)]
    assert resumed_steps(stops) == [0, 6]
    text = _history("v1", "train-x", stops)
    assert text.startswith("v1 (train-x): interrupted 3 times and resumed 2 times. 1. interrupted")
    assert "resumed from the start (no checkpoint yet) at t2" in text
    assert text.endswith("3. interrupted at t6 (stopped by SIGTERM after step 9), not resumed "
                         "(`tunelab resume train-x` continues it).")  # fmt: skip


def test_a_record_naming_no_hypothesis_version_is_dated_against_the_registrations():
    from tunelab.core.record_types import Hypothesis
    from tunelab.stages.report.sections.context import Dossier

    hypotheses = [
        Hypothesis(Path(f"hypothesis-v{v}.json"), {}, version=v, registered_at=at)
        for v, at in ((1, "2026-12-01T10:00:00.000Z"), (2, "2026-12-01T12:00:00.500Z"))
    ]
    d = Dossier(None, Collected(hypotheses=hypotheses), None)
    assert d.made_under({"hypothesis_version": 2}) is None
    assert d.made_under({"hypothesis_version": 1}) == "made under hypothesis v1; current is v2"
    # the same second as the amendment, before its milliseconds
    assert d.made_under({"created_at": "2026-12-01T12:00:00Z"}) == (
        "made under hypothesis v1 (the latest registered when it was made); current is v2"
    )
    assert d.made_under({"created_at": "2026-12-01T12:00:01Z"}) is None
    assert d.made_under({"created_at": "2026-12-01T09:00:00Z"}) == (
        "made before any hypothesis was registered; current is v2"
    )
    assert d.made_under({}) is None  # no version, no time: nothing to say


def test_the_run_table_names_each_run_s_adaptation_from_its_config():
    from tunelab.stages.report.sections.runs import adaptation_of

    def run(kind, method, parent=None):
        adaptation = {"method": method, "rank": 16, "quantization": {"quant_type": "fp4"}}
        config = RunConfig(Path("config.json"), {}, config={"adaptation": adaptation})
        return RunEvidence(row=RunRow(f"{kind}-1", kind, parent=parent), config=config)

    qlora, full = run("train", "qlora"), run("train", "full")
    by_id = {"q": qlora, "f": full}
    assert adaptation_of(qlora, by_id) == "qlora r16 fp4"
    assert adaptation_of(full, by_id) == "full"
    assert adaptation_of(run("baseline", "qlora"), by_id) == "base, 4-bit"
    assert adaptation_of(run("baseline", "lora"), by_id) == "base"
    assert adaptation_of(run("eval", "lora", parent="q"), by_id) == "qlora r16 fp4"
    assert adaptation_of(RunEvidence(row=RunRow("train-2", "train")), by_id) == "-"
