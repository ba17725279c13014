"""The family matrix: a tiny random model of every family in `tunelab.lib.models.tiny_families`
(13 decoders, 6 encoders, 5 image models), each a real checkpoint folder with its family's
tokenizer conventions, through the stages in this process, its export loaded with plain
transformers / peft, and, for every decoder, packed padding-free training equal to the model's
own padded forward with sequences longer than its sliding window (or the fallback and its
reason recorded).

Every family runs validate, register, data, inspect, baseline, train, eval, export and
check-export (a `Studies` object makes each family's study once for the module). The stages
that start a fresh Python process (smoke, size, verify: each pays a whole torch + transformers
import) run where a family's shape is new to them (`SMOKE_VERIFY`, `SIZE`); docs/models.md
says so. A family this transformers cannot build is skipped with the reason (`buildable`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import TOPIC_TEXTS, filled_hypothesis, run_cli
from helpers.images import write_colour_folder, write_image_study
from tunelab.lib.models.tiny_families import BY_NAME, FAMILIES, buildable, save_family

pytestmark = pytest.mark.matrix

# The stages that start a fresh process (a whole torch + transformers import each, 40-110 s a
# cell on a shared 2-core machine) run where the family's shape is new to them; the rest of
# the suite runs them on the tiny Llama, BERT and ViT. smoke + verify: a decoder on its own
# eager attention with softcapped logits (gemma2), a full fine-tune whose forward never uses a
# parameter (DINOv2's mask_token); size: routed experts (qwen3_moe), per-stage lists (swin).
SMOKE_VERIFY = ("gemma2", "dinov2")
SIZE = ("qwen3_moe", "swin")


def _family_param(name: str):
    reason = buildable(name)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(name, id=name, marks=marks)


def _text_rows(kind: str) -> list[dict]:
    rows = []
    for label, texts in TOPIC_TEXTS.items():
        for i, text in enumerate(texts[:4]):
            answer = {"sender": f"{label}@example.com", "subject": text.split()[1]}
            split = "train" if i < 2 else "validation" if i < 3 else "test"
            rows.append(
                {"id": f"{label[:3]}{i}", "text": text, "label": label, "split": split}
                | ({"target": json.dumps(answer)} if kind == "decoder" else {})
            )
    return rows


def write_family_study(root: Path, model: Path, kind: str) -> Path:
    """A study on `model`: extraction (LoRA, all linear layers) for a decoder, topic
    classification (LoRA) for an encoder, colour classification (full fine-tune) for an image
    model; 2 optimizer steps, tiny evaluation."""
    from tunelab.stages.hypothesis.template import render_study_yaml

    root.mkdir(parents=True)
    if kind == "image":
        write_colour_folder(root / "data", per_label=4)
        write_image_study(root, model, {"format": "folder", "path": "data"})
        raw = yaml.safe_load((root / "study.yaml").read_text())
        raw["adaptation"] = {"method": "full"}
        raw["training"] = {"max_steps": 2, "micro_batch_size": 4, "lr": 0.01}
        raw["evaluation"]["bootstrap_samples"] = 20
        (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        return root
    raw = yaml.safe_load(
        render_study_yaml("extraction" if kind == "decoder" else "classification", root.name)
    )
    raw["hypothesis"] = filled_hypothesis(raw)
    rows = _text_rows(kind)
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw["data"]["source"] = {"format": "jsonl", "path": "data.jsonl"}
    fields = {"id": "id", "text": "text", "split": "split"}
    raw["data"]["fields"] = fields | (
        {"label": None, "target": "target"} if kind == "decoder" else {"label": "label"}
    )
    raw["data"]["cleaning"] = []
    raw["data"]["dedup"]["near"] = False
    if kind == "encoder":
        raw["task"]["labels"] = list(TOPIC_TEXTS)
    raw["model"]["path"] = str(model)
    raw["adaptation"].update(method="lora", target_modules="all-linear", rank=4)
    raw["preprocess"]["max_seq_len"] = 96 if kind == "decoder" else 32
    raw["training"].update(
        micro_batch_size=2,
        max_steps=2,
        lr=1e-2,
        warmup_steps=0,
        eval_every_steps=None,
        checkpoint_every_steps=None,
        num_threads=1,
    )
    raw["evaluation"].update(batch_size=4, bootstrap_samples=20)
    if kind == "decoder":
        raw["evaluation"]["max_new_tokens"] = 8
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def _stage(capsys, *args) -> str:
    code, out, err = run_cli(capsys, *args)
    assert code == 0, f"tunelab {' '.join(map(str, args[:2]))}: exit {code}\n{err[-3000:]}"
    return out


def load_plain(export: Path, base: Path, kind: str, num_labels: int):
    """The export as a user loads it without tunelab: transformers, plus peft for an adapter."""
    import transformers

    auto = {
        "decoder": transformers.AutoModelForCausalLM,
        "encoder": transformers.AutoModelForSequenceClassification,
        "image": transformers.AutoModelForImageClassification,
    }[kind]
    extra = {} if kind == "decoder" else {"num_labels": num_labels}
    if (export / "adapter_config.json").is_file():
        from peft import PeftModel

        return PeftModel.from_pretrained(auto.from_pretrained(base, **extra), export).eval()
    return auto.from_pretrained(export).eval()


def _plain_forward(model, export: Path, kind: str) -> torch.Tensor:
    if kind == "image":
        return model(pixel_values=torch.zeros(1, 3, 32, 32)).logits
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export / "tokenizer")
    return model(**tok("The striker scored twice", return_tensors="pt")).logits


class Studies:
    """Each family's model and study, made once for the module: built, validated, registered
    and snapshotted on first use; trained on first need of a run."""

    def __init__(self, root: Path):
        self.root = root
        self.roots: dict[str, Path] = {}
        self.runs: dict[str, str] = {}

    def model(self, name: str) -> Path:
        folder = self.root / "models" / name
        return folder if (folder / "config.json").is_file() else save_family(name, folder)

    def study(self, name: str, capsys) -> Path:
        if name not in self.roots:
            root = write_family_study(self.root / name, self.model(name), BY_NAME[name].kind)
            for args in (["validate"], ["register"], ["data"]):
                _stage(capsys, *args, "-s", root)
            self.roots[name] = root
        return self.roots[name]

    def run_id(self, name: str, capsys) -> str:
        if name not in self.runs:
            out = _stage(capsys, "train", "-s", self.study(name, capsys), "--name", "v1", "--json")
            self.runs[name] = json.loads(out[out.find("{") :])["run_id"]
        return self.runs[name]


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> Studies:
    return Studies(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("name", [_family_param(f.name) for f in FAMILIES])
def test_family_through_the_stages(studies, name, capsys):
    family = BY_NAME[name]
    root = studies.study(name, capsys)
    for args in (["inspect"], ["baseline"]):
        _stage(capsys, *args, "-s", root)
    run_id = studies.run_id(name, capsys)
    for args in (["eval", run_id], ["export", run_id]):
        _stage(capsys, *args, "-s", root)
    (export,) = (root / "records" / "exports").iterdir()
    model = studies.model(name)
    _stage(capsys, "check-export", export, "--base", model)
    plain = load_plain(export, model, family.kind, num_labels=3)
    with torch.no_grad():
        logits = _plain_forward(plain, export, family.kind)
    assert torch.isfinite(logits).all()
    assert logits.shape[-1] == (3 if family.kind != "decoder" else plain.config.vocab_size)


@pytest.mark.parametrize("name", [_family_param(n) for n in SMOKE_VERIFY])
def test_smoke_and_verify_in_fresh_processes(studies, name, capsys):
    root = studies.study(name, capsys)
    _stage(capsys, "smoke", "-s", root)
    _stage(capsys, "verify", studies.run_id(name, capsys), "-s", root)


@pytest.mark.parametrize("name", [_family_param(n) for n in SIZE])
def test_size(studies, name, capsys):
    out = _stage(capsys, "size", "-s", studies.study(name, capsys), "--micro-batch", "2", "--json")
    record = json.loads(out[out.find("{") :])
    assert any(row["status"] == "ok" for row in record["configurations"]), record


@pytest.mark.parametrize("name", [_family_param(f.name) for f in FAMILIES if f.kind == "decoder"])
def test_packed_training_equals_the_padded_forward(studies, name):
    """Two examples longer than the sliding window (8): tunelab's packed, padding-free loss
    and gradients equal those of the model's own padded forward, or the packed batch falls
    back to padding with the reason recorded (`attention_not_used`)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunelab.stages.train.batches import collate
    from tunelab.stages.train.losses import causal_lm_loss_sum, checks_of

    folder = studies.model(name)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    encoded = []
    for n in (13, 21):
        ids = torch.randint(len(tok.all_special_ids) + 1, len(tok), (n,), generator=g).tolist()
        encoded.append({"input_ids": ids, "labels": ids})
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    padded = collate(encoded, pad_id, "causal_lm")
    logits = model(
        input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False
    ).logits  # [2, 21, vocab]
    reference = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), padded["labels"][:, 1:].flatten(), reduction="sum"
    )
    reference.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss = causal_lm_loss_sum(model, collate(encoded, pad_id, "causal_lm", packing=True))
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-4)
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-5, msg=n)
    checks = checks_of(model).describe()
    if not checks["packing_exact"]:  # packed rows padded again: say why
        assert checks["attention"] == "unpacked" and checks["attention_not_used"], checks
