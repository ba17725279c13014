"""tunelab export and check-export: a LoRA adapter loads with plain peft and gives the run's
outputs; the manifest binds it to the base by sha256 (one changed byte is refused); an edited
export or manifest is refused; a full fine-tune exports as a whole safetensors model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import TOPIC_LABELS as LABELS
from helpers import run_cli
from helpers.verify import trained_study
from tunelab.stages.export import (
    MANIFEST,
    failure_kinds,
    limitation_lines,
    manifest_sha256,
    regressions,
)
from tunelab.stages.export.card import model_card


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_bert_dir):
    """A LoRA run on the tiny BERT (trained, evaluated against a baseline) and its export."""
    from tunelab.core.study import Study
    from tunelab.stages.export import stage as export_stage

    root, run_id = trained_study(tmp_path_factory.mktemp("export") / "s", tiny_bert_dir)
    out = root.parent / "exported"
    path, manifest = export_stage.run(
        Study.open(root), run_id, out=out, notes=["trained on 24 toy sentences"]
    )
    return root, run_id, path, manifest


def logits_of(model, tokenizer, texts):
    import torch

    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits


# ---------------------------------------------------------------- pure parts


def test_manifest_sha_and_limitations():
    m = {"a": 1, "b": [1, 2]}
    sha = manifest_sha256(m)
    assert manifest_sha256({**m, "manifest_sha256": sha}) == sha
    assert manifest_sha256({**m, "a": 2}) != sha

    comparison = {
        "per_category": {
            "sport": {"f1": {"baseline": 0.8, "variant": 0.7, "delta": -0.1}},
            "tech": {"f1": {"baseline": 0.5, "variant": 0.9, "delta": 0.4}},
        },
        "per_field": {
            "date": {"normalized_match": {"baseline": 1.0, "variant": 0.5, "delta": -0.5}}
        },
    }
    reg = regressions(comparison)
    assert [(r["scope"], r["item"], r["metric"]) for r in reg] == [
        ("category", "sport", "f1"),
        ("field", "date", "normalized_match"),
    ]
    preds = [
        {"gold": "a", "prediction": "b", "correct": False, "verdicts": {}},
        {"gold": "a", "prediction": "b", "correct": False, "verdicts": {}},
        {"gold": None, "prediction": None, "correct": False, "verdicts": {"failure": "not_json"}},
    ]
    fk = failure_kinds(preds)
    assert fk["failures"] == {"not_json": 1} and fk["top_confusions"] == {"a -> b": 2}
    # an extraction's failures are named as the evaluation's failures table names them
    truncated = {"failure": "parse_error", "json_failure": "truncated"}
    ext = [{"gold": {}, "prediction": None, "correct": False, "verdicts": truncated}]
    assert failure_kinds(ext)["failures"] == {"truncated": 1}
    lines = limitation_lines(
        {
            "regressed": reg,
            "failure_kinds": fk,
            "truncation": {"train": {"n": 10, "truncated": 3, "share": 0.3}},
            "test_openings": 2,
            "verify": None,
            "notes": ["mine"],
        }
    )
    text = "\n".join(lines)
    assert "category 'sport': f1 went down" in text and "not_json: 1" in text
    assert "3 of 10 train examples (30.0%)" in text and "opened 2 times" in text
    assert "not verified" in text and "note: mine" in text


# ---------------------------------------------------------------- a LoRA export


def test_export_folder_and_manifest(exported):
    root, run_id, path, m = exported
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    # the adapter at the top: plain `PeftModel.from_pretrained(base, EXPORT)` loads the folder
    assert "adapter_config.json" in names and "adapter_model.safetensors" in names
    assert not [n for n in names if n.startswith("adapter/")]
    assert "tokenizer/tokenizer.json" in names and "README.md" in names and "DONE" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pth"))]
    on_disk = json.loads((path / MANIFEST).read_text())
    assert on_disk == json.loads(json.dumps(m)) and on_disk["manifest_sha256"] == manifest_sha256(m)
    assert m["run_id"] == run_id and m["artifact"]["kind"] == "adapter"
    base = m["base"]
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(base["files"])
    assert all(len(h) == 64 for h in base["files"].values()) and len(base["sha256"]) == 64
    assert m["task"]["labels"] == LABELS and m["data_snapshot"]
    assert m["hypothesis"]["version"] == 1 and len(m["hypothesis"]["sha256"]) == 64
    assert m["environment"]["training"]["torch"] and m["config"]["adaptation"]["method"] == "lora"
    # metrics against the baseline, guardrails and limitations
    assert "macro_f1" in m["results"]["metrics"] and m["results"]["baseline"]["run_id"]
    assert m["guardrails"]["verdicts"] and m["guardrails"]["pass"] in (True, False)
    text = "\n".join(m["limitations"])
    assert "never opened" in text and "note: trained on 24 toy sentences" in text
    assert "truncation" in m["limitations_detail"]
    card = (path / "README.md").read_text()
    assert "PeftModel.from_pretrained" in card and base["sha256"] in card
    assert "## Limitations" in card and "macro_f1" in card
    assert re.search(r"95% interval (above|below|spans) 0 \(significant: (yes|no)\)", card)
    # what a causal LM is sent and what it answers in: the instruction, a format's spec (an
    # encoder reads no instruction)
    assert "Instruction before each input" not in card
    task = {"kind": "format", "instruction": "Date only.", "regex": r"\d{4}"}
    lm = {
        **m,
        "base": {**base, "architecture": "causal_lm"},
        "config": {**m["config"], "task": task},
    }
    lm_card = model_card(lm)
    assert '- Instruction before each input: "Date only."' in lm_card
    assert "- Answer format: the whole answer matches the regex `\\d{4}`" in lm_card
    # the 4-bit settings every config carries are stated for QLoRA only
    assert m["adaptation"]["method"] == "lora" and "quantization" in m["adaptation"]
    assert '"quantization"' not in card and '"rank"' in card
    qlora = {**m, "adaptation": {**m["adaptation"], "method": "qlora"}}
    assert '"quantization"' in model_card(qlora)
    # the adapter names the base, not a folder of the training machine
    adapter_cfg = json.loads((path / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == base["name"]


def test_adapter_loads_with_plain_peft(exported, tiny_bert_dir):
    """No tunelab code on the loading path: transformers + peft give the run's own logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tunelab.core.study import Study
    from tunelab.stages.train import load_run_model

    root, run_id, path, _ = exported
    assert any("classifier" in k for k in load_file(str(path / "adapter_model.safetensors")))
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=3)
    model = PeftModel.from_pretrained(base, str(path)).eval()
    tok = AutoTokenizer.from_pretrained(path / "tokenizer")
    texts = ["Shares fell after the company reported lower profits", "The striker scored"]
    ours, tok_ours, _ = load_run_model(Study.open(root), run_id)
    expected = logits_of(ours, tok_ours, texts)
    got = logits_of(model, tok, texts)
    assert (got - expected).abs().max().item() < 1e-6


def test_check_export_accepts_the_base_and_runs_an_example(exported, tiny_bert_dir, capsys):
    _, _, path, m = exported
    code, out, err = run_cli(capsys, "check-export", path, "--base", tiny_bert_dir, "--json")
    assert code == 0, (out, err)
    res = json.loads(out)
    assert res["base"]["files_checked"] == len(m["base"]["files"])
    assert res["files"]["files_checked"] == len(m["files"])
    ex = res["example"]
    assert ex["matches_recorded"] and ex["output"] in LABELS and ex["scores_max_diff"] < 1e-5


def test_check_export_refuses_a_base_with_one_changed_byte(
    exported, tiny_bert_dir, tmp_path, capsys
):
    _, _, path, _ = exported
    other = tmp_path / "other-base"
    shutil.copytree(tiny_bert_dir, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "check-export", path, "--base", other)
    assert code == 2 and out == ""
    assert "refusing base" in err and "model.safetensors: sha256" in err
    assert "tokenizer.json" not in err  # only the file that differs is named

    # a missing tokenizer file is named too
    shutil.copytree(tiny_bert_dir, tmp_path / "no-tok")
    (tmp_path / "no-tok" / "tokenizer.json").unlink()
    code, _, err = run_cli(capsys, "check-export", path, "--base", tmp_path / "no-tok")
    assert code == 2 and "tokenizer.json: missing" in err


def test_check_export_refuses_an_edited_export(exported, tiny_bert_dir, tmp_path, capsys):
    _, _, path, _ = exported

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(path, dst)
        return dst

    # the manifest edited (its own sha256 no longer agrees)
    edited = copy("manifest")
    m = json.loads((edited / MANIFEST).read_text())
    m["results"] = None
    (edited / MANIFEST).write_text(json.dumps(m))
    code, _, err = run_cli(capsys, "check-export", edited, "--base", tiny_bert_dir)
    assert code == 2 and "edited" in err

    # the adapter changed
    changed = copy("adapter")
    f = changed / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "check-export", changed, "--base", tiny_bert_dir)
    assert code == 2 and "adapter_model.safetensors: sha256" in err

    # a pickle file slipped in
    pickled = copy("pickle")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    code, _, err = run_cli(capsys, "check-export", pickled, "--base", tiny_bert_dir)
    assert code == 2 and "pickle format, refused" in err

    # a manifest (with a recomputed sha) naming a path outside the export
    escape = copy("escape")
    m = json.loads((escape / MANIFEST).read_text())
    m["files"]["../outside.json"] = "0" * 64
    m["manifest_sha256"] = manifest_sha256(m)
    (escape / MANIFEST).write_text(json.dumps(m))
    code, _, err = run_cli(capsys, "check-export", escape, "--base", tiny_bert_dir)
    assert code == 2 and "outside the export" in err


def test_truncation_is_read_from_the_run_and_equals_encoding_again(tmp_path, tiny_bert_dir):
    """The export's truncation counts come from the run's preprocess.json; they equal what
    encoding both splits again with the run's tokenizer, config and snapshot gives."""
    from types import SimpleNamespace

    from helpers import register_study, write_topic_study
    from tunelab.lib.models import resolve_model
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.export.stage import _truncation
    from tunelab.stages.train import stage as train_stage

    root = write_topic_study(
        tmp_path / "s", tiny_bert_dir, "trunc", max_steps=1, preprocess={"max_seq_len": 8}
    )
    study = register_study(root)
    run = study.get_run(train_stage.run(study, name="short").id)
    cfg, snapshot = study.config, load_snapshot(study)
    base = resolve_model(cfg.model, root=study.root)
    recorded = _truncation(study, run, cfg, base, snapshot, LABELS)
    no_record = SimpleNamespace(path=lambda name: tmp_path / "absent" / name)
    encoded = _truncation(study, no_record, cfg, base, snapshot, LABELS)
    assert recorded == encoded
    assert 0 < recorded["train"]["truncated"] <= recorded["train"]["n"] == 24
    assert recorded["validation"]["n"] == 9


def test_export_refusals(exported, capsys):
    root, run_id, path, _ = exported
    code, _, err = run_cli(capsys, "export", run_id, "-s", root, "--out", path)
    assert code == 2 and "already exists" in err
    code, out, _ = run_cli(capsys, "runs", "-s", root, "--kind", "baseline", "--json")
    baseline = json.loads(out)[0]["id"]
    code, _, err = run_cli(capsys, "export", baseline, "-s", root)
    assert code == 2 and "not a training run" in err


# ---------------------------------------------------------------- a full fine-tune


def test_full_model_export_of_a_causal_lm(tmp_path, tiny_llama_dir, capsys):
    root, run_id = trained_study(
        tmp_path / "s",
        tiny_llama_dir,
        method="full",
        max_steps=2,
        model={"architecture": "causal_lm"},
        adaptation={"modules_to_save": []},
        preprocess={"max_seq_len": 96},
    )
    code, out, err = run_cli(capsys, "export", run_id, "-s", root, "--json")
    assert code == 0, (out, err)
    res = json.loads(out)
    path = Path(res["path"])
    assert path.parent == root / "records" / "exports" and (path / "DONE").exists()
    m = res["manifest"]
    assert m["artifact"]["kind"] == "model" and (path / "model.safetensors").exists()
    assert not (path / "adapter_config.json").exists()
    code, out, err = run_cli(capsys, "check-export", path, "--base", tiny_llama_dir, "--json")
    assert code == 0, (out, err)
    ex = json.loads(out)["example"]
    assert ex["matches_recorded"] and ex["output"] in LABELS
    # the exported model alone (no base needed) gives the run's logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunelab.core.study import Study
    from tunelab.stages.train import load_run_model

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path / "tokenizer")
    ours, _, _ = load_run_model(Study.open(root), run_id)
    expected = logits_of(ours, tok, ["The striker scored"])
    assert (logits_of(model, tok, ["The striker scored"]) - expected).abs().max().item() < 1e-6


def test_check_export_reads_the_older_layout(exported, tiny_bert_dir, tmp_path, capsys):
    """An export of format tunelab-export/1 (the adapter in adapter/) is still checked and
    loaded: its manifest's artifact.dir says where the adapter is."""
    _, _, path, _ = exported
    old = tmp_path / "old-layout"
    shutil.copytree(path, old)
    m = json.loads((old / MANIFEST).read_text())
    (old / "adapter").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (old / name).rename(old / "adapter" / name)
        m["files"][f"adapter/{name}"] = m["files"].pop(name)
    m["format"] = "tunelab-export/1"
    m["artifact"]["dir"] = "adapter"
    m["manifest_sha256"] = manifest_sha256(m)
    (old / MANIFEST).write_text(json.dumps(m))
    code, out, err = run_cli(capsys, "check-export", old, "--base", tiny_bert_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["example"]["matches_recorded"]
    m["format"] = "tunelab-export/9"
    m["manifest_sha256"] = manifest_sha256(m)
    (old / MANIFEST).write_text(json.dumps(m))
    code, _, err = run_cli(capsys, "check-export", old, "--base", tiny_bert_dir)
    assert code == 2 and "unknown manifest format 'tunelab-export/9'" in err


def test_export_and_check_export_show_a_long_path_whole_at_80_columns(
    exported, tiny_bert_dir, tmp_path, capsys, monkeypatch
):
    """Both tables name the export folder by its whole path, folded inside its column, at 80
    columns in a pipe (a deep folder is where exports usually live)."""
    root, run_id, _, _ = exported
    deep = tmp_path / "exports-of-the-support-ticket-study" / "lora-rank-16-on-q-and-v-final"
    assert len(str(deep)) > 80
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(capsys, "export", run_id, "-s", root, "--out", deep)
    assert code == 0, err
    assert "…" not in out and str(deep) in table_value(out, "export")
    code, out, err = run_cli(capsys, "check-export", deep, "--base", tiny_bert_dir)
    assert code == 0, err
    assert "…" not in out and str(deep) in table_value(out, "export")
    assert str(tiny_bert_dir) in table_value(out, "base")
    assert all(len(line) <= 80 for line in out.splitlines())


def table_value(out: str, key: str) -> str:
    """The value of a two-column table's row `key`, its folded lines joined."""
    value, inside = [], False
    for line in out.splitlines():
        cells = line.split("│")
        if len(cells) < 3:
            continue
        if cells[1].strip():
            inside = cells[1].strip() == key
        if inside:
            value.append(cells[2].strip())
    return "".join(value)
