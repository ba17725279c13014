"""A QLoRA run on the tiny Llama through the stages after training, on CPU: its smoke, its
verify in a fresh process, its evaluation, its export (the adapter at the top of the folder,
loading with plain peft onto the 4-bit base, bound to the base and its 4-bit settings), and
`--merge` (dequantized, merged, checked against the adapted model; refused beyond tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import TOPIC_LABELS as LABELS
from helpers import run_cli
from helpers.verify import trained_study

pytest.importorskip("bitsandbytes")

QUANT = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bf16"}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_llama_dir):
    """A trained and evaluated QLoRA run (causal-LM classification) beside its baseline."""
    return trained_study(
        tmp_path_factory.mktemp("qlora-export") / "s",
        tiny_llama_dir,
        method="qlora",
        max_steps=3,
        model={"architecture": "causal_lm"},
        adaptation={
            "target_modules": ["q_proj", "v_proj"],
            "modules_to_save": [],
            "quantization": QUANT,
        },
        preprocess={"max_seq_len": 96},
        training={"num_threads": 1},
    )


def logits_of(model, tokenizer, texts):
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float()


def four_bit_base(tiny_llama_dir):
    """The base as a user of plain transformers loads it for the adapter: the recorded settings."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=bnb)


def test_qlora_export_loads_with_plain_peft_onto_the_4bit_base(qlora_run, tiny_llama_dir, capsys):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tunelab.core.study import Study
    from tunelab.lib.models.quantize import keep_weights_as_loaded
    from tunelab.stages.train import load_run_model

    root, run_id = qlora_run
    code, out, err = run_cli(capsys, "export", run_id, "-s", root, "--json")
    assert code == 0, err
    res = json.loads(out)
    path, m = Path(res["path"]), res["manifest"]
    assert (path / "adapter_config.json").is_file() and (
        path / "adapter_model.safetensors"
    ).is_file()
    assert m["artifact"]["kind"] == "adapter" and m["artifact"]["method"] == "qlora"
    assert m["format"] == "tunelab-export/2" and m["merge"] is None
    # bound to the exact base and to the 4-bit settings the run trained with
    q = m["base"]["quantization"]
    assert {k: q[k] for k in QUANT} == QUANT and q["bits"] == 4 and q["bitsandbytes"]
    assert len(m["base"]["sha256"]) == 64 and "model.safetensors" in m["base"]["files"]
    assert any("trained on the base loaded in 4 bits" in line for line in m["limitations"])
    card = (path / "README.md").read_text()
    assert (
        "BitsAndBytesConfig(" in card and 'PeftModel.from_pretrained(base, "THIS_FOLDER")' in card
    )

    # plain peft on the folder itself gives the run's own logits
    base = four_bit_base(tiny_llama_dir)
    keep_weights_as_loaded(base)  # as tunelab evaluates on CPU
    model = PeftModel.from_pretrained(base, str(path)).eval()
    tok = AutoTokenizer.from_pretrained(path / "tokenizer")
    ours, _, _ = load_run_model(Study.open(root), run_id, device="cpu")
    texts = ["The striker scored twice", "Shares fell after the report"]
    assert (logits_of(model, tok, texts) - logits_of(ours, tok, texts)).abs().max().item() == 0.0

    # tunelab's own load of the export and its check
    code, out, err = run_cli(capsys, "check-export", path, "--base", tiny_llama_dir, "--json")
    assert code == 0, err
    ex = json.loads(out)["example"]
    assert ex["matches_recorded"] and ex["output"] in LABELS and ex["scores_max_diff"] < 1e-5


def test_qlora_merge_is_checked_against_the_adapted_model(qlora_run, tiny_llama_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunelab.core.study import Study
    from tunelab.stages.export.merge import MergeTolerance
    from tunelab.stages.train import load_run_model

    root, run_id = qlora_run
    code, out, err = run_cli(capsys, "export", run_id, "-s", root, "--merge", "--json")
    assert code == 0, err
    res = json.loads(out)
    path, m = Path(res["path"]), res["manifest"]
    merge = m["merge"]
    assert m["artifact"] == {
        "kind": "model",
        "dir": ".",
        "method": "qlora",
        "format": "transformers",
        "weights": "safetensors",
        "merged": True,
        "dtype": "bf16",
    }
    assert merge["dequantized_from"]["quant_type"] == "nf4" and merge["within_tolerance"]
    tol = MergeTolerance()
    assert merge["tolerance"]["logits_max_abs_diff"] == tol.logits_max_abs_diff
    assert 0 < merge["logits_max_abs_diff"] <= tol.logits_max_abs_diff  # close, not exact
    assert merge["greedy_agreement"] >= tol.greedy_agreement_min
    assert merge["prediction_agreement"] == 1.0 and merge["examples"] == 8
    assert merge["positions"] > merge["examples"]
    assert any(
        "merged into the dequantized 4-bit base in bf16: not exact" in x for x in m["limitations"]
    )
    assert not (path / "adapter_config.json").exists()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model: no bitsandbytes to load it

    # the merged folder loads with plain transformers, close to the run's 4-bit + adapter model
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in merged.parameters())
    tok = AutoTokenizer.from_pretrained(path / "tokenizer")
    ours, _, _ = load_run_model(Study.open(root), run_id, device="cpu")
    texts = ["The striker scored twice", "Shares fell after the report"]
    diff = (logits_of(merged, tok, texts) - logits_of(ours, tok, texts)).abs().max().item()
    assert 0 < diff <= tol.logits_max_abs_diff
    code, out, err = run_cli(capsys, "check-export", path, "--base", tiny_llama_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["example"]["matches_recorded"]


def test_merge_beyond_its_tolerance_is_refused(qlora_run, capsys):
    root, run_id = qlora_run
    out_dir = root.parent / "too-strict"
    code, out, err = run_cli(
        capsys, "export", run_id, "-s", root, "--merge", "--merge-atol", "0", "--out", out_dir
    )
    assert code == 2 and out == ""
    assert "not close enough" in err and "largest logit difference" in err and "> 0" in err
    assert "without --merge" in err and not out_dir.exists()
    args = ("export", run_id, "-s", root, "--merge", "--merge-dtype", "fp32", "--merge-atol", "0")
    code, _, err = run_cli(capsys, *args, "--out", out_dir)
    assert code == 2 and "fp32 is the closest merge" in err and "try --merge-dtype" not in err
    code, _, err = run_cli(capsys, "export", run_id, "-s", root, "--merge", "--merge-dtype", "int4")
    assert code == 2 and "--merge-dtype 'int4'" in err


# ---------------------------------------------------------------- the other stages on qlora


@pytest.mark.slow
def test_qlora_verify_and_eval(qlora_run):
    from tunelab.core.evidence import find_evaluation
    from tunelab.core.study import Study
    from tunelab.stages.verify import stage as verify_stage

    root, run_id = qlora_run
    study = Study.open(root)
    evaluation = find_evaluation(study, run_id, "validation")
    assert evaluation and evaluation["record"]["n"] == 9
    assert set(evaluation["record"]["metrics"]["per_category"]) == set(LABELS)
    record = verify_stage.run(study, run_id)  # a fresh process loads the 4-bit base + adapter again
    assert record["passed"], record["reason"]
    assert record["predictions"]["matched"] == 9 and record["checkpoint"]["ok"]


@pytest.mark.slow
def test_qlora_smoke(qlora_run):
    from tunelab.core.study import Study
    from tunelab.stages.smoke import stage as smoke_stage

    root, _ = qlora_run
    _, record = smoke_stage.run(Study.open(root), num_train=4, num_steps=2, num_eval=2)
    assert record["passed"], record["reason"]
    assert record["settings"]["method"] == "qlora"
    checks = {c["check"]: c["ok"] for c in record["checks"]}
    assert checks and all(checks.values()), checks
