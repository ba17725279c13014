"""Real models on real data, on CPU, a handful of steps: the validation loss goes down.

- all-MiniLM-L6-v2 + LoRA (query, value) and its new head on a BBC News sample (5 topics)
- SmolLM2-135M-Instruct + LoRA on SpamAssassin emails -> JSON {sender, subject, date, list}
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import run_cli
from tunelab.core.records import read_json, read_jsonl

REPO = Path(__file__).resolve().parents[3]


def prepare(root: Path, capsys) -> None:
    for args in (["register"], ["data"]):
        code, out, err = run_cli(capsys, *args, "-s", root, "--json")
        assert code == 0, (args, out, err)


def train(root: Path, capsys) -> dict:
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "real", "--json")
    assert code == 0, err
    return json.loads(out)


def report(label: str, summary: dict) -> None:
    rows = [r for r in read_jsonl(Path(summary["record"]) / "metrics.jsonl") if "loss" in r]
    print(
        f"\n{label}: {summary['steps']} steps in {summary['train_seconds']:.1f} s "
        f"({summary['steps_per_s']:.3f} steps/s, {summary['tokens_per_s']:.0f} tokens/s), "
        f"val loss {summary['val_loss_initial']:.4f} -> {summary['val_loss']:.4f}, "
        f"train loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, "
        f"peak memory {rows[-1]['memory_bytes'] / 2**30:.2f} GiB"
    )


@pytest.mark.slow
def test_minilm_lora_on_bbc_lowers_validation_loss(tmp_path, minilm_dir, bbc_dir, capsys):
    root = tmp_path / "bbc"
    root.mkdir()
    raw = yaml.safe_load((REPO / "examples" / "classification-bbc" / "study.yaml").read_text())
    raw["model"]["path"] = str(minilm_dir)
    raw["data"]["max_examples"] = 200
    raw["data"]["dedup"]["near"] = False
    raw["preprocess"]["max_seq_len"] = 96
    raw["training"].update(
        micro_batch_size=16,
        grad_accum_steps=1,
        max_steps=12,
        lr=3e-3,
        warmup_steps=2,
        eval_every_steps=12,
        checkpoint_every_steps=6,
    )
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    prepare(root, capsys)
    summary = train(root, capsys)
    report("MiniLM LoRA, BBC", summary)
    assert summary["status"] == "completed"
    assert summary["val_loss"] < summary["val_loss_initial"] - 0.05
    run_dir = Path(summary["record"])
    audit = read_json(run_dir / "audit.json")
    assert audit["method"] == "lora"
    assert (run_dir / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_smollm2_lora_on_spamassassin_extraction_lowers_validation_loss(
    tmp_path, smollm2_dir, capsys
):
    root = tmp_path / "email"
    shutil.copytree(REPO / "examples" / "extraction-email", root)
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["model"].update(path=str(smollm2_dir), gguf_file=None)  # converted once by the fixture
    raw["data"]["max_examples"] = 40
    raw["data"]["dedup"]["near"] = False
    raw["preprocess"]["max_seq_len"] = 256
    raw["training"].update(
        micro_batch_size=4,
        grad_accum_steps=1,
        max_steps=5,
        lr=1e-3,
        warmup_steps=1,
        eval_every_steps=5,
        checkpoint_every_steps=None,
    )
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    prepare(root, capsys)
    summary = train(root, capsys)
    report("SmolLM2 LoRA, SpamAssassin extraction", summary)
    assert summary["status"] == "completed"
    assert summary["val_loss"] < summary["val_loss_initial"]
    config = read_json(Path(summary["record"]) / "config.json")
    assert config["base_model"]["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
