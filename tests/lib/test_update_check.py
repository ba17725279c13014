"""The update check tells a tensor the forward never uses (no gradient: reported, not a failure)
from one that got a gradient and did not move (the failure it exists for), and treats experts
no token was routed to as not moved for a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_cli
from helpers.images import write_colour_folder, write_image_study
from tunelab.lib.models import capture_params, classify_update

MASK_TOKEN = "dinov2.embeddings.mask_token"


def save_tiny_dinov2(out: Path) -> Path:
    """A DINOv2 classifier whose embeddings hold a mask_token only masked pre-training reads."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2ForImageClassification

    cfg = Dinov2Config(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        num_labels=3,
    )
    torch.manual_seed(0)
    Dinov2ForImageClassification(cfg).save_pretrained(out)
    BitImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, do_convert_rgb=True
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dinov2_dir(tmp_path_factory) -> Path:
    return save_tiny_dinov2(tmp_path_factory.mktemp("dinov2") / "dinov2")


def _steps(model, batch, steps, skip: str | None = None):
    params = [p for n, p in model.named_parameters() if n != skip]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    before = capture_params(model)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return classify_update(before, model, steps, "full")


def test_a_tensor_the_forward_skips_is_unused_and_one_that_does_not_move_fails(dinov2_dir):
    from transformers import Dinov2ForImageClassification

    batch = {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.tensor([0, 1, 2, 0])}
    model = Dinov2ForImageClassification.from_pretrained(dinov2_dir)
    result = _steps(model, batch, 2)
    assert result.violations == [] and result.unused == [MASK_TOKEN]
    assert result.unused_numel == 32
    # a tensor that gets its gradient but never an update (left out of the optimizer)
    model = Dinov2ForImageClassification.from_pretrained(dinov2_dir)
    skipped = "dinov2.encoder.layer.0.mlp.fc1.weight"
    result = _steps(model, batch, 2, skip=skipped)
    assert result.violations == [f"{skipped}: received a gradient but unchanged after 2 step(s)"]
    assert result.unused == [MASK_TOKEN]


def test_experts_no_token_was_routed_to_are_not_a_failure():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    ids = torch.tensor([[5, 9, 17]])  # three tokens, two experts each: at most 6 of 8 routed
    result = _steps(model, {"input_ids": ids, "labels": ids}, 1)
    assert result.violations == [] and result.unused == []
    fused = {u.split("[")[0] for u in result.unrouted}
    assert fused == {
        f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in ("gate_up_proj", "down_proj")
    }
    for entry in result.unrouted:
        assert len(entry.split("[")[1].rstrip("]").split(",")) >= 2


def test_a_full_fine_tune_of_dinov2_trains_and_records_the_unused_token(
    tmp_path, dinov2_dir, capsys
):
    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=6)
    write_image_study(
        root,
        dinov2_dir,
        {"format": "folder", "path": "data"},
        adaptation={"method": "full"},
        training={"max_steps": 2, "micro_batch_size": 8, "lr": 0.01},
    )
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "full")
    assert code == 0, err
    (run_dir,) = (root / "records" / "runs").glob("train-*")
    check = json.loads((run_dir / "status.json").read_text())["update_check"]
    assert check["violations"] == [] and check["unused"] == [MASK_TOKEN]
    assert check["unused_parameters"] == 32
