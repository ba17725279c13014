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

from helpers import register_study, run_cli, write_email_study, write_topic_study
from tunelab.core.config_training import AdaptationConfig
from tunelab.core.errors import ConfigError
from tunelab.core.records import read_json, read_jsonl
from tunelab.core.study import Study
from tunelab.lib.models import adapt, capture_params, check_update, load_model, resolve_model
from tunelab.stages.train import stage as train_stage

pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[2]
QUANT = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bf16"}


pytestmark = pytest.mark.usefixtures("one_thread")


def qlora_study(root: Path, model_dir: Path, quantization: dict, **training) -> Path:
    return write_email_study(
        root,
        model_dir,
        "qlora-test",
        max_steps=training.pop("max_steps", 6),
        eval_every_steps=3,
        checkpoint_every_steps=3,
        adaptation={"method": "qlora", "quantization": quantization},
        **training,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_dir):
    root = qlora_study(tmp_path_factory.mktemp("qlora") / "s", tiny_llama_dir, QUANT)
    study = Study.open(root)
    return study, train_stage.run(study)


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
    from tunelab.core.config import StudyConfig

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


def test_qlora_encoder_keeps_its_new_head_in_full_precision(tmp_path, tiny_bert_dir):
    """bitsandbytes' default skips only an output embedding: an encoder's new classification
    head would load in 4 bits, and training it (modules_to_save) fails at its first forward."""
    root = write_topic_study(
        tmp_path / "s",
        tiny_bert_dir,
        "qlora-bert",
        method="qlora",
        max_steps=2,
        adaptation={"quantization": QUANT},
    )
    study = register_study(root)
    cfg = study.config
    model = load_model(resolve_model(cfg.model), cfg, labels=cfg.task.labels)
    assert type(model.classifier) is torch.nn.Linear
    assert type(model.bert.encoder.layer[0].attention.self.query).__name__ == "Linear4bit"
    run = train_stage.run(study, name="q")
    assert read_json(run.dir / "status.json")["status"] == "completed"


def test_a_forward_leaves_the_frozen_biases_of_4bit_layers_as_loaded(tmp_path, tiny_bert_dir):
    """bitsandbytes casts a 4-bit layer's bias to its input's dtype in place at each forward:
    a trained bias (here random, as MiniLM's) would then read as a frozen tensor that moved."""
    import bitsandbytes as bnb

    base_dir = tmp_path / "bert"
    model = __import__("transformers").AutoModel.from_pretrained(tiny_bert_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()
    model.save_pretrained(base_dir)
    for f in tiny_bert_dir.iterdir():
        if not (base_dir / f.name).exists():
            (base_dir / f.name).write_bytes(f.read_bytes())
    root = write_topic_study(
        tmp_path / "s", base_dir, "qlora-bias", method="qlora", adaptation={"quantization": QUANT}
    )
    cfg = Study.open(root).config
    base = resolve_model(cfg.model)
    model = load_model(base, cfg, labels=cfg.task.labels)
    model, _ = adapt(model, cfg.adaptation, base.architecture)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.bias is not None for m in layers)
    before = capture_params(model)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids).logits.sum().backward()
    moved = [v for v in check_update(before, model, 2, "qlora") if "frozen but changed" in v]
    assert moved == []


def test_update_check_sees_a_changed_4bit_weight(tiny_llama_dir):
    from tunelab.core.config import StudyConfig

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


@pytest.mark.processes
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
    from tunelab.stages.hypothesis.validate import validate_study

    assert validate_study(root).adaptation.method == "qlora"  # here bitsandbytes imports
    with pytest.raises(ConfigError, match="compute_dtype"):
        validate_study(root, ["adaptation.quantization.compute_dtype=int8"])


# ---------------------------------------------------------------- 8-bit AdamW


def test_8bit_adamw_states_in_the_analytic_model():
    from tunelab.stages.sizing.memory import ModelFacts, optimizer_state_bytes

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


@pytest.mark.slow
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


# ---------------------------------------------------------------- sizing: the 4-bit terms


def qlora_config(model_dir: Path, targets, quantization: dict | None = None, **training):
    from tunelab.core.config import StudyConfig

    return StudyConfig.model_validate(
        {
            "name": "q",
            "hypothesis": {"behaviour": "b", "rationale": "r", "expected_effect": "e"}
            | {"primary_metric": "loss"},
            "guardrails": [],
            "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
            "model": {"path": str(model_dir)},
            "adaptation": {
                "method": "qlora",
                "rank": 4,
                "dropout": 0.0,
                "target_modules": targets,
                "quantization": quantization or QUANT,
            },
            "training": training,
        }
    )


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_facts_from_the_model_equal_those_from_its_config(tiny_llama_dir, double_quant):
    """The analytic 4-bit terms (packed weights, absmax and double-quant constants, largest
    layer) of a config.json are what bitsandbytes really holds in the loaded model."""
    import json

    from tunelab.stages.plan.shapes import facts_from_config
    from tunelab.stages.sizing.facts import model_facts

    cfg = qlora_config(tiny_llama_dir, "all-linear", dict(QUANT, double_quant=double_quant))
    base = resolve_model(cfg.model)
    model, _ = adapt(load_model(base, cfg), cfg.adaptation, base.architecture)
    real = model_facts(model, "causal_lm", lora_rank=4)
    assert real.quant_tensors == 14 and real.quant_params == 2 * (
        2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64
    )
    assert real.quant_largest == 32 * 64 and real.quant_compute_dtype == "bfloat16"
    assert real.param_dtype == "float32" and real.weight_bytes["uint8"] == real.quant_params // 2
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert facts_from_config(config, cfg.adaptation, architecture="causal_lm") == real


def test_4bit_estimate_terms(tiny_llama_dir):
    """Weights: packed bytes + constants + the rest in fp32; the dequantized copy of the largest
    layer (fp32 from bitsandbytes, then bf16) is alive in the forward and in each backward."""
    from tunelab.stages.sizing.facts import model_facts
    from tunelab.stages.sizing.memory import Case, dequantized_layer_bytes, estimate_memory

    cfg = qlora_config(tiny_llama_dir, ["q_proj", "v_proj"])
    base = resolve_model(cfg.model)
    model, _ = adapt(load_model(base, cfg), cfg.adaptation, base.architecture)
    facts = model_facts(model, "causal_lm", lora_rank=4)
    est = estimate_memory(facts, Case(seq_len=48, micro_batch=4))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.weights == held + facts.quant_constant_bytes
    assert est.weights_by_dtype["4bit_constants"] == facts.quant_constant_bytes
    assert est.dequantized_layer == dequantized_layer_bytes(facts) == 32 * 64 * (4 + 2)
    assert est.optimizer_states == 2 * facts.trainable_bytes


def _adapted_with_a_batch(cfg):
    """The study's adapted tiny model in train mode, seeded, and a collated batch of 4
    synthetic examples of 48 tokens (half of them scored)."""
    from tunelab.stages.sizing.child_model import synthetic_examples
    from tunelab.stages.train.batches import collate

    base = resolve_model(cfg.model)
    torch.manual_seed(0)
    model, _ = adapt(load_model(base, cfg), cfg.adaptation, base.architecture)
    model.train()
    encoded = synthetic_examples(
        4, 48, "causal_lm", vocab=model.config.vocab_size, loss_fraction=0.5
    )
    return model, collate(encoded, 0, "causal_lm", False)


def _saved_and_predicted(model, data, facts, precision):
    """(the bytes autograd saves in one forward, the activations and kept logits predicted)."""
    from tunelab.stages.sizing.facts import count_saved_bytes
    from tunelab.stages.sizing.memory import Case, estimate_memory, logits_bytes
    from tunelab.stages.train.loop import autocast, loss_sum

    case = Case(seq_len=48, micro_batch=4, precision=precision, loss_fraction=0.5)

    def forward():
        with autocast(precision, torch.device("cpu")):
            return loss_sum(model, data, "causal_lm")

    real = count_saved_bytes(model, forward)
    return real, estimate_memory(facts, case).activations + logits_bytes(facts, case)["kept"]


@pytest.mark.parametrize(
    "targets,precision",
    [(["q_proj", "v_proj"], "fp32"), ("all-linear", "fp32"), ("all-linear", "bf16")],
)
def test_activation_walk_matches_autograd_on_a_4bit_base(tiny_llama_dir, targets, precision):
    """What autograd keeps over 4-bit layers (their packed weight, no activation) is what the
    walk predicts."""
    from tunelab.stages.sizing.facts import model_facts

    cfg = qlora_config(tiny_llama_dir, targets)
    model, data = _adapted_with_a_batch(cfg)
    facts = model_facts(model, "causal_lm", lora_rank=4)
    real, predicted = _saved_and_predicted(model, data, facts, precision)
    assert abs(predicted - real) / real < 0.05, (real, predicted)


@pytest.mark.slow
def test_size_measures_qlora_beside_lora_and_full(tmp_path, tiny_llama_dir, capsys):
    """`tunelab size --methods full,lora` on a QLoRA study: each method measured in its own
    process at the study's configuration and predicted from its own adapted model."""
    import json

    root = qlora_study(tmp_path / "s", tiny_llama_dir, QUANT)
    Study.open(root)
    from helpers import register_study

    register_study(root)
    code, out, err = run_cli(
        capsys, "size", "-s", root, "--seq-len", "48", "--methods", "full,lora,qlora", "--json"
    )
    assert code == 0, err
    record = json.loads(out[out.index("{") :])
    rows = {c["label"]: c for c in record["configurations"]}
    own = rows["config @48"]
    assert own["method"] == "qlora" and "method qlora" not in rows  # the study's own: once
    for label, method in (
        ("config @48", "qlora"),
        ("method lora", "lora"),
        ("method full", "full"),
    ):
        row = rows[label]
        assert row["status"] == "ok", row
        assert row["method"] == method and row["options"]["seq_len"] == 48
        assert row["measured"]["compared"] > 0 and row["error_pct"] is not None
    q, lora, full = (rows[k]["predicted"] for k in ("config @48", "method lora", "method full"))
    assert "4bit_constants" in q["weights_by_dtype"] and q["dequantized_layer"] > 0
    assert q["weights"] < full["weights"] < lora["weights"]  # 4 bits per block weight
    assert full["optimizer_states"] > lora["optimizer_states"] == q["optimizer_states"]
    # each other method gets its own recommendation, proposed when the study's does not fit
    others = {o["method"]: o for o in record["recommendation"]["other_methods"]}
    assert set(others) == {"lora", "full"} and all(o["fits"] for o in others.values())
    assert all(o["predicted_peak_bytes"] > 0 and o["micro_batch"] for o in others.values())
    code, _, err = run_cli(capsys, "size", "-s", root, "--methods", "lora,int4")
    assert code == 2 and "int4" in err


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_activation_walk_with_bf16_weights(tiny_llama_dir, method):
    """Weights kept in bf16 under bf16 autocast (the 7-8B table's setting): no weight copy is
    saved, and peft's lift of x to the fp32 adapter makes each adapter's own bf16 input copy."""
    from tunelab.stages.sizing.facts import model_facts

    cfg = qlora_config(tiny_llama_dir, "all-linear")
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"dtype": "bfloat16"}),
            "adaptation": cfg.adaptation.model_copy(update={"method": method}),
        }
    )
    model, data = _adapted_with_a_batch(cfg)
    facts = model_facts(model, "causal_lm", lora_rank=0 if method == "full" else 4)
    # peft's prepare_model_for_kbit_training lifts a 4-bit model's other weights to fp32
    assert facts.param_dtype == ("float32" if method == "qlora" else "bfloat16")
    if method == "qlora":
        import json

        from tunelab.stages.plan.shapes import facts_from_config

        config = json.loads((tiny_llama_dir / "config.json").read_text())
        mine = facts_from_config(config, cfg.adaptation, architecture="causal_lm", dtype="bfloat16")
        assert mine == facts and facts.quant_dtype == "bfloat16"
    real, predicted = _saved_and_predicted(model, data, facts, "bf16")
    assert abs(predicted - real) / real < 0.05, (real, predicted)
