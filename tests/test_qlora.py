"""QLoRA on the tiny Llama on CPU: a 4-bit NF4/FP4 base through bitsandbytes, LoRA on top; the
losses fall, the update check passes over packed frozen weights, the run records the 4-bit
settings, and `tunelab validate` refuses qlora where bitsandbytes cannot be imported."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import run_cli, write_email_study
from tunelab.config import AdaptationConfig
from tunelab.errors import ConfigError
from tunelab.models import adapt, capture_params, check_update, load_model, resolve_model
from tunelab.records import read_json, read_jsonl
from tunelab.study import Study
from tunelab.train import train_run

pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[1]
QUANT = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bf16"}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def qlora_study(root: Path, model_dir: Path, quantization: dict, **training) -> Path:
    root = write_email_study(
        root,
        model_dir,
        "qlora-test",
        max_steps=training.pop("max_steps", 6),
        eval_every_steps=3,
        checkpoint_every_steps=3,
        **training,
    )
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["adaptation"].update(method="qlora", quantization=quantization)
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_dir):
    root = qlora_study(tmp_path_factory.mktemp("qlora") / "s", tiny_llama_dir, QUANT)
    study = Study.open(root)
    return study, train_run(study)


def test_qlora_run_records_the_4bit_base(trained):
    study, run = trained
    status = read_json(run.dir / "status.json")
    assert status["status"] == "completed" and status["update_check"]["violations"] == []
    assert status["val_loss"] < status["val_loss_initial"]
    rec = read_json(run.dir / "config.json")
    assert rec["config"]["adaptation"]["method"] == "qlora"
    assert rec["config"]["adaptation"]["quantization"] == QUANT
    q = rec["base_model"]["quantization"]
    assert {k: q[k] for k in QUANT} == QUANT and q["bits"] == 4
    audit = read_json(run.dir / "audit.json")
    aq = audit["quantization"]
    assert aq["quant_type"] == "nf4" and aq["quantized_tensors"] == 14  # 7 linear x 2 layers
    # two 4-bit weights per stored byte; the audit counts weights, not bytes
    assert aq["quantized_bytes"] * 2 == aq["quantized_params"]
    assert "uint8" in audit["bytes_by_dtype"]
    # LoRA rank 8 on q_proj (32 -> 32) and v_proj (32 -> 16) of 2 layers: A and B of each
    assert audit["totals"]["trainable"] == 2 * (8 * (32 + 32) + 8 * (32 + 16))
    losses = [m["loss"] for m in read_jsonl(run.dir / "metrics.jsonl") if "loss" in m]
    assert losses and all(math.isfinite(x) for x in losses)
    adapter = run.dir / status["final_checkpoint"] / "adapter"
    assert (adapter / "adapter_config.json").is_file()


def test_qlora_losses_fall_on_a_repeated_batch(tiny_llama_dir):
    cfg_dir = tiny_llama_dir
    from tunelab.config import StudyConfig

    raw = {
        "name": "q",
        "hypothesis": {"behaviour": "b", "rationale": "r", "expected_effect": "e"}
        | {"primary_metric": "loss"},
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
        "model": {"path": str(cfg_dir)},
        "adaptation": {"method": "qlora", "rank": 4, "quantization": dict(QUANT, quant_type="fp4")},
    }
    cfg = StudyConfig.model_validate(raw)
    base = resolve_model(cfg.model)
    torch.manual_seed(0)
    model = load_model(base, cfg)
    model, audit = adapt(model, cfg.adaptation, base.architecture)
    assert audit["quantization"]["quant_type"] == "fp4"
    before = capture_params(model, full_copy_limit_bytes=0)  # every tensor fingerprinted
    packed = [n for n, p in model.named_parameters() if getattr(p, "quant_state", None) is not None]
    assert packed and all(n in before.fingerprinted for n in packed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    x = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    model.train()
    losses = []
    for step in range(1, 6):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 2:
            assert check_update(before, model, step, "qlora") == []
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] and losses == sorted(losses, reverse=True)
    # an eval-mode forward leaves the 4-bit weights as loaded (no CPU repacking)
    model.eval()
    with torch.no_grad():
        model(input_ids=x)
    assert check_update(before, model, 5, "qlora") == []


def test_update_check_sees_a_changed_4bit_weight(tiny_llama_dir):
    from tunelab.config import StudyConfig

    cfg = StudyConfig.model_validate(
        {
            "name": "q",
            "hypothesis": {"behaviour": "b", "rationale": "r", "expected_effect": "e"}
            | {"primary_metric": "loss"},
            "guardrails": [],
            "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
            "model": {"path": str(tiny_llama_dir)},
            "adaptation": {"method": "qlora"},
        }
    )
    base = resolve_model(cfg.model)
    model, _ = adapt(load_model(base, cfg), cfg.adaptation, base.architecture)
    before = capture_params(model, full_copy_limit_bytes=0)
    name, p = next(
        (n, p) for n, p in model.named_parameters() if getattr(p, "quant_state", None) is not None
    )
    with torch.no_grad():
        p.data[0] ^= 0x01  # one flipped bit of a packed 4-bit weight
    assert any(
        v.startswith(name + ": frozen but changed") for v in check_update(before, model, 2, "qlora")
    )


def test_quantization_settings_are_validated():
    with pytest.raises(ValueError):
        AdaptationConfig.model_validate({"method": "qlora", "quantization": {"quant_type": "int4"}})
    with pytest.raises(ValueError):
        AdaptationConfig.model_validate({"method": "qlora", "quantization": {"bits": 8}})


def test_validate_accepts_qlora_here_and_warns_quantization_unused(
    tmp_path, tiny_llama_dir, capsys
):
    root = qlora_study(tmp_path / "s", tiny_llama_dir, QUANT)
    code, out, err = run_cli(capsys, "validate", "-s", str(root))
    assert code == 0, err
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["adaptation"]["method"] = "lora"
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    code, out, err = run_cli(capsys, "validate", "-s", str(root))
    assert code == 0 and "adaptation.quantization" in out + err and "only qlora" in out + err


def test_validate_refuses_qlora_without_bitsandbytes(tmp_path, tiny_llama_dir):
    """bitsandbytes made unimportable (a None entry in sys.modules, as for an absent package):
    validate exits 2 naming the extra to install, before any model is loaded."""
    root = qlora_study(tmp_path / "s", tiny_llama_dir, QUANT)
    code = (
        "import sys; sys.modules['bitsandbytes'] = None; "
        "from tunelab.cli import main; sys.exit(main(['validate', '-s', sys.argv[1]]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'tunelab[qlora]'" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    from tunelab.study import validate_study

    assert validate_study(root).adaptation.method == "qlora"  # here bitsandbytes imports
    with pytest.raises(ConfigError, match="compute_dtype"):
        validate_study(root, ["adaptation.quantization.compute_dtype=int8"])


# ---------------------------------------------------------------- 8-bit AdamW


def test_8bit_adamw_states_in_the_analytic_model():
    from tunelab.sizing.memory import ModelFacts, optimizer_state_bytes

    facts = ModelFacts(
        family="llama",
        architecture="causal_lm",
        hidden=4096,
        intermediate=14336,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        trainable_params=1_000_000,
        trainable_bytes=4_000_000,
    )
    full, known = optimizer_state_bytes(facts, "AdamW")
    eight, known8 = optimizer_state_bytes(facts, "AdamW8bit")
    assert known and known8 and full == 8_000_000
    # two 1-byte moments per parameter plus one fp32 absmax per block of 256, per moment
    assert eight == 2 * (1_000_000 + 4 * 3907)
    assert optimizer_state_bytes(facts, "PagedAdamW8bit") == (eight, True)


def start_train(root: Path, name: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    if kill_at:
        env["TUNELAB_TEST_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "tunelab", "train", "-s", str(root), "--name", name, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_qlora_with_adamw8bit_resumes_to_the_uninterrupted_losses(tmp_path, tiny_llama_dir):
    root = qlora_study(tmp_path / "s", tiny_llama_dir, QUANT, optimizer="AdamW8bit")
    straight = start_train(root, "straight")
    assert straight.returncode == 0, straight.stderr
    killed = start_train(root, "killed", kill_at="step:5")
    assert killed.returncode == -9
    study = Study.open(root)
    rows = {r.name: r for r in study.ledger.list_runs()}
    study.reconcile()
    resumed = subprocess.run(
        [sys.executable, "-m", "tunelab", "resume", rows["killed"].id, "-s", str(root), "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src")),
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr

    def losses(run_id: str) -> list:
        rows = read_jsonl(study.runs_dir / run_id / "metrics.jsonl")
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]

    want = losses(rows["straight"].id)
    assert len([r for r in want if r[1] is not None]) == 6
    assert losses(rows["killed"].id) == want  # exact floats
    ckpt = study.runs_dir / rows["killed"].id / "checkpoints" / "step-000003"
    from safetensors.torch import load_file

    states = [k for k in load_file(str(ckpt / "optimizer.safetensors")) if "/state1" in k]
    assert states  # the 8-bit moments are what the checkpoint carries
