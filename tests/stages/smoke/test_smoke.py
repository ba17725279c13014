"""tunelab smoke: 2 real steps, an evaluation pass, a checkpoint, and a fresh-process reload that
must give the same predictions, logits and validation loss; a broken run fails the smoke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import run_cli
from helpers.study import build_study
from helpers.verify import write_study
from tunelab.lib.probes import RATIO_DECODE_STEPS
from tunelab.stages.smoke.stage import SnapshotSample, smoke_overrides

TIMING_KEYS = ("step_s", "eval_s_per_example", "checkpoint_save_s", "reload_s")


def prepare(root: Path, capsys) -> None:
    for args in (["register"], ["data"]):
        code, out, err = run_cli(capsys, *args, "-s", root, "--json")
        assert code == 0, (args, out, err)


def smoke(root: Path, capsys, *extra: str) -> tuple[int, dict, str]:
    code, out, err = run_cli(capsys, "smoke", "-s", root, "--json", *extra)
    return code, json.loads(out) if out.strip() else {}, err


def assert_passed(record: dict, root: Path) -> None:
    assert record["passed"], record["checks"]
    checks = {c["check"]: c for c in record["checks"]}
    for name in (
        "steps ran",
        "loss finite",
        "update check",
        "checkpoint written",
        "eval ran",
        "fresh-process predictions",
        "fresh-process logits",
        "fresh-process val loss",
    ):
        assert checks[name]["ok"] is True, (name, checks[name])
    assert len(record["losses"]) == record["settings"]["num_steps"] == 2
    for key in TIMING_KEYS:
        assert isinstance(record[key], float) and record[key] >= 0, key
    assert record["reload_logits_max_abs_diff"] <= 1e-5
    # the fresh process's parts: the plan takes its start as what is left of it
    parts = record["reload_s"] + record["fresh_eval_s"] + record["fresh_checks_s"]
    assert record["fresh_checks_s"] > 0 and record["fresh_process_s"] > parts
    run_dir = root / "records" / "runs" / record["run_id"]
    on_disk = json.loads((run_dir / "smoke.json").read_text())
    assert on_disk["passed"] and on_disk["step_s"] == record["step_s"]
    assert (run_dir / "predictions-validation.jsonl").exists()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["kind"] == "smoke" and "training.max_steps=2" in config["overrides"]


# ---------------------------------------------------------------- pure parts


def test_overrides_and_sample():
    from tunelab.core.config import validate_config
    from tunelab.stages.hypothesis.template import render_study_yaml

    raw = yaml.safe_load(render_study_yaml("classification", "x"))
    raw["training"]["grad_accum_steps"] = 2
    cfg = validate_config(raw)
    sets = smoke_overrides(cfg, num_train=8, num_steps=2)
    assert "training.micro_batch_size=2" in sets and "training.grad_accum_steps=2" in sets
    assert "training.max_steps=2" in sets and "training.eval_every_steps=2" in sets

    class Snap:
        id, labels, manifest = "snap", ["a", "b"], {}

        def rows(self, split):
            return [{"id": f"{split}{i}"} for i in range(20)]

    sample = SnapshotSample(Snap(), {"train": 8, "validation": 4}, seed=0)
    train = sample.rows("train")
    assert len(train) == 8 and train == sample.rows("train")  # seeded: the same every call
    assert len(sample.rows("validation")) == 4 and len(sample.rows("test")) == 20
    assert SnapshotSample(Snap(), {"train": 8}, seed=1).rows("train") != train


# ---------------------------------------------------------------- tiny models


@pytest.mark.slow
def test_smoke_tiny_bert_lora(tmp_path, tiny_bert_dir, capsys):
    root = write_study(tmp_path / "s", tiny_bert_dir)
    prepare(root, capsys)
    # a --set of a key the smoke sets itself gives way to the smoke's own value
    code, record, err = smoke(root, capsys, "--set", "training.max_steps=50")
    assert code == 0, (record, err)
    assert_passed(record, root)
    assert "2 of 2" in {c["check"]: c for c in record["checks"]}["steps ran"]["detail"]
    assert record["settings"]["architecture"] == "encoder"
    assert record["reload_predictions"]["n"] == 4
    # its examples evaluated again with the LoRA adapter off, then on: the plan's adapted cost
    assert 0 < record["adapter_time_ratio"] < 10
    assert record["adapter_timing"]["unit"] == "evaluation"
    assert record["adapter_timing"]["decode_steps"] is None
    # the table is printed without --json too, and the smoke is listed as a run
    code, out, _ = run_cli(capsys, "runs", "-s", root, "--kind", "smoke", "--json")
    assert [r["id"] for r in json.loads(out)] == [record["run_id"]]


@pytest.mark.slow
def test_smoke_tiny_llama_lora_packed(tmp_path, tiny_llama_dir, capsys):
    root = write_study(
        tmp_path / "s",
        tiny_llama_dir,
        model={"architecture": "causal_lm"},
        adaptation={"target_modules": ["q_proj", "v_proj"], "modules_to_save": []},
        preprocess={"max_seq_len": 96},
    )
    prepare(root, capsys)
    code, record, err = smoke(root, capsys, "--train-examples", "6", "--eval-examples", "3")
    assert code == 0, (record, err)
    assert_passed(record, root)
    assert record["settings"]["architecture"] == "causal_lm"
    assert record["settings"]["num_train"] == 6 and record["reload_predictions"]["n"] == 3
    assert 0 < record["adapter_time_ratio"] < 10


@pytest.mark.slow
def test_smoke_times_a_generating_adapter_per_decoding_step(tmp_path, tiny_llama_dir, capsys):
    """An extraction study: the adapter's cost is timed per decoding step, on passes of at most
    RATIO_DECODE_STEPS new tokens (the study's budget is 64, which the random model fills)."""
    from helpers.sizing import write_study as write_extraction_study

    root = write_extraction_study(tmp_path / "x", tiny_llama_dir)
    code, out, err = run_cli(capsys, "smoke", "-s", root, "--eval-examples", "3")
    assert code == 0, (out, err)
    assert "unmerged adapter" in out and "per decoding step" in out
    assert "Parameters (lora)" in out and "lora_A" in out  # the audit, rendered by the CLI
    path = next((root / "records" / "runs").glob("smoke-*/smoke.json"))
    record = json.loads(path.read_text())
    how = record["adapter_timing"]
    assert how["unit"] == "decoding step"
    assert how["decode_steps"] == RATIO_DECODE_STEPS - 1  # the prefill gives the first token
    assert 3 <= how["pairs"] <= 5
    assert how["on_s"] > 0 and how["off_s"] > 0
    # the fastest pass with the adapter over the fastest without it (the ratio has 3 decimals)
    assert abs(record["adapter_time_ratio"] - how["on_s"] / how["off_s"]) <= 6e-4


def test_smoke_fails_on_a_diverging_run(tmp_path, tiny_bert_dir, capsys):
    root = write_study(tmp_path / "s", tiny_bert_dir, method="full")
    prepare(root, capsys)
    code, record, err = smoke(root, capsys, "--set", "training.lr=1e30")
    assert code == 1, (record, err)
    assert not record["passed"] and "non-finite" in record["reason"]
    checks = {c["check"]: c for c in record["checks"]}
    assert checks["steps ran"]["ok"] is False
    run_dir = root / "records" / "runs" / record["run_id"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "invalid"
    assert json.loads((run_dir / "smoke.json").read_text())["passed"] is False
    assert "error:" in err and "smoke" in err


# ---------------------------------------------------------------- real models


@pytest.mark.slow
def test_smoke_real_minilm_bbc(tmp_path, minilm_dir, bbc_dir, capsys):
    """The BBC example study on all-MiniLM-L6-v2, a 150-article sample of the corpus."""
    root = build_study(
        tmp_path / "bbc",
        example="classification-bbc",
        model_dir=minilm_dir,
        set={"data.source.path": str(bbc_dir), "data.max_examples": 150, "data.dedup.near": False},
    )
    prepare(root, capsys)
    code, record, err = smoke(root, capsys)
    assert code == 0, (record, err)
    assert_passed(record, root)
    print(
        "\nMiniLM smoke:",
        {k: record[k] for k in (*TIMING_KEYS, "first_step_s", "fresh_process_s", "total_s")},
    )


@pytest.mark.slow
def test_smoke_real_smollm2_lora(tmp_path, smollm2_dir, capsys):
    """SmolLM2-135M (converted once from its GGUF) with LoRA on the format example, on CPU."""
    small = {"data.max_examples": 60, "data.dedup.near": False, "preprocess.max_seq_len": 192}
    root = build_study(
        tmp_path / "spam",
        example="format-spam",
        copy_example=True,
        model_dir=smollm2_dir,
        set={"model.gguf_file": None, "evaluation.max_new_tokens": 16, **small},
    )
    prepare(root, capsys)
    code, record, err = smoke(root, capsys, "--train-examples", "4", "--eval-examples", "2")
    assert code == 0, (record, err)
    assert_passed(record, root)
    print(
        "\nSmolLM2 smoke:",
        {k: record[k] for k in (*TIMING_KEYS, "first_step_s", "fresh_process_s", "total_s")},
    )
