"""Base model identity, GGUF conversion, loading, full / LoRA / freeze adaptation, audit, update check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import MINIMAL_HYPOTHESIS
from tunelab.core.config import validate_config
from tunelab.core.config_training import AdaptationConfig, ModelConfig
from tunelab.core.errors import CheckpointError, ModelError
from tunelab.lib.models import (
    adapt,
    capture_params,
    check_update,
    compare_fresh_reload,
    detect_architecture,
    enable_activation_checkpointing,
    load_model,
    load_tokenizer,
    load_trainable,
    model_identity,
    param_group,
    resolve_base,
    resolve_model,
    save_trainable,
    saved_method,
    verify_identity,
)

LABELS = ["business", "sport", "tech"]


def make_cfg(model_path: Path, **adaptation):
    raw = {
        "name": "t",
        "hypothesis": MINIMAL_HYPOTHESIS,
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "d.jsonl"}},
        "model": {"path": str(model_path)},
        "adaptation": adaptation or {"method": "full"},
    }
    return validate_config(raw)


def loaded(path: Path, **adaptation):
    cfg = make_cfg(path, **adaptation)
    base = resolve_model(cfg.model)
    labels = LABELS if base.architecture == "encoder" else None
    model = load_model(base, cfg, labels)
    model, audit = adapt(model, cfg.adaptation, base.architecture)
    return cfg, base, model, audit


def batch_for(base, n: int = 4, seq: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = base.config["vocab_size"]
    ids = torch.randint(5, vocab, (n, seq), generator=g)
    if base.architecture == "encoder":
        return {"input_ids": ids, "labels": torch.arange(n) % len(LABELS)}
    return {"input_ids": ids, "labels": ids.clone()}


def train_steps(model, base, num_steps: int, before=None, method=None, lr=1e-2):
    """AdamW over the parameters with requires_grad; returns violations per step."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0
    )
    before = before if before is not None else capture_params(model)
    results = []
    model.train()
    for step in range(1, num_steps + 1):
        loss = model(**batch_for(base, seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        results.append(check_update(before, model, step, method or model.tunelab_method))
    return results


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- identity


def test_identity_hashes_weights_tokenizer_and_config(tiny_llama_dir, tmp_path):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    ident = model_identity(folder, name="tiny", revision="abc")
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(
        ident["files"]
    )
    assert all(len(h) == 64 for h in ident["files"].values())
    assert ident["name"] == "tiny" and ident["revision"] == "abc"
    assert ident["trust_remote_code"] is False

    moved = shutil.copytree(folder, tmp_path / "elsewhere")
    assert model_identity(moved)["sha256"] == ident["sha256"], "location is not identity"
    verify_identity(ident, moved)

    tok = moved / "tokenizer.json"
    tok.write_text(tok.read_text().replace("im_end", "im_fin", 1))
    (moved / "extra.safetensors").write_bytes(b"0")
    with pytest.raises(ModelError) as err:
        verify_identity(ident, moved)
    assert "tokenizer.json" in str(err.value) and "extra.safetensors" in str(err.value)
    assert model_identity(moved)["sha256"] != ident["sha256"]

    snapshot = shutil.copytree(folder, tmp_path / "hub" / "snapshots" / "0123abc")
    assert model_identity(snapshot)["revision"] == "0123abc"

    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json: missing"):
        verify_identity(ident, folder)


def test_trust_remote_code_recorded_and_required(tiny_llama_dir, tmp_path):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    on = model_identity(folder, trust_remote_code=True)
    assert on["trust_remote_code"] and on["sha256"] != model_identity(folder)["sha256"]
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="trust_remote_code"):
        resolve_model(ModelConfig(path=str(folder)))
    base = resolve_model(ModelConfig(path=str(folder), trust_remote_code=True))
    assert base.identity["trust_remote_code"] is True


def test_detect_architecture():
    assert detect_architecture({"architectures": ["BertModel"], "model_type": "bert"}) == "encoder"
    assert detect_architecture({"model_type": "distilbert"}) == "encoder"
    assert detect_architecture({"architectures": ["LlamaForCausalLM"]}) == "causal_lm"
    assert detect_architecture({"architectures": ["GPT2LMHeadModel"]}) == "causal_lm"
    with pytest.raises(ModelError, match="model.architecture"):
        detect_architecture({"model_type": "whisper"})


def test_resolve_errors(tmp_path, tiny_bert_dir):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(ModelConfig(path=str(tmp_path / "nope")))
    (tmp_path / "w.gguf").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(ModelConfig(path=str(tmp_path / "w.gguf")))
    with pytest.raises(ModelError, match="not found"):
        resolve_model(ModelConfig(path=str(tmp_path), gguf_file="missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no weight file"):
        (tmp_path / "empty" / "config.json").write_text('{"model_type": "bert"}')
        resolve_model(ModelConfig(path=str(tmp_path / "empty")))
    base = resolve_model(ModelConfig(path=str(tiny_bert_dir)))
    with pytest.raises(ModelError, match="label set"):
        load_model(base, make_cfg(tiny_bert_dir), None)


def test_resolve_base_from_study(tmp_path, tiny_bert_dir):
    from tunelab.core.study import Study

    cfg = make_cfg(tiny_bert_dir).to_dict()
    shutil.copytree(tiny_bert_dir, tmp_path / "study" / "base")
    cfg["model"] = {"path": "base", "name": "tiny-bert"}
    import yaml

    (tmp_path / "study" / "study.yaml").write_text(yaml.safe_dump(cfg))
    base = resolve_base(Study.open(tmp_path / "study"))
    assert base.path == (tmp_path / "study" / "base").resolve()
    assert base.architecture == "encoder"
    assert base.identity["name"] == "tiny-bert" and base.identity["revision"] is None
    assert base.identity["architecture"] == "encoder"
    tok = load_tokenizer(base)
    assert tok.pad_token == "[PAD]"


# ---------------------------------------------------------------- GGUF conversion


def _permute(w, n_head: int):
    # llama.cpp's q/k layout, which transformers reverses on load
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(src: Path, out: Path) -> Path:
    """The tiny Llama written as an F32 GGUF file (llama architecture, gpt2 tokenizer)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    sd = {k: v.numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    specials = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [""] * cfg["vocab_size"]
    for t, i in {**tok["model"]["vocab"]}.items():
        tokens[i] = t
    for i, t in specials.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        blocks = {
            "attn_q": _permute(sd[p + "self_attn.q_proj.weight"], nh),
            "attn_k": _permute(sd[p + "self_attn.k_proj.weight"], nkv),
            "attn_v": sd[p + "self_attn.v_proj.weight"],
            "attn_output": sd[p + "self_attn.o_proj.weight"],
            "ffn_gate": sd[p + "mlp.gate_proj.weight"],
            "ffn_up": sd[p + "mlp.up_proj.weight"],
            "ffn_down": sd[p + "mlp.down_proj.weight"],
            "attn_norm": sd[p + "input_layernorm.weight"],
            "ffn_norm": sd[p + "post_attention_layernorm.weight"],
        }
        for k, v in blocks.items():
            w.add_tensor(f"blk.{i}.{k}.weight", np.ascontiguousarray(v))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(tiny_llama_dir, folder / "tiny.Q0.gguf")


def test_gguf_converts_to_the_same_model(tiny_gguf, tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg(tiny_gguf.parent, method="lora", target_modules=["q_proj"])
    cfg.model.gguf_file = tiny_gguf.name
    base = resolve_model(cfg.model)
    assert base.path.parent == tmp_path / "cache" / "gguf"
    assert base.architecture == "causal_lm"
    assert base.identity["source"]["gguf_sha256"] == base.path.name
    assert base.identity["name"] == "tiny.Q0"
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(base.identity["files"])

    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    converted = load_model(base, cfg)
    text = 'The quick brown fox <|im_end|> {"sender": "a@b.c"}'
    ids = load_tokenizer(base)(text, return_tensors="pt").input_ids
    assert (
        ids[0].tolist()
        == load_tokenizer(resolve_model(ModelConfig(path=str(tiny_llama_dir))))(text).input_ids
    )
    with torch.no_grad():
        assert torch.equal(original(ids).logits, converted(ids).logits)

    # Deterministic: a second conversion into another cache is byte-identical.
    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache2"))
    again = resolve_model(cfg.model)
    assert again.path != base.path and again.identity["sha256"] == base.identity["sha256"]


def test_check_export_base_may_be_the_folder_holding_the_gguf(tiny_gguf, tmp_path, monkeypatch):
    from tunelab.core.errors import ExportError
    from tunelab.stages.export.check import check_base, resolve_base_arg

    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg(tiny_gguf.parent, method="lora", target_modules=["q_proj"])
    cfg.model.gguf_file = tiny_gguf.name
    base = resolve_model(cfg.model)
    manifest = {"base": base.identity}
    resolved = resolve_base_arg(tiny_gguf.parent, manifest)
    assert resolved == base.path
    assert check_base(resolved, manifest)["files_checked"] == len(base.identity["files"])

    other = tmp_path / "other"
    other.mkdir()
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0x01
    (other / tiny_gguf.name).write_bytes(bytes(data))
    with pytest.raises(ExportError, match=rf"{tiny_gguf.name} has sha256"):
        resolve_base_arg(other, manifest)


def test_gguf_cache_is_reused_and_survives_kills_and_races(tiny_gguf, tmp_path, monkeypatch):
    import threading

    from tunelab.lib.models import convert_gguf
    from tunelab.lib.models.gguf import CONVERSION_FILE, gguf_sha256

    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    digest = gguf_sha256(tiny_gguf)
    gguf_dir = tmp_path / "cache" / "gguf"
    # A killed conversion left a temporary folder and an older writer half a final folder.
    (gguf_dir / f".{digest}.tmp-dead").mkdir(parents=True)
    (gguf_dir / f".{digest}.tmp-dead" / "model.safetensors").write_bytes(b"half")
    (gguf_dir / digest).mkdir()
    (gguf_dir / digest / "config.json").write_text("{")

    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(convert_gguf(tiny_gguf.parent, tiny_gguf.name))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [gguf_dir / digest] * 2
    assert sorted(p.name for p in gguf_dir.iterdir()) == [f".{digest}.lock", digest]
    done = gguf_dir / digest / CONVERSION_FILE
    stamp = done.stat().st_mtime_ns
    assert convert_gguf(tiny_gguf.parent, tiny_gguf.name) == gguf_dir / digest
    assert done.stat().st_mtime_ns == stamp, "the cached folder is reused, not rewritten"
    assert json.loads(done.read_text())["gguf_sha256"] == digest
    index = list((tmp_path / "cache" / "gguf-hashes").iterdir())
    assert len(index) == 1 and json.loads(index[0].read_text())["sha256"] == digest


def test_gguf_unreadable_file_is_a_model_error(tmp_path, monkeypatch):
    from tunelab.lib.models import convert_gguf

    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ModelError, match="cannot read GGUF"):
        convert_gguf(tmp_path, "bad.gguf")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------- adaptation and audit


def test_param_groups():
    assert param_group("bert.embeddings.word_embeddings.weight") == "embeddings"
    assert param_group("bert.encoder.layer.0.attention.self.query.weight") == "attention"
    assert param_group("bert.encoder.layer.0.attention.output.LayerNorm.weight") == "norm"
    assert param_group("bert.encoder.layer.0.output.dense.weight") == "mlp"
    assert param_group("model.layers.3.mlp.down_proj.weight") == "mlp"
    assert param_group("model.norm.weight") == "norm"
    assert param_group("base_model.model.classifier.modules_to_save.default.bias") == "head"
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert param_group(name) == "lora_A"


def test_full_counts_everything(tiny_bert_dir):
    _, _, model, audit = loaded(tiny_bert_dir, method="full")
    total = param_count(model)
    assert audit["totals"]["trainable"] == total and audit["totals"]["frozen"] == 0
    assert audit["saves"] == "model" and audit["saved_params"] == total
    assert sum(g["trainable"] for g in audit["groups"].values()) == total
    assert audit["groups"]["head"]["trainable"] == 32 * 3 + 3
    assert audit["bytes_by_dtype"]["float32"]["trainable"] == 4 * total
    assert audit["newly_initialized"] == ["classifier.bias", "classifier.weight"]


def test_lora_encoder_adds_head_and_counts(tiny_bert_dir):
    _, _, model, audit = loaded(
        tiny_bert_dir, method="lora", target_modules=["query", "value"], rank=4
    )
    # 2 layers x (query, value) x r (in + out) = 2 * 2 * 4 * (32 + 32)
    assert audit["groups"]["lora_A"]["trainable"] + audit["groups"]["lora_B"]["trainable"] == 1024
    assert audit["groups"]["head"] == {"trainable": 99, "frozen": 99, "tensors_trainable": 2}
    assert audit["totals"]["trainable"] == 1024 + 99
    assert audit["modules_to_save"] == ["classifier"]
    assert audit["modules_to_save_added"] == ["classifier"]
    assert any("classifier" in n for n in audit["notes"])
    assert audit["adapted_modules"] == [
        f"bert.encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")
    ]
    assert audit["adapted_summary"] == "query x2, value x2"
    assert audit["saves"] == "adapter" and audit["saved_params"] == 1123
    assert audit["groups"]["embeddings"]["trainable"] == 0


def test_lora_all_linear_causal_excludes_lm_head(tiny_llama_dir):
    _, _, model, audit = loaded(tiny_llama_dir, method="lora", target_modules="all-linear")
    assert len(audit["adapted_modules"]) == 2 * 7
    assert not any("lm_head" in n for n in audit["adapted_modules"])
    assert audit["modules_to_save"] == [] and audit["notes"] == []


def test_lora_unknown_target_lists_available(tiny_llama_dir):
    cfg = make_cfg(tiny_llama_dir, method="lora", target_modules=["q_proj", "query"])
    base = resolve_model(cfg.model)
    model = load_model(base, cfg)
    with pytest.raises(ModelError, match=r"\['query'\]") as err:
        adapt(model, cfg.adaptation, base.architecture)
    assert "q_proj" in err.value.hint and "gate_proj" in err.value.hint
    bad_save = AdaptationConfig(method="lora", modules_to_save=["classifyer"])
    with pytest.raises(ModelError, match="classifyer"):
        adapt(load_model(base, cfg), bad_save, base.architecture)


def test_freeze_trains_only_named(tiny_bert_dir):
    _, _, model, audit = loaded(
        tiny_bert_dir, method="freeze", trainable=["layer.1.", "classifier"]
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("layer.1." in n or "classifier" in n for n in trainable)
    assert audit["totals"]["trainable"] == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    assert audit["saves"] == "trainable" and audit["notes"] == []
    assert "classifier" in audit["adapted_modules"]

    _, _, _, audit2 = loaded(tiny_bert_dir, method="freeze", trainable=["layer.1."], rank=4)
    assert any("random" in n for n in audit2["notes"]), "a frozen new head is flagged"
    assert "ignored for method freeze: adaptation.rank" in audit2["notes"]

    cfg = make_cfg(tiny_bert_dir, method="freeze", trainable=["decoder"])
    base = resolve_model(cfg.model)
    with pytest.raises(ModelError, match="decoder"):
        adapt(load_model(base, cfg, LABELS), cfg.adaptation, base.architecture)


def test_audit_table_renders(tiny_bert_dir):
    from rich.console import Console

    from tunelab.cli.smoke import audit_table
    from tunelab.core.run_parts import ParameterAudit

    _, _, _, audit = loaded(tiny_bert_dir, method="lora", target_modules=["query"])
    console = Console(width=120, record=True)
    console.print(audit_table(ParameterAudit.of("audit.json", audit)))  # as smoke reads it
    text = console.export_text()
    for fragment in ("lora_A", "head", "total", "adapter", "query x2", "classifier"):
        assert fragment in text, fragment
    json.dumps(audit)  # the audit goes into run records as JSON


def test_head_init_is_seeded(tiny_bert_dir, tmp_path):
    cfg = make_cfg(tiny_bert_dir)
    base = resolve_model(cfg.model)
    a, b = load_model(base, cfg, LABELS), load_model(base, cfg, LABELS)
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    assert a.config.id2label == dict(enumerate(LABELS))
    # A checkpoint whose head has another label set gets a new head, reported as new.
    a.save_pretrained(tmp_path / "clf")
    load_tokenizer(base).save_pretrained(tmp_path / "clf")
    cfg2 = make_cfg(tmp_path / "clf")
    five = load_model(resolve_model(cfg2.model), cfg2, LABELS + ["x", "y"])
    assert five.classifier.weight.shape[0] == 5
    assert five.tunelab_new_params == ["classifier.bias", "classifier.weight"]
    same = load_model(resolve_model(cfg2.model), cfg2, LABELS)
    assert same.tunelab_new_params == [] and torch.equal(
        same.classifier.weight, a.classifier.weight
    )


# ---------------------------------------------------------------- update check


@pytest.mark.parametrize(
    ("path_fixture", "adaptation"),
    [
        ("tiny_bert_dir", {"method": "full"}),
        ("tiny_bert_dir", {"method": "lora", "target_modules": ["query", "value"]}),
        ("tiny_llama_dir", {"method": "lora", "target_modules": "all-linear"}),
        ("tiny_llama_dir", {"method": "freeze", "trainable": ["layers.1.", "norm"]}),
    ],
)
def test_update_check_passes_on_correct_training(request, path_fixture, adaptation):
    _, base, model, _ = loaded(request.getfixturevalue(path_fixture), **adaptation)
    assert train_steps(model, base, 2) == [[], []]


def test_lora_a_may_not_move_before_step_two(tiny_llama_dir):
    _, base, model, _ = loaded(tiny_llama_dir, method="lora", target_modules=["q_proj"])
    before = capture_params(model)
    train_steps(model, base, 1, before=before)
    a_names = [n for n in before.trainable if ".lora_A." in n]
    params = dict(model.named_parameters())
    assert a_names and all(torch.equal(before[n], params[n]) for n in a_names), "A waits a step"
    # The same state judged as step 2 (or as full fine-tuning) is a violation.
    late = check_update(before, model, 2, "lora")
    assert sorted(v.split(":")[0] for v in late) == sorted(a_names)


def test_update_check_catches_module_frozen_by_mistake(tiny_llama_dir):
    _, base, model, _ = loaded(tiny_llama_dir, method="lora", target_modules=["q_proj", "v_proj"])
    mistaken = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    dict(model.named_parameters())[mistaken].requires_grad_(False)  # before the optimizer
    step1, step2 = train_steps(model, base, 2)
    assert step1 == [f"{mistaken}: meant to train but requires_grad is False"]
    partner = mistaken.replace("lora_B", "lora_A")
    assert f"{partner}: received a gradient but unchanged after 2 step(s)" in step2


def test_update_check_without_adapt_record_still_catches(tiny_llama_dir):
    # A model never passed through adapt: the trainable set comes from requires_grad, and the
    # LoRA A whose B was frozen never moves.
    _, base, model, _ = loaded(tiny_llama_dir, method="lora", target_modules=["q_proj"])
    del model.tunelab_expected_trainable
    mistaken = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    dict(model.named_parameters())[mistaken].requires_grad_(False)
    _, step2 = train_steps(model, base, 2, method="lora")
    assert step2 == [
        f"{mistaken.replace('lora_B', 'lora_A')}: received a gradient but unchanged after 2 step(s)"
    ]


@pytest.mark.parametrize("full_copy_limit_bytes", [1 << 30, 0])
def test_update_check_catches_mutated_frozen_tensor(tiny_bert_dir, full_copy_limit_bytes):
    _, base, model, _ = loaded(tiny_bert_dir, method="lora", target_modules=["query"])
    before = capture_params(model, full_copy_limit_bytes=full_copy_limit_bytes)
    assert bool(before.fingerprinted) == (full_copy_limit_bytes == 0)
    assert bool(before.fingerprinted & before.trainable) == (full_copy_limit_bytes == 0)
    assert train_steps(model, base, 2, before=before) == [[], []]
    frozen = "base_model.model.bert.encoder.layer.1.output.dense.weight"
    with torch.no_grad():
        dict(model.named_parameters())[frozen][3, 5] += 1e-3
    assert check_update(before, model, 2, "lora") == [
        f"{frozen}: frozen but changed after 2 step(s)"
    ]


def test_fingerprint_sees_one_bit_anywhere():
    from tunelab.lib.models.update import fingerprint

    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(1_000, 1_003, generator=torch.Generator().manual_seed(0)).to(dtype)
        before = fingerprint(t)
        assert torch.equal(fingerprint(t.clone()), before)
        t[777, 77] = -t[777, 77]  # the sign bit of one element
        assert not torch.equal(fingerprint(t), before)


def test_update_check_catches_parameter_left_out_of_optimizer(tiny_bert_dir):
    _, base, model, _ = loaded(tiny_bert_dir, method="full")
    before = capture_params(model)
    params = dict(model.named_parameters())
    left_out = "bert.encoder.layer.0.intermediate.dense.bias"
    opt = torch.optim.AdamW([p for n, p in params.items() if n != left_out], lr=1e-2)
    model(**batch_for(base)).loss.backward()
    opt.step()
    assert check_update(before, model, 1, "full") == [
        f"{left_out}: received a gradient but unchanged after 1 step(s)"
    ]


# ---------------------------------------------------------------- checkpointing helpers


@pytest.mark.parametrize(
    ("path_fixture", "adaptation", "files"),
    [
        ("tiny_bert_dir", {"method": "lora", "target_modules": ["query"]}, "adapter_model"),
        ("tiny_llama_dir", {"method": "full"}, "model.safetensors"),
        ("tiny_llama_dir", {"method": "freeze", "trainable": ["layers.0.mlp"]}, "trainable"),
    ],
)
def test_save_and_load_trainable_round_trip(request, tmp_path, path_fixture, adaptation, files):
    cfg, base, model, _ = loaded(request.getfixturevalue(path_fixture), **adaptation)
    train_steps(model, base, 2)
    out = save_trainable(model, tmp_path / "ckpt", adaptation["method"])
    assert any(p.name.startswith(files) for p in out.iterdir())
    assert saved_method(out) == adaptation["method"]
    labels = LABELS if base.architecture == "encoder" else None
    fresh = load_trainable(load_model(base, cfg, labels), out)
    batch = batch_for(base, seed=9)
    batch.pop("labels")
    model.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, fresh(**batch).logits)
    # Resume path: load into a freshly adapted model.
    _, _, again, _ = loaded(request.getfixturevalue(path_fixture), **adaptation)
    again = load_trainable(again, out)
    again.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)
    if adaptation["method"] == "full":
        n_saved = len(list(out.glob("*.safetensors")))
        assert n_saved == 1


def test_load_trainable_refuses_other_model(tiny_llama_dir, tiny_bert_dir, tmp_path):
    _, _, model, _ = loaded(tiny_llama_dir, method="freeze", trainable=["layers.0.mlp"])
    out = save_trainable(model, tmp_path / "ckpt")
    cfg = make_cfg(tiny_bert_dir)
    bert = load_model(resolve_model(cfg.model), cfg, LABELS)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_trainable(bert, out)
    with pytest.raises(CheckpointError):
        load_trainable(bert, tmp_path)


@pytest.mark.slow
def test_fresh_process_reload_matches(tiny_bert_dir, tmp_path):
    cfg, base, model, _ = loaded(tiny_bert_dir, method="lora", target_modules=["query", "value"])
    train_steps(model, base, 2)
    out = save_trainable(model, tmp_path / "adapter")
    batch = {"input_ids": batch_for(base)["input_ids"]}
    result = compare_fresh_reload(model, cfg, base, out, "lora", batch, labels=LABELS)
    assert result["ok"] and result["max_abs_diff"] <= 1e-5, result


@pytest.mark.slow
def test_fresh_process_reload_sees_a_damaged_adapter(tiny_bert_dir, tmp_path):
    cfg, base, model, _ = loaded(tiny_bert_dir, method="lora", target_modules=["query", "value"])
    train_steps(model, base, 2)
    out = save_trainable(model, tmp_path / "adapter")
    batch = {"input_ids": batch_for(base)["input_ids"]}
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    key = next(k for k in tensors if "classifier" in k and k.endswith("weight"))
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    bad = compare_fresh_reload(model, cfg, base, out, "lora", batch, labels=LABELS)
    assert not bad["ok"] and bad["max_abs_diff"] > 1e-3


def test_activation_checkpointing_keeps_adapter_grads(tiny_llama_dir):
    _, base, model, _ = loaded(tiny_llama_dir, method="lora", target_modules=["q_proj", "v_proj"])
    enable_activation_checkpointing(model)
    inner = model.get_base_model()
    assert inner.is_activation_checkpointing and inner.config.use_cache is False
    model.train()
    with torch.no_grad():  # give B a value so that A gets a gradient too
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.02)
    model(**batch_for(base)).loss.backward()
    lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert len(lora) == 8
    for n, p in lora.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


# ---------------------------------------------------------------- real models (slow)


@pytest.mark.slow
def test_minilm_lora_query_value_step(minilm_dir):
    cfg, base, model, audit = loaded(
        minilm_dir, method="lora", target_modules=["query", "value"], rank=8, alpha=16
    )
    assert base.architecture == "encoder"
    assert {"model.safetensors", "tokenizer.json", "vocab.txt"} <= set(base.identity["files"])
    lora = audit["groups"]["lora_A"]["trainable"] + audit["groups"]["lora_B"]["trainable"]
    assert lora == 6 * 2 * 8 * (384 + 384)  # 73,728
    assert audit["groups"]["head"]["trainable"] == 384 * 3 + 3
    assert audit["modules_to_save"] == ["classifier"]
    base_params = audit["totals"]["frozen"] - (384 * 3 + 3)  # minus the frozen head original
    assert 22_000_000 < base_params < 23_000_000
    tok = load_tokenizer(base)
    enc = tok(
        ["Shares rose after the results.", "The match ended in a draw."],
        padding=True,
        return_tensors="pt",
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = capture_params(model)
    model.train()
    model(**enc, labels=torch.tensor([0, 1])).loss.backward()
    opt.step()
    assert check_update(before, model, 1, "lora") == []


@pytest.mark.slow
def test_smollm2_conversion_identity_lora_forward(smollm2_dir):
    from tunelab.core.assets import smollm2_gguf
    from tunelab.lib.models import convert_gguf

    folder, name = smollm2_gguf()
    cfg = make_cfg(folder, method="lora", target_modules=["q_proj", "v_proj"])
    cfg.model.gguf_file = name
    base = resolve_model(cfg.model)
    assert base.path == smollm2_dir and convert_gguf(folder, name) == smollm2_dir
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]
    assert base.architecture == "causal_lm"
    assert base.identity["source"]["gguf_sha256"] == smollm2_dir.name
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
        base.identity["files"]
    )
    tok = load_tokenizer(base)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    model = load_model(base, cfg)
    assert param_count(model) == 134_515_008
    model, audit = adapt(model, cfg.adaptation, base.architecture)
    # 30 layers x (q: 8 x (576 + 576) + v: 8 x (576 + 192))
    assert audit["totals"]["trainable"] == 30 * (8 * 1152 + 8 * 768) == 460_800
    assert audit["adapted_summary"] == "q_proj x30, v_proj x30"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 49_152) and torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_check_on_gpu_with_fingerprints(tiny_llama_dir):
    _, base, model, _ = loaded(tiny_llama_dir, method="lora", target_modules="all-linear")
    model.to("cuda")
    before = capture_params(model, full_copy_limit_bytes=0)  # the on-device fingerprint path
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
    )
    for step in (1, 2):
        batch = {k: v.cuda() for k, v in batch_for(base, seed=step).items()}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        assert check_update(before, model, step, "lora") == []
    frozen = "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"
    with torch.no_grad():
        dict(model.named_parameters())[frozen][1, 2] += 1e-3
    assert check_update(before, model, 2, "lora") == [
        f"{frozen}: frozen but changed after 2 step(s)"
    ]
