"""`tunelab inspect`: examples per category after the exact training preprocessing, the
stop conditions over the whole split, the record and its HTML page."""

from __future__ import annotations

import pytest
import yaml
from transformers import AutoTokenizer

from helpers.inspection import write_study
from tunelab.core.config import validate_config
from tunelab.core.record_inspect import Inspection
from tunelab.lib.preprocess.mask_checks import IGNORE_INDEX
from tunelab.lib.preprocess.text import Preprocessor, length_stats
from tunelab.lib.tasks import get_task
from tunelab.stages.hypothesis.template import render_study_yaml
from tunelab.stages.inspect.stage import categorize, inspect_rows, render_html, select_examples

LABELS = ["business", "sport", "tech"]
TEXTS = {
    "business": "Markets rallied as the central bank held interest rates steady.",
    "sport": "The striker scored twice in the second half to win the match.",
    "tech": "A new smartphone with a faster chip and longer battery life was announced.",
}


def make(tok, kind="classification", arch="causal_lm", preprocess=None, labels=LABELS):
    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    raw["preprocess"].update(preprocess or {})
    cfg = validate_config(raw)
    task = get_task(cfg, labels if kind == "classification" else None)
    return Preprocessor(tok, cfg, task, arch), task


def clf_rows(n_per_label=4):
    rows = []
    for k in range(n_per_label):
        for label in LABELS:
            rows.append(
                {
                    "id": f"{label}-{k}",
                    "text": TEXTS[label] * (k + 1),
                    "label": label,
                    "target": None,
                }
            )
    return rows


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_categories_and_selection():
    rows = clf_rows(4)
    cats = categorize(rows)
    assert cats == [r["label"] for r in rows]
    picked = select_examples(cats, 2)
    assert [rows[i]["id"] for i in picked] == [
        "business-0", "business-1", "sport-0", "sport-1", "tech-0", "tech-1",
    ]  # fmt: skip
    # unlabelled rows: few distinct targets are the categories (a format task's verdicts)
    verdicts = [{"id": str(i), "label": None, "target": ["yes", "no"][i % 2]} for i in range(6)]
    assert categorize(verdicts) == ["yes", "no"] * 3
    # many distinct targets: one category
    free = [{"id": str(i), "label": None, "target": f"t{i}"} for i in range(30)]
    assert categorize(free) == ["all"] * 30
    assert select_examples(["all"] * 5, 3) == [0, 1, 2]


def test_inspect_shows_every_category_with_loss_positions(tiny_tok):
    pre, task = make(tiny_tok, preprocess={"max_seq_len": 120})
    rows = clf_rows(4)
    rec = inspect_rows(pre, task, rows, per_category=2)
    assert rec["ok"] and rec["problems"] == [] and rec["collator"]["checked"]
    cats = [e["category"] for e in rec["examples"] if e["why_shown"] == "category"]
    assert cats == ["business"] * 2 + ["sport"] * 2 + ["tech"] * 2
    longest = [e for e in rec["examples"] if e["why_shown"] == "longest"]
    assert [e["id"] for e in longest] == ["tech-3"] and longest[0]["truncated"]
    assert longest[0]["truncation_at"] is not None
    for e in rec["examples"]:
        loss = "".join(t["text"] for t in e["tokens"] if t["loss"])
        assert loss == e["loss_decoded"] == e["category"] + "<|im_end|>" == e["expected_loss_text"]
        assert e["check"] == "ok" and e["num_tokens"] == len(e["tokens"]) <= 120
        assert e["rendered"].startswith("<|im_start|>user\n")
        assert any(t["special"] and t["text"] == "<|im_start|>" for t in e["tokens"])
    encoded = [pre.encode(r) for r in rows]
    assert rec["stats"] == length_stats(encoded)
    assert set(rec["category_stats"]) == set(LABELS)
    assert rec["template_sha256"] == pre.template_sha256


def test_inspect_stops_on_truncated_targets_and_names_them(tiny_tok):
    pre, task = make(tiny_tok, "extraction", preprocess={"max_seq_len": 48})
    target = '{"sender": "alice@example.com", "subject": "Meeting tomorrow"}'
    rows = [
        {"id": "short", "text": "hi", "label": None, "target": '{"sender": "a", "subject": "b"}'},
        {"id": "long-answer", "text": "hello", "label": None, "target": target},
    ]
    rec = inspect_rows(pre, task, rows, per_category=1)
    assert not rec["ok"]
    assert [(p["example_id"], p["kind"]) for p in rec["problems"]] == [
        ("long-answer", "target_truncated")
    ]
    shown = {e["id"]: e for e in rec["examples"]}
    assert shown["long-answer"]["check"] == "target_truncated"
    assert shown["short"]["check"] == "ok"
    assert rec["stats"]["target_truncated"] == 1


def test_inspect_train_on_prompt_passes_the_training_collator(tiny_tok):
    pre, task = make(tiny_tok, preprocess={"train_on_prompt": True})
    rec = inspect_rows(pre, task, clf_rows(2), per_category=1)
    assert rec["ok"] and rec["collator"]["checked"]
    e = rec["examples"][0]
    assert all(t["loss"] for t in e["tokens"])


def test_inspect_encoder_truncation_point(tiny_bert_dir):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    pre, task = make(tok, arch="encoder", preprocess={"max_seq_len": 10})
    rec = inspect_rows(pre, task, clf_rows(2), per_category=1)
    assert rec["ok"] and not rec["collator"]["checked"]
    for e in rec["examples"]:
        assert e["tokens"][0]["text"] == "[CLS]" and e["tokens"][-1]["text"] == "[SEP]"
        assert e["label_index"] == LABELS.index(e["category"])
        assert e["truncated"] and e["truncation_at"] == 9  # right cut: just before [SEP]
        assert not any(t["loss"] for t in e["tokens"])


def test_html_page_escapes_user_strings(tiny_tok, tmp_path):
    pre, task = make(tiny_tok, "extraction")
    rows = [
        {
            "id": "<img src=x onerror=alert(1)>",
            "text": "<script>alert('x')</script> & more",
            "label": "<b>cat</b>",
            "target": '{"sender": "</span><script>", "subject": "x"}',
        }
    ]
    rec = inspect_rows(pre, task, rows, per_category=1)
    rec.update(inspect_id="inspect-x", study="<study>", split="train", snapshot_id="s")
    page = render_html(Inspection.of(tmp_path / "inspect-x.json", rec))
    assert "<script" not in page and "<img" not in page and "<b>cat" not in page
    assert "&lt;script&gt;" in page and "&lt;img src=x" in page
    assert page.count("class='tokens'") == 1
    # the loss-coloured spans are exactly the target tokens
    n_loss = sum(1 for t in rec["examples"][0]["tokens"] if t["loss"])
    assert page.count('class="t loss') == n_loss
    assert rec["examples"][0]["tokens"][-1]["id"] == tiny_tok.eos_token_id
    assert [t["loss"] for t in rec["examples"][0]["tokens"]][-1]
    assert IGNORE_INDEX not in [t["id"] for t in rec["examples"][0]["tokens"]]


# ---------------------------------------------------------------- the command on a study


def email_rows(n=30):
    rows = []
    for i in range(n):
        label = ["spam", "ham"][i % 2]
        target = f'{{"sender": "user{i}@example.com", "subject": "Meeting {i}"}}'
        rows.append(
            {"text": f"From: user{i}@example.com Subject: Meeting {i} " + "word " * (i % 7 * 9),
             "label": label, "target": target}
        )  # fmt: skip
    return rows


def test_inspect_command_on_a_study(tmp_path, capsys, tiny_llama_dir):
    import json

    from helpers import run_cli

    task = {"kind": "extraction", "instruction": "Extract the fields as a JSON object.",
            "json_schema": {"type": "object", "required": ["sender", "subject"]}}  # fmt: skip
    root = write_study(tmp_path / "s", tiny_llama_dir, email_rows(), task, {"max_seq_len": 160})
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "2")
    assert code == 0, err
    assert "all checks pass" in out and "lengths (tokens)" in out
    # in a pipe the progress board's plain line, with the final figures, on stderr
    assert any(line.startswith("encoding train ") and "(100%)" in line for line in err.splitlines())
    assert "<|im_start|>assistant" in out and "p95" in out
    files = sorted((root / "records" / "inspect").iterdir())
    assert [f.suffix for f in files] == [".html", ".json"]
    rec = json.loads(files[1].read_text())
    assert rec["ok"] and rec["split"] == "train" and rec["sha256"]
    shown = [e["category"] for e in rec["examples"] if e["why_shown"] == "category"]
    assert shown == ["ham", "ham", "spam", "spam"]
    assert rec["stats"]["n"] == sum(s["n"] for s in rec["category_stats"].values())
    html_page = files[0].read_text()
    assert "all checks pass" in html_page and "ham" in html_page

    # JSON output, validation split
    code, out, _ = run_cli(capsys, "inspect", "-s", root, "--split", "validation", "--json")
    assert code == 0 and json.loads(out)["split"] == "validation"
    # the test split stays sealed
    code, _, err = run_cli(capsys, "inspect", "-s", root, "--split", "test")
    assert code == 2 and "sealed" in err

    # a max_seq_len that cuts answers: exit 2, the record is still written, examples named
    before = len(list((root / "records" / "inspect").iterdir()))
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--set", "preprocess.max_seq_len=30")
    assert code == 2
    assert "target_truncated" in err and "example '" in err and "max_seq_len" in err
    assert len(list((root / "records" / "inspect").iterdir())) == before + 2

    # answers measured against the generation budget: all fit in 64 new tokens, not in 8
    assert rec["answer_budget"]["over"] == 0 and "max_new_tokens" not in out
    code, out, err = run_cli(
        capsys, "inspect", "-s", root, "--set", "evaluation.max_new_tokens=8", "--json"
    )
    budget = json.loads(out)["answer_budget"]
    assert code == 0 and budget["max_new_tokens"] == 8
    assert budget["over"] == budget["n"] == rec["stats"]["n"] and budget["longest"] > 8
    code, out, _ = run_cli(capsys, "inspect", "-s", root, "--set", "evaluation.max_new_tokens=8")
    assert "longer than evaluation.max_new_tokens (8)" in " ".join(out.split())


@pytest.mark.slow
def test_inspect_real_bbc_minilm_study_shows_each_category(tmp_path, capsys, minilm_dir, bbc_dir):
    import json
    import shutil

    from helpers import run_cli

    rows = []
    for label in sorted(p.name for p in bbc_dir.iterdir() if p.is_dir()):
        for f in sorted((bbc_dir / label).glob("*.txt"))[:12]:
            rows.append({"text": f.read_text(errors="replace"), "label": label})
    task = {"kind": "classification", "instruction": "Classify the news article by topic."}
    root = write_study(tmp_path / "bbc", minilm_dir, rows, task, {"max_seq_len": 128})
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "1")
    assert code == 0, err
    rec = json.loads(next((root / "records" / "inspect").glob("*.json")).read_text())
    categories = [e["category"] for e in rec["examples"] if e["why_shown"] == "category"]
    assert categories == sorted(p.name for p in bbc_dir.iterdir() if p.is_dir())
    assert len(categories) == 5
    for e in rec["examples"]:
        assert e["tokens"][0]["text"] == "[CLS]" and e["tokens"][-1]["text"] == "[SEP]"
        assert e["truncated"] and e["num_tokens"] == 128  # news articles are long
    assert rec["stats"]["share_truncated"] > 0.9 and rec["stats"]["max"] == 128
    for label in categories:
        assert label in out
    shutil.rmtree(root)
