"""`tunelab env --check`: the study's model, adaptation method, optimizer, precision and
extensions run for real on this machine's backend (model on the meta device, LoRA targets
looked up, a 4-bit layer and an 8-bit optimizer step through bitsandbytes, an autocast matmul,
flash-attn and liger imported and called where present); exit 2 when a needed one fails."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import run_cli, write_email_study
from tunelab.core.study import Study
from tunelab.stages.smoke.backend import backend_checks

BNB = importlib.util.find_spec("bitsandbytes") is not None


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_llama_dir) -> Path:
    return write_email_study(tmp_path_factory.mktemp("env") / "s", tiny_llama_dir, "env",
                             max_steps=2, eval_every_steps=0, checkpoint_every_steps=0)  # fmt: skip


def results(root: Path, **sections: dict) -> dict[str, tuple[str, str, bool]]:
    """{check: (result, detail, needed)} for the study with `sections` merged into study.yaml."""
    raw = yaml.safe_load((root / "study.yaml").read_text())
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    edited = root.parent / f"edited-{len(list(root.parent.iterdir()))}"
    edited.mkdir()
    (edited / "study.yaml").write_text(yaml.safe_dump(raw))
    for p in root.iterdir():  # the model and data paths are relative to the study folder
        if p.name != "study.yaml" and not (edited / p.name).exists():
            (edited / p.name).symlink_to(p)
    return {c.check: (c.result, c.detail, c.needed) for c in backend_checks(Study.open(edited))}


def test_lora_study_passes_here(root, capsys):
    code, out, err = run_cli(capsys, "env", "--check", "-s", root, "--json")
    assert code == 0, err
    got = {c["check"]: c for c in json.loads(out)["checks"]}
    assert got["backend"]["result"] == "PASS" and got["model"]["result"] == "PASS"
    assert "LlamaForCausalLM (causal_lm)" in got["model"]["detail"]
    assert got["adaptation lora"]["result"] == "PASS"
    for ext, module in (("flash-attn", "flash_attn"), ("liger-kernel", "liger_kernel")):
        if importlib.util.find_spec(module) is None:
            assert (got[ext]["result"], got[ext]["needed"]) == ("N-A", False)


def test_failures_name_the_cause(root, capsys):
    got = results(root, adaptation={"target_modules": ["nope_proj"]})
    result, detail, needed = got["adaptation lora"]
    assert (result, needed) == ("FAIL", True) and "q_proj" in detail and "nope_proj" in detail
    (root.parent / "broken").mkdir()
    (root.parent / "broken" / "config.json").write_text('{"model_type": "no-such-model"}')
    got = results(root, model={"path": str(root.parent / "broken")})
    assert got["model"][0] == "FAIL" and got["adaptation lora"][0] == "N-A"
    if not torch.cuda.is_available():
        got = results(root, training={"attention": "flash_varlen", "precision": "bf16"})
        assert got["flash-attn"][0] == "FAIL" and got["flash-attn"][2]
        assert got["precision bf16"][:2] == (
            "PASS",
            "bf16 autocast ran a matmul (training.precision)",
        )


@pytest.mark.skipif(not BNB, reason="bitsandbytes (the qlora extra) is not installed")
def test_bitsandbytes_runs_here(root):
    got = results(root, adaptation={"method": "qlora"}, training={"optimizer": "AdamW8bit"})
    assert got["adaptation qlora"][0] == "PASS", got["adaptation qlora"]
    assert "ran forward and backward here" in got["adaptation qlora"][1]
    stepped = f"bitsandbytes {importlib.metadata.version('bitsandbytes')} stepped"
    assert got["optimizer AdamW8bit"][:2] == ("PASS", stepped)
