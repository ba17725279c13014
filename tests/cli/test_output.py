"""What a user reads: terminal output captured at 80 columns, without a TTY."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import run_cli
from tunelab.core.record_types import Evaluation


@pytest.fixture(autouse=True)
def eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def assert_fits(text: str) -> None:
    """Every line within 80 columns, except a lone path longer than that (kept whole to copy)."""
    wide = [line for line in text.splitlines() if len(line) > 80 and " " in line.strip()]
    assert not wide, "lines wider than 80 columns:\n" + "\n".join(wide)


def test_help_lists_commands_in_protocol_order_one_line_each(capsys):
    from tunelab.cli._help import PROTOCOL

    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert_fits(out)
    assert "<bool>" not in out
    assert "Other" not in out  # every command has its stage
    listed = re.findall(r"^│ ([a-z][a-z-]+)\s{2,}\S", out, flags=re.M)
    expected = [name for _, items in PROTOCOL for name, _ in items]
    assert listed == expected
    for panel, _ in PROTOCOL:
        assert f"─ {panel} ─" in out
    # one line per command: no continuation line inside a command panel
    assert not re.search(r"^│ {10,}\S", out, flags=re.M)


def test_command_help_shows_no_type_for_flags(capsys):
    code, out, _ = run_cli(capsys, "compare", "--help")
    assert code == 0
    assert_fits(out)
    assert "<bool>" not in out
    assert re.search(r"--json\s+Print the result as JSON", out)


def _compare_output(tmp_path, capsys) -> tuple[str, list]:
    from helpers.compare import _populate, _study

    study = _study(tmp_path)
    runs = _populate(study)
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 0, err
    return out, runs


def test_compare_shows_names_full_ids_and_both_verdicts(tmp_path, capsys):
    out, (base, good, messy, failed, *_) = _compare_output(tmp_path, capsys)
    assert_fits(out)
    assert "…" not in out  # no id or cell cut
    summary = out.split("\n\n")[0]
    for run in (good, messy, failed):
        assert run.id in summary
    assert re.search(r"│ r16 +│ \+0\.4500", summary)  # the name the user gave, above its id
    assert re.search(rf"│ {good.id} │ \[\+0\.3\d+, \+0\.6\d+\] ", summary)
    # the interval's verdict beside the threshold's: a zero delta spans 0 and does not meet min
    rows = {line.split("│")[1].strip(): line for line in summary.splitlines() if "│" in line}
    assert rows["r16"].split("│")[3:5] == [" above 0 ", " yes   "]
    assert rows[messy.id].split("│")[3:5] == [" spans 0 ", " no    "]
    assert "oom: failed: CUDA out of memory" in summary
    # flipped ids as a list a reader reads, not a Python list; no empty note column
    flat = " ".join(out.split())
    assert "['" not in out and re.search(
        r"flips: 18 improved: \S+, \S+, .* \(10 more\); 0 regressed", flat
    )
    assert "┃ note" not in out


def test_compare_says_no_difference_for_an_empty_config_diff(tmp_path, capsys):
    from helpers.compare import _study
    from tunelab.core.study import Study

    study = _study(tmp_path)
    _populate_same_config(study, Study)
    code, out, err = run_cli(capsys, "compare", "-s", study.root)
    assert code == 0, err
    assert re.search(r"config diff against baseline-\S+: no difference", out)
    assert "┃ group" not in out


def _populate_same_config(study, Study) -> None:
    from helpers.compare import BASE_P, GOLDS, GOOD_P, _record

    base = study.create_run("baseline", data_snapshot="snap1", config=study.config)
    _record(study, base, GOLDS, BASE_P)
    base.set_status("completed")
    same = study.create_run("train", name="same", data_snapshot="snap1", config=study.config)
    _record(study, same, GOLDS, GOOD_P)
    same.set_status("completed")


def test_model_card_prints_the_interval_verdict_beside_the_threshold():
    from tunelab.stages.export.card import primary_verdict

    spans = {"metric": "macro_f1", "delta": 0.03, "ci_low": -0.01, "ci_high": 0.07}
    spans.update(min_improvement=0.02, meets_min_improvement=True, significant=False)
    text = primary_verdict(spans)
    assert "95% interval spans 0 (significant: no)" in text
    assert "minimum improvement 0.0200: met" in text


def test_data_summary_splits_kinds_full_ids_label_conflicts_and_the_test_command(tmp_path, capsys):
    from helpers.data import jsonl_study, make_rows, ticket

    rows = [{**r, "part": "train"} for r in make_rows(40)]
    rows += [
        {**rows[5], "label": "sales" if rows[5]["label"] != "sales" else "billing"},  # conflict
        {**rows[6], "part": "test"},  # across splits
        {"text": ticket(500, "sales"), "label": "sales", "part": "test"},
        {"text": ticket(500, "sales"), "label": "sales", "part": "test"},  # test-test
    ]
    for i, r in enumerate(rows):
        r["doc"] = f"bbc-news-archive-2005/business/article-{i:04d}-long-identifier.txt"
    s = jsonl_study(
        tmp_path,
        rows,
        fields={"split": "part", "id": "doc"},
        dedup={"policy": "report_only"},
    )
    code, out, err = run_cli(capsys, "data", "-s", s.root)
    assert code == 0, err
    assert_fits(out)
    dup = out[out.index("duplicates (policy") :]
    # within-split kinds under "within a split", the others under "across splits"
    within, across = dup.index("within a split"), dup.index("across splits")
    assert within < dup.index("train-train") < across
    assert within < dup.index("test-test") < across
    assert across < dup.index("train-test")
    # duplicate-pair ids never cut: every id is there, whole once the folds are joined
    pairs = out[out.index("duplicate pairs") : out.index("warning:")]
    cells = "".join(
        line.split("│")[1].strip() for line in pairs.splitlines() if line.startswith("│")
    )
    assert f"{rows[5]['doc']}" in cells and "…" not in pairs
    # the label conflict: warned, its group shown, the fix named
    assert "warning: 1 group(s) of identical or near-identical texts carry different labels" in out
    assert "billing x1" in out or "sales x1" in out
    assert "correct the labels" in out and "drop_all_but_one" in out
    assert out.rstrip().splitlines()[-1] == "  tunelab eval RUN --split test --final"


def test_label_conflict_groups_worst_first():
    from tunelab.stages.data.dedup import label_conflict_groups

    pair = lambda a, b, la, lb, s=1.0: dict(a=a, b=b, label_a=la, label_b=lb, similarity=s)  # noqa: E731
    groups = label_conflict_groups(
        [
            pair("x1", "x2", "a", "b", 0.9),
            pair("y1", "y2", "a", "b"),
            pair("y2", "y3", "b", "c"),
            pair("z1", "z2", "a", "a"),  # same label: no conflict
        ]
    )
    assert [sorted(g["rows"]) for g in groups] == [["y1", "y2", "y3"], ["x1", "x2"]]
    assert groups[0]["labels"] == {"a": 1, "b": 1, "c": 1} and groups[1]["similarity"] == 0.9


def _evaluation_record(labels: list[str], n_each: int = 3) -> Evaluation:
    from tunelab.lib.metrics import classification_metrics

    golds = [lab for lab in labels for _ in range(n_each)]
    preds = [labels[(i + (i % 3 == 0)) % len(labels)] for i in range(len(golds))]
    record = {
        "split": "validation",
        "metrics": classification_metrics(golds, preds, labels),
        "task_kind": "classification",
        "n": len(golds),
        "examples_per_s": 10.0,
        "spec_sha256": "0" * 64,
    }
    return Evaluation.of("metrics-validation.json", record)


def test_confusion_headers_that_share_a_prefix_are_numbered_and_paged(capsys):
    from tunelab.cli.evaluate import print_evaluation

    labels = [f"nouvelles-{topic}" for topic in ("sport", "politique", "economie", "culture")]
    labels += [f"nouvelles-region-{i:02d}" for i in range(14)]
    print_evaluation(_evaluation_record(labels), "validation evaluation")
    out = capsys.readouterr().out
    assert_fits(out)
    assert "nou…" not in out and "…" not in out
    conf = out[out.index("confusion (rows: gold, columns: predicted") :]
    assert "numbered as the rows" in conf
    for i, label in enumerate(labels, start=1):
        assert f"│ {i} {label}" in conf  # each row names its number and its whole label
    # paged: every column number appears as a header exactly once across the pages
    heads = [
        h.strip()
        for line in conf.splitlines()
        if line.startswith("┃")
        for h in line.strip("┃").split("┃")[1:]
    ]
    assert heads == [str(i) for i in range(1, len(labels) + 1)]
    assert "(1-" in conf and f"of {len(labels)})" in conf


def test_a_small_confusion_keeps_its_label_names(capsys):
    from tunelab.cli.evaluate import print_evaluation

    print_evaluation(_evaluation_record(["ham", "spam"]), "validation evaluation")
    out = capsys.readouterr().out
    assert re.search(r"┃ gold +┃ +ham ┃ +spam ┃", out)
    assert "numbered" not in out


def test_one_character_labels_keep_the_gold_header_whole(capsys):
    from tunelab.cli.evaluate import print_evaluation

    print_evaluation(_evaluation_record([str(d) for d in range(10)]), "validation evaluation")
    out = capsys.readouterr().out
    assert_fits(out)
    assert re.search(r"┃ gold ┃ 0 ┃ 1 ┃", out)  # digits as labels: "gold" is not folded


def test_a_typo_in_a_set_key_names_set_as_its_source(tmp_path, capsys):
    root = tmp_path / "study"
    assert run_cli(capsys, "init", root, "--task", "classification")[0] == 0
    code, _, err = run_cli(capsys, "validate", "-s", root, "--set", "training.lrr=1e-4")
    assert code == 2
    assert "--set: 1 problem(s)" in err and "study.yaml: 1 problem" not in err
    assert "training.lrr: unknown key" in err and "(from --set training.lrr=1e-4)" in err
    code, _, err = run_cli(capsys, "validate", "-s", root, "--set", "trainng.lr=1e-4")
    assert code == 2 and "(from --set trainng.lr=1e-4)" in err


def test_a_set_value_that_validate_refuses_names_its_set_item_not_study_yaml(tmp_path, capsys):
    """Contradictions and data checks made on an overridden value name the `--set` item; a
    problem written in study.yaml still names study.yaml."""
    root = tmp_path / "study"
    assert run_cli(capsys, "init", root, "--task", "classification")[0] == 0
    code, _, err = run_cli(
        capsys, "validate", "-s", root,
        "--set", "training.max_steps=2", "--set", "data.source.path=moved.jsonl",
    )  # fmt: skip
    assert code == 2
    assert err.startswith("error: --set: 2 problem(s)") and "study.yaml" not in err, err
    flat = " ".join(err.split())
    assert "exceed training.max_steps (2)" in flat and "(from --set training.max_steps=2)" in flat
    assert "(from --set data.source.path=moved.jsonl)" in flat
    assert "change the --set values named above" in flat
    # the template's data folder does not exist: that problem is study.yaml's, the other --set's
    code, _, err = run_cli(capsys, "validate", "-s", root, "--set", "training.max_steps=2")
    assert code == 2
    assert f"{root / 'study.yaml'} and --set: 2 problem(s)" in " ".join(err.split()), err
    lines = [line for line in err.splitlines() if line.startswith("  - ")]
    assert [("--set" in line) for line in lines] == [True, False], lines


def test_register_and_a_stage_name_the_set_item_a_refused_value_came_from(tmp_path, capsys):
    from helpers import fill_hypothesis

    root = tmp_path / "study"
    assert run_cli(capsys, "init", root, "--task", "classification")[0] == 0
    fill_hypothesis(root / "study.yaml")
    code, _, err = run_cli(capsys, "register", "-s", root, "--set", "training.max_steps=2")
    assert code == 2
    flat = " ".join(err.split())
    assert "cannot register" in flat and "(from --set training.max_steps=2)" in flat
    assert "change the --set values named above" in flat
    code, _, err = run_cli(capsys, "data", "-s", root, "--set", "data.source.path=moved.jsonl")
    assert code == 2
    flat = " ".join(err.split())
    assert "moved.jsonl" in flat
    assert (
        "note: data.source.path comes from `--set data.source.path=moved.jsonl` on this command "
        "line, not from study.yaml"
    ) in flat


def test_inspect_of_a_classifier_says_the_loss_is_on_the_label(tmp_path, capsys, tiny_bert_dir):
    from helpers.inspection import write_study

    labels = ["business", "sport", "tech"]
    rows = [
        {"text": f"article {i} about {labels[i % 3]} and the markets today", "label": labels[i % 3]}
        for i in range(30)
    ]
    task = {"kind": "classification", "instruction": "Classify the article."}
    root = write_study(tmp_path / "s", tiny_bert_dir, rows, task, {"max_seq_len": 32})
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "1")
    assert code == 0, err
    assert "the loss is on the label" in out and "0 under the loss" not in out


def test_smoke_flags_an_adapter_faster_than_none_as_timing_noise():
    from tunelab.cli.smoke import _adapter_row
    from tunelab.core.record_types import Smoke

    timing = {"unit": "step", "pairs": 3}
    smoke = Smoke(Path("smoke.json"), {}, adapter_timing=timing, adapter_time_ratio=0.72)
    (row,) = _adapter_row(smoke)
    assert row[1].startswith("x 0.72 per step") and "timing noise" in row[1]
    (row,) = _adapter_row(replace(smoke, adapter_time_ratio=1.22))
    assert "noise" not in row[1]


def test_copies_differing_only_in_punctuation_and_quotes_are_near_duplicates(tmp_path):
    from helpers.data import jsonl_study
    from tunelab.stages.data import stage as data_stage
    from tunelab.stages.data.dedup import find_near_duplicates, normalize_texts

    article = (
        'The minister said: "We will not raise taxes - not this year, not next year." '
        "Critics replied that the budget's numbers didn't add up; the deficit, they said, "
        "would grow by 3% before the election... Markets fell sharply on the news."
    )
    copy = (
        "The minister said \u201cWe will not raise taxes \u2014 not this year; not next year\u201d "
        "Critics replied that the budget\u2019s numbers didn\u2019t add up \u2013 the deficit "
        "they said would grow by 3 % before the election. Markets fell sharply on the news!"
    )
    found = find_near_duplicates(normalize_texts([article, copy]), threshold=0.8)
    assert found.pairs.tolist() == [[0, 1]] and found.similarity[0] >= 0.95
    rows = [{"text": article, "label": "politics"}, {"text": copy, "label": "politics"}]
    rows += [{"text": f"unrelated text number {i} about sport", "label": "sport"} for i in range(8)]
    for r in rows:
        r["part"] = "train"
    study = jsonl_study(tmp_path, rows, fields={"split": "part"}, dedup={"policy": "report_only"})
    m = data_stage.run(study)
    assert m["duplicates"]["near_pairs"] == 1
    assert "punctuation" in m["dedup"]["shingle_normalization"]


def test_bitsandbytes_optional_kernel_note_is_kept_off_the_screen():
    """Its CPU backend logs, at import, that an optional package is missing (then uses its own
    kernel); every other record of that logger still reaches the user."""
    import logging

    import tunelab  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def shown(msg: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, "ops.py", 1, msg, (), None)
        return logger.filter(record)

    assert not shown("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please")
    assert shown("Failed to quantize: something a user must see")


def test_runs_lists_every_id_and_parent_whole_and_each_reason(tmp_path, capsys):
    from tunelab.core.study import Study

    run_cli(capsys, "init", tmp_path / "s")
    study = Study.open(tmp_path / "s")
    base = study.create_run("baseline")
    base.set_status("completed")
    child = study.create_run("train", name="lora-rank-16-all-linear", parent=base.id)
    reason = "the update check failed: " + "a frozen tensor moved, " * 6 + "see status.json"
    child.set_status("failed", reason)
    code, out, err = run_cli(capsys, "runs", "-s", tmp_path / "s")
    assert code == 0, err
    assert_fits(out)
    assert "…" not in out
    assert base.id in out and f"from {base.id}" in out and child.id in out
    assert reason in " ".join(out.split())


def column_cells(text: str, column: int) -> str:
    """The cells of one column of the tables in `text`, joined: a folded path reads whole."""
    return "".join(
        line.split("│")[column + 1].strip() for line in text.splitlines() if line.startswith("│")
    )


LONG_OBJECT = "shipping_address_of_the_recipient"
LONG_PATH = f"{LONG_OBJECT}.street_name_and_house_number_with_its_suffix_letter"


def _long_path_comparison(tmp_path) -> tuple[Path, list]:
    """A registered extraction study whose required field path is longer than a line, with a
    baseline (5 of 20 right) and a training run (15 of 20) scored by the task itself."""
    import yaml

    from helpers import filled_hypothesis
    from tunelab.core.study import Study
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import judge_output
    from tunelab.stages.evaluate.stage import compute_metrics, record_evaluation
    from tunelab.stages.hypothesis import stage as hyp
    from tunelab.stages.hypothesis.template import render_study_yaml

    leaf = LONG_PATH.split(".")[1]
    raw = yaml.safe_load(render_study_yaml("extraction", "paths"))
    raw["hypothesis"] = filled_hypothesis(raw)
    raw["evaluation"]["bootstrap_samples"] = 100
    raw["task"]["json_schema"] = {
        "type": "object",
        "required": [LONG_OBJECT],
        "properties": {
            LONG_OBJECT: {
                "type": "object",
                "required": [leaf],
                "properties": {leaf: {"type": "string"}},
            }
        },
    }
    root = tmp_path / "study"
    root.mkdir()
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    study = Study.open(root)
    hyp.run(study.root, study.config)
    task = get_task(study.config)
    runs = []
    for kind, right in (("baseline", 5), ("train", 15)):
        rows = []
        for i in range(20):
            gold = json.dumps({LONG_OBJECT: {leaf: f"{i} Main Street"}})
            rows.append(
                judge_output(task, {"id": f"e{i}", "target": gold}, gold if i < right else "no")
            )
        run = study.create_run(kind, name=kind, data_snapshot="s")
        record = {"split": "validation", "spec_sha256": "spec", "template_sha256": "t",
                  "hypothesis_version": 1, "task_kind": "extraction", "fields": task.fields,
                  "n": len(rows), "metrics": compute_metrics(task, rows)}  # fmt: skip
        record_evaluation(run, record, rows)
        run.set_status("completed")
        runs.append(run)
    return root, runs


def test_compare_and_eval_show_every_field_path_whole_at_80_columns(tmp_path, capsys):
    from tunelab.cli.evaluate import print_evaluation

    assert len(LONG_PATH) > 80
    root, (_, train) = _long_path_comparison(tmp_path)
    code, out, err = run_cli(capsys, "compare", "-s", root)
    assert code == 0, err
    assert_fits(out)
    assert "…" not in out
    per_field = out[out.index("per field delta") : out.index("guardrails")]
    assert LONG_OBJECT in column_cells(per_field, 0)
    assert LONG_PATH in column_cells(per_field, 0)
    # each metric's delta and interval on one line, beside its name
    assert re.search(r"│ normalized_match │ \+0\.5000 \[\+0\.\d{4}, \+0\.\d{4}\] │", per_field)
    guards = out[out.index("guardrails") : out.index("flips:")]
    assert LONG_PATH in column_cells(guards, 1)
    print_evaluation(
        Evaluation.read(train.path("metrics-validation.json")), "validation evaluation"
    )
    out = capsys.readouterr().out
    assert_fits(out)
    assert "…" not in out and LONG_PATH in column_cells(out[out.index("per field") :], 0)
