"""`tunelab size` on conv nets (ResNet, ConvNeXt): the image side the study's image chain feeds
is the "length", the measured increase is set against the feature-map walk, and a model that
is neither patch-based nor a known conv net is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli
from helpers.images import write_colour_folder, write_image_study

# |predicted - measured| / measured of a full fine-tuning step's peak RSS increase, fp32, at
# micro-batches 4 and 8 of 128-pixel images (measured: ResNet -10 to +9 %, ConvNeXt -7 to +14 %)
TOLERANCE_PCT = 20.0


def save_conv_net(out: Path, kind: str, processor=None) -> Path:  # noqa: ANN001
    """A tiny ResNet or ConvNeXt classifier backbone from a config, with an image processor
    whose size differs from config.image_size (so the record shows which one is fed)."""
    import torch
    from transformers import (
        ConvNextConfig,
        ConvNextImageProcessor,
        ConvNextModel,
        ResNetConfig,
        ResNetModel,
        ViTImageProcessor,
    )

    torch.manual_seed(0)
    if kind == "convnext":
        model = ConvNextModel(
            ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=224)
        )
        processor = ViTImageProcessor(size={"height": 128, "width": 128})
    else:
        cfg = ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
            image_size=224,
        )  # fmt: skip
        model = ResNetModel(cfg)
        # ResNet checkpoints use ConvNeXt's processor: 136 / crop_pct 0.875, then 136 x 136
        processor = processor or ConvNextImageProcessor(size={"shortest_edge": 136})
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def sized_study(tmp_path: Path, capsys, kind: str, processor=None, **sections) -> Path:  # noqa: ANN001
    model_dir = save_conv_net(tmp_path / kind, kind, processor)
    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=4)
    write_image_study(root, model_dir, {"format": "folder", "path": "data"}, **sections)
    raw = (root / "study.yaml").read_text().replace("method: lora", "method: full")
    (root / "study.yaml").write_text(raw)
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "side", "sections"),
    [
        ("resnet", 128, {"preprocess": {"image": {"crop": 128}}}),
        ("resnet", 136, {}),
        ("convnext", 128, {}),
    ],
)
def test_size_measures_a_conv_net_at_the_side_its_chain_feeds(
    tmp_path, capsys, monkeypatch, kind, side, sections
):
    """ResNet: the study's crop 128, or the processor's own 136 (shortest edge 155 = 136 /
    crop_pct, then its centre 136 x 136); ConvNeXt: the processor's 128x128.
    Neither is config.image_size (224). Each fp32 increase is within TOLERANCE_PCT of the
    walk, the recommendation is measured, and the plan reads the record."""
    root = sized_study(tmp_path, capsys, kind, **sections)
    args = ["--micro-batch", "4"] + (["--precision", "bf16"] if kind == "resnet" else [])
    code, out, err = run_cli(capsys, "size", "-s", root, *args, "--json")
    assert code == 0, err
    record = json.loads(out[out.find("{") :])
    lengths = record["lengths"]
    assert lengths["max"] == lengths["image_size"] == side
    assert lengths["length_unit"] == "image side"
    assert record["facts"]["family"] == kind and record["facts"]["conv"]["image_size"] == side
    rows = record["configurations"]
    assert all(r["status"] == "ok" for r in rows), rows
    assert not any(r["options"]["checkpointing"] for r in rows)  # neither can checkpoint
    assert {r["options"]["precision"] for r in rows} == (
        {"fp32", "bf16"} if kind == "resnet" else {"fp32"}
    )
    for row in (r for r in rows if r["options"]["precision"] == "fp32"):
        assert row["predicted"]["activations"] > 0
        assert abs(row["error_pct"]) <= TOLERANCE_PCT, (row["label"], row["error_pct"])
    rec = record["recommendation"]
    assert rec["fits"] and rec["measured_status"] == "ok" and not rec["checkpointing"], rec
    # the printed record: lengths in pixels a side, throughput in images a second
    from tunelab.cli import common
    from tunelab.cli.size import print_sizing

    monkeypatch.setattr(common.console, "width", 80)
    print_sizing(record)
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())
    assert f"max {side} px a side" in flat and f" {side}px 4x" in flat, printed
    assert "shape: image side in pixels," in flat and "img/s" in flat
    assert "images/s measured" in flat
    assert "tok" not in flat
    code, out, err = run_cli(capsys, "plan", "-s", root, "--days", "3")
    assert code == 0, err
    assert f"{side} px a side" in " ".join(out.split()), out
    code, out, err = run_cli(capsys, "plan", "-s", root, "--days", "3", "--compare-gpus")
    assert code == 0, err
    assert f"images of {side} px a side" in " ".join(out.split()), out


def test_size_refuses_an_image_model_neither_patched_nor_a_known_conv_net(tmp_path, capsys):
    """A RegNet (model_type regnet, no patch_size) is refused, exit 2, naming its type and
    what is supported."""
    import torch
    from transformers import ConvNextImageProcessor, RegNetConfig, RegNetModel

    torch.manual_seed(0)
    out = tmp_path / "regnet"
    RegNetModel(
        RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
    ).save_pretrained(out)
    ConvNextImageProcessor(size={"shortest_edge": 32}).save_pretrained(out)
    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=4)
    write_image_study(root, out, {"format": "folder", "path": "data"})
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out_text, err = run_cli(capsys, "size", "-s", root)
    assert code == 2
    assert "'regnet'" in err and "resnet" in err and "convnext" in err and "ViT" in err
    assert "Traceback" not in err


def test_size_refuses_a_conv_net_fed_no_single_square_side(tmp_path, capsys):
    """A processor that resizes by the shortest edge without a crop (CLIP's, crop off): the
    24x20 images reach the model at 163x136, no square side, so sizing says to set
    preprocess.image.crop."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 136}, do_center_crop=False)
    root = sized_study(tmp_path, capsys, "resnet", processor)
    code, _, err = run_cli(capsys, "size", "-s", root)
    assert code == 2 and "preprocess.image.crop" in err and "Traceback" not in err


def _counted_flops(model, side: int, b: int) -> tuple[dict, dict]:
    """torch's FlopCounterMode counts by op over a forward and over its backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def by_op(counter) -> dict:
        return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}

    x = torch.randn(b, 3, side, side)
    with FlopCounterMode(display=False) as counter:
        logits = model(pixel_values=x).logits
    forward = by_op(counter)
    with FlopCounterMode(display=False) as counter:
        logits.sum().backward()
    return forward, by_op(counter)


@pytest.mark.parametrize(
    ("kind", "layer_type", "frozen"),
    [
        ("resnet", "basic", False),
        ("resnet", "bottleneck", False),
        ("resnet", "bottleneck", True),
        ("convnext", None, False),
    ],
)
def test_conv_flops_equal_what_torch_counts(kind, layer_type, frozen):
    """The plan's FLOPs of a conv net's step (`micro_step_flops` over its walk) against torch's
    FlopCounterMode on the model itself: forward and backward equal for ResNet, full or with
    only the head training. ConvNeXt: the forward equal, the linear layers' backward twice
    their forward, and the convolutions' twice theirs but the pixels' gradient (torch's counter
    counts a depthwise convolution's backward once per group, so it is not compared)."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForImageClassification, ConvNextConfig, ResNetConfig

    from tunelab.stages.plan.flops import MicroBatch, micro_step_flops
    from tunelab.stages.sizing.facts import model_facts

    torch.manual_seed(0)
    side, b = 96, 3
    if kind == "resnet":
        cfg = ResNetConfig(
            embedding_size=8, hidden_sizes=[16, 32], depths=[2, 1], layer_type=layer_type
        )
    else:
        cfg = ConvNextConfig(hidden_sizes=[8, 16], depths=[2, 1], num_stages=2)
    cfg.num_labels, cfg.image_size = 5, side
    model = AutoModelForImageClassification.from_config(cfg)
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("classifier")
    facts = model_facts(model, "image")
    facts = replace(facts, conv={**facts.conv, "image_size": side})
    step = micro_step_flops(facts, MicroBatch(b * side, 0, b, b), checkpointing=False)
    forward, backward = _counted_flops(model, side, b)
    assert step.forward == pytest.approx(sum(forward.values()), rel=1e-9)
    if kind == "resnet":
        assert step.backward == pytest.approx(sum(backward.values()), rel=1e-9)
        assert step.backward > 0
    else:
        patchify = 2 * b * 8 * (side // 4) ** 2 * 3 * 4 * 4  # its input, the pixels, needs none
        assert backward["aten.mm"] == pytest.approx(2 * forward["aten.addmm"], rel=1e-9)
        convolutions = 2 * forward["aten.convolution"] - patchify
        assert step.backward == pytest.approx(backward["aten.mm"] + convolutions, rel=1e-9)
