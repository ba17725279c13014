"""task.kind image_classification: reading, hashing and deduplicating images, the transform
chain, inspect, and the stages on a tiny ViT, on images made in-process."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import run_cli
from helpers.images import COLOURS, colour_image, png_bytes, write_colour_folder, write_image_study
from tunelab.core.errors import DataError, SnapshotError
from tunelab.stages.data.images import (
    find_image_duplicates,
    hamming_pairs,
    image_facts,
    max_distance_for,
)

# ---------------------------------------------------------------- hashes and duplicates

# random crops and flips on training views
AUGMENT = {"image": {"train_random_crop": 0.7, "train_flip": True}}


def test_pixel_hash_sees_through_re_encoding_and_dhash_finds_near_copies():
    img = colour_image(0, 1, size=(32, 32))
    png, bmp = image_facts(png_bytes(img), "a.png"), image_facts(png_bytes(img, "BMP"), "a.bmp")
    assert png.sha256 != bmp.sha256 and png.pixel_sha256 == bmp.pixel_sha256
    assert (png.width, png.height, png.mode, png.format) == (32, 32, "RGB", "PNG")
    jpeg = image_facts(png_bytes(img, "JPEG", quality=80), "a.jpg")
    other = image_facts(png_bytes(colour_image(2, 7, size=(32, 32))), "b.png")
    pairs, info = find_image_duplicates(
        [png, bmp, jpeg, other], exact=True, near=True, threshold=0.9
    )
    kinds = {(p.a, p.b): p.kind for p in pairs}
    assert kinds[(0, 1)] == "exact"
    assert kinds.get((0, 2)) == "near" and kinds.get((1, 2)) == "near"
    assert not any(3 in (p.a, p.b) for p in pairs)
    assert info["max_hamming_distance"] == max_distance_for(0.9) == 6


def test_hamming_pairs_equal_brute_force():
    rng = np.random.default_rng(3)
    hashes = rng.integers(0, 2**63, size=300, dtype=np.uint64)
    hashes[7] = hashes[3] ^ np.uint64(0b101)  # 2 bits apart
    idx, dist = hamming_pairs(hashes, 20)
    got = {(int(a), int(b)): int(d) for (a, b), d in zip(idx, dist, strict=True)}
    want = {}
    for i in range(300):
        for j in range(i + 1, 300):
            d = bin(int(hashes[i]) ^ int(hashes[j])).count("1")
            if d <= 20:
                want[(i, j)] = d
    assert got == want and got[(3, 7)] == 2


# ---------------------------------------------------------------- snapshots


def test_truncated_image_is_named_and_nothing_is_written(tmp_path, tiny_vit_dir, capsys):
    data = write_colour_folder(tmp_path / "s" / "data", per_label=3)
    whole = (data / "red" / "1.png").read_bytes()
    (data / "red" / "1.png").write_bytes(whole[: len(whole) // 2])
    study = write_image_study(tmp_path / "s", tiny_vit_dir, {"format": "folder", "path": "data"})
    code, out, err = run_cli(capsys, "data", "-s", study)
    assert code == 2
    assert "red/1.png" in err and "not a readable image" in err
    assert not (study / "records" / "data").exists() or not any(
        (study / "records" / "data").iterdir()
    )


def test_snapshot_of_jsonl_paths_stores_images_and_removes_pixel_duplicates(tmp_path, tiny_vit_dir):
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.data import stage as data_stage

    root = tmp_path / "s"
    pics = root / "pics"
    pics.mkdir(parents=True)
    rows = []
    for label, channel in COLOURS.items():
        for i in range(8):
            img = colour_image(channel, 10 * channel + i, size=(20 + i, 20))
            if i == 0:
                img = img.convert("L")  # mixed modes
            name = f"{label}{i}.png"
            img.save(pics / name)
            rows.append({"path": f"pics/{name}", "y": label})
    # the same pixels as red0.png, re-encoded as BMP: an exact duplicate
    Image.open(pics / "red0.png").save(pics / "copy.bmp")
    rows.append({"path": "pics/copy.bmp", "y": "red"})
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"data.fields": {"image": "path", "label": "y"}}
    set_ = fields | {"data.dedup.policy": "drop_all_but_one"}
    write_image_study(root, tiny_vit_dir, {"format": "jsonl", "path": "data.jsonl"}, set=set_)
    study = Study.open(root)
    manifest = data_stage.run(study)
    assert manifest["duplicates"]["exact_pairs"] >= 1
    assert manifest["counts"]["removed_as_duplicates"] >= 1
    assert manifest["transforms"]["split_key"] == "sha256 of the decoded pixels"
    snap = load_snapshot(study)
    train = snap.rows("train")
    assert all(Path(r["image_path"]).is_file() for r in train)
    assert {r["text"] for r in train} <= {r["path"] for r in rows}
    facts = [json.loads(x) for x in (snap.dir / "images.jsonl").read_text().splitlines()]
    assert {f["split"] for f in facts} <= {"train", "validation"}
    assert "L" in {f["mode"] for f in facts} or len(facts) < 20
    # an edited image is found when the snapshot is opened again
    victim = Path(train[0]["image_path"])
    victim.write_bytes(victim.read_bytes() + b"x")
    with pytest.raises(SnapshotError, match="no longer matches"):
        load_snapshot(study, snap.id)


def test_missing_image_path_is_a_located_error(tmp_path, tiny_vit_dir):
    from tunelab.core.study import Study
    from tunelab.stages.data import stage as data_stage

    root = tmp_path / "s"
    root.mkdir()
    (root / "data.jsonl").write_text(json.dumps({"path": "nope.png", "label": "red"}) + "\n")
    source = {"format": "jsonl", "path": "data.jsonl"}
    write_image_study(root, tiny_vit_dir, source, set={"data.fields": {"image": "path"}})
    with pytest.raises(DataError, match=r"data.jsonl line 1.*nope.png"):
        data_stage.run(Study.open(root))


# ---------------------------------------------------------------- transforms


def test_chain_equals_the_processor_and_augments_training_only(tmp_path, tiny_vit_dir):
    from transformers import AutoImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    raw = yaml.safe_load(
        (
            write_image_study(tmp_path / "s", tiny_vit_dir, {"format": "folder", "path": "d"})
            / "study.yaml"
        ).read_text()
    )
    raw["preprocess"] = {"image": {"train_random_crop": 0.5, "train_flip": True}}
    cfg = validate_config(raw)
    processor = AutoImageProcessor.from_pretrained(tiny_vit_dir)
    pre = Preprocessor(processor, cfg, get_task(cfg, list(COLOURS)), "image")
    path = tmp_path / "x.png"
    img = colour_image(1, 5, size=(37, 23))
    img.save(path)
    row = {"id": "x", "label": "green", "image_path": str(path), "text": "x.png"}
    enc = pre.encode(row)
    assert enc["label"] == 1 and list(enc["pixel_values"].shape) == [3, 16, 16]
    theirs = processor(images=img, return_tensors="np")["pixel_values"][0]
    assert np.abs(enc["pixel_values"].numpy() - theirs).max() < 1e-5
    assert (pre.encode(row)["pixel_values"] == enc["pixel_values"]).all()
    view = pre.encode_train(row)["pixel_values"]
    assert (pre.encode_train(row)["pixel_values"] == view).all()  # seeded
    assert not (view == enc["pixel_values"]).all()  # the crop changes what training sees
    # evaluation's procedure (the template sha256) is the deterministic chain; training's
    # augmentation is hashed apart
    raw["preprocess"]["image"]["train_flip"] = False
    no_flip = Preprocessor(processor, validate_config(raw), pre.task, "image")
    assert no_flip.template_sha256 == pre.template_sha256
    assert no_flip.describe()["augmentation_sha256"] != pre.describe()["augmentation_sha256"]
    raw["preprocess"]["image"]["resize"] = 12
    smaller = Preprocessor(processor, validate_config(raw), pre.task, "image")
    assert smaller.template_sha256 != pre.template_sha256
    assert list(smaller.encode(row)["pixel_values"].shape) == [3, 12, 12]


@pytest.mark.parametrize(
    ("kind", "settings", "shape"),
    [
        ("convnext", {"size": {"shortest_edge": 32}, "crop_pct": 0.875}, [3, 32, 32]),
        ("convnext", {"size": {"shortest_edge": 400}}, [3, 400, 400]),
        ("clip", {"size": {"shortest_edge": 21}, "crop_size": 16}, [3, 16, 16]),
    ],
)
@pytest.mark.parametrize("image_size", [(37, 23), (23, 37)])
def test_chain_equals_shortest_edge_processors(
    tmp_path, tiny_vit_dir, kind, settings, shape, image_size
):
    """Processors sized by the shortest edge, as transformers applies them: ConvNeXt's (which
    ResNet checkpoints also use) to edge / crop_pct then the centre edge x edge below 384, a
    square warp from 384 on; CLIP's shortest edge then its crop. The long side is truncated
    as transformers does, in both orientations."""
    from transformers import CLIPImageProcessor, ConvNextImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    root = write_image_study(tmp_path / "s", tiny_vit_dir, {"format": "folder", "path": "d"})
    cfg = validate_config(yaml.safe_load((root / "study.yaml").read_text()))
    cls = ConvNextImageProcessor if kind == "convnext" else CLIPImageProcessor
    processor = cls(**settings)
    pre = Preprocessor(processor, cfg, get_task(cfg, list(COLOURS)), "image")
    path = tmp_path / "x.png"
    img = colour_image(1, 5, size=image_size)
    img.save(path)
    enc = pre.encode({"id": "x", "label": "green", "image_path": str(path), "text": "x.png"})
    theirs = processor(images=img, return_tensors="np")["pixel_values"][0]
    assert list(enc["pixel_values"].shape) == shape == list(theirs.shape)
    assert np.abs(enc["pixel_values"].numpy() - theirs).max() < 1e-5


# ---------------------------------------------------------------- inspect


def test_inspect_shows_steps_and_flags_sizes_and_modes(tmp_path, tiny_vit_dir, capsys):
    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=6)
    for i in range(6):  # every blue image larger and grey: a shortcut the model could learn
        colour_image(2, 50 + i, size=(64, 64)).convert("L").save(data / "blue" / f"{i}.png")
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    assert run_cli(capsys, "data", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "1")
    assert code == 0, err
    assert "resize -> 16x16 RGB" in out and "tensor [3, 16, 16] float32" in out
    assert "category 'blue': median image area 4096" in out
    assert "mode L" in out
    page = next((root / "records" / "inspect").glob("*.html")).read_text()
    assert page.count("data:image/png;base64,") >= 6  # before and after, per example
    record = json.loads(next((root / "records" / "inspect").glob("*.json")).read_text())
    assert record["distributions"]["blue"]["modes"] == {"L": record["distributions"]["blue"]["n"]}
    ex = record["examples"][0]
    assert ex["original"]["format"] == "PNG" and ex["tensor"]["shape"] == [3, 16, 16]


def test_a_mode_the_chain_cannot_take_stops_data_and_inspect(tmp_path, tiny_vit_dir, capsys):
    """A 16-bit file is refused when the snapshot is made (it could land in the sealed test
    split, which inspect never reads); inspect still stops on one read from elsewhere."""
    from transformers import AutoImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.inspect.images import inspect_images

    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=4)
    deep = np.arange(20 * 24, dtype=np.uint16).reshape(20, 24) * 100
    Image.fromarray(deep).save(data / "red" / "deep.png")  # 16-bit grey: mode I;16
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    run_cli(capsys, "register", "-s", root)
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 2 and "red/deep.png: mode 'I;16'" in err and "8 bits per channel" in err
    cfg = validate_config(yaml.safe_load((root / "study.yaml").read_text()))
    pre = Preprocessor(
        AutoImageProcessor.from_pretrained(tiny_vit_dir), cfg, get_task(cfg, list(COLOURS)), "image"
    )
    row = {"id": "deep", "label": "red", "image_path": str(data / "red" / "deep.png"), "text": "x"}
    record = inspect_images(pre, [row], split="train", per_category=1)
    assert [p["kind"] for p in record["problems"]] == ["unsupported_mode"]


# ---------------------------------------------------------------- the stages


def test_image_study_through_the_stages(tmp_path, tiny_vit_dir, capsys):
    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=12)
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    for args in (["validate"], ["register"], ["data"], ["baseline"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "v1")
    assert code == 0, err
    # a step counts images: the progress line and the summary say images a second
    assert re.search(r"\| [\d,]+ img/s \|", err) and "tok/s" not in err, err
    assert re.search(r"│ images/s +│ [\d,]+ ", out) and "tokens/s" not in out, out
    (run_id,) = [p.name for p in (root / "records" / "runs").glob("train-*")]
    assert run_cli(capsys, "eval", run_id, "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "compare", "-s", root)
    assert code == 0, err
    assert "per category delta" in out
    code, out, err = run_cli(capsys, "export", run_id, "-s", root)
    assert code == 0, err
    export = next((root / "records" / "exports").iterdir())
    assert (export / "tokenizer" / "preprocessor_config.json").is_file()
    assert (export / "example-image.png").is_file()
    from tunelab.stages.export import check_export

    result = check_export(export, tiny_vit_dir)
    assert result["example"]["matches_recorded"]
    assert run_cli(capsys, "report", "-s", root)[0] == 0
    metrics = json.loads(
        next((root / "records" / "runs").glob("eval-*/metrics-validation.json")).read_text()
    )
    assert set(metrics["metrics"]["per_category"]) == set(COLOURS)


@pytest.mark.slow
def test_sizing_measures_a_vit_step_at_its_patch_tokens(
    tmp_path, tiny_vit_dir, capsys, monkeypatch
):
    """The patch tokens ((16 / 4)^2 + CLS = 17) stand for the sequence length; one real step
    of the ViT is measured and set against the analytic estimate, and the plan reads it. Its
    throughput is images a second (a step counts images), and every text says so."""
    from tunelab.cli import common
    from tunelab.cli.size import print_sizing

    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=6)
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    for args in (["register"], ["data"], ["baseline"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "size", "-s", root, "--micro-batch", "4", "--json")
    assert code == 0, err
    record = json.loads(out[out.find("{") :])
    assert record["lengths"]["max"] == 17 and record["lengths"]["image_size"] == 16
    row = record["configurations"][0]
    assert row["status"] == "ok", row
    assert row["measured"]["step_s"] > 0 and row["predicted"]["activations"] > 0
    assert record["facts"]["architecture"] == "image" and record["facts"]["family"] == "bert"
    monkeypatch.setattr(common.console, "width", 80)
    print_sizing(record)
    flat = " ".join(capsys.readouterr().out.split())
    assert re.search(r"step s img/s ", flat) and "images/s measured" in flat, flat
    assert "tok/s" not in flat and "tokens/s" not in flat
    assert "max 17 patch tokens" in flat and "shape: patch tokens," in flat
    code, out, err = run_cli(capsys, "plan", "-s", root, "--days", "3")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "at 17 patch tokens/image x 1.000 (every image at that size)" in flat, flat
    code, out, err = run_cli(capsys, "plan", "-s", root, "--compare-gpus")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "lengths: 17 patch tokens an image" in flat and "tokenized" not in flat
    assert run_cli(capsys, "report", "-s", root)[0] == 0
    dossier = (root / "report" / "dossier.md").read_text()
    assert "| seq len (patch tokens) |" in dossier and "images/s |" in dossier
    assert "tokens/s" not in dossier
    assert "no baseline record" not in flat  # a classifier's baseline ran; it decodes nothing
    assert "given by the task: it scores each example, no decoding" in flat


@pytest.mark.slow
def test_image_demo_runs_every_stage_to_the_dossier(tmp_path):
    """The image demo's study (real digits, a ViT from a config): every stage runs as its own
    command, the trained ViT beats its untrained head, and the dossier is written."""
    from tunelab.demo.run import VARIANT_CHANGE, demo_stages, run_stages
    from tunelab.demo.studies import image_study

    root = tmp_path / "demo"
    root.mkdir()
    study = image_study(root)
    (root / "study.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    lines: list[str] = []
    result = run_stages(root, demo_stages(*VARIANT_CHANGE["image"]), lines.append)
    assert (root / "report" / "dossier.html").is_file()
    assert any((root / "records" / "sizing").iterdir()) and any(
        (root / "records" / "plans").iterdir()
    )
    titles = [t for t, _ in result["timings_s"]]
    assert "size a full training step" in titles and "dossier" in titles
    baseline = json.loads(
        next((root / "records" / "runs").glob("baseline-*/metrics-validation.json")).read_text()
    )
    evals = [
        json.loads(p.read_text())
        for p in (root / "records" / "runs").glob("eval-*/metrics-validation.json")
    ]
    best = max(e["metrics"]["macro_f1"] for e in evals)
    assert best > baseline["metrics"]["macro_f1"] + 0.2


def test_a_fully_trained_vit_checkpoint_reloads_exactly(tmp_path, tiny_vit_dir):
    """transformers renames some models' tensors on save (ViT's q_proj -> attention.query);
    a full checkpoint keeps the names the model has, so it loads back tensor for tensor."""
    import torch

    from tunelab.core.config import validate_config
    from tunelab.lib.models import adapt, load_model, load_trainable, resolve_model, save_trainable

    raw = yaml.safe_load(
        (
            write_image_study(tmp_path / "s", tiny_vit_dir, {"format": "folder", "path": "d"})
            / "study.yaml"
        ).read_text()
    )
    raw["adaptation"] = {"method": "full"}
    cfg = validate_config(raw)
    base = resolve_model(cfg.model)
    model, _ = adapt(load_model(base, cfg, list(COLOURS)), cfg.adaptation, "image")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_trainable(model, tmp_path / "ckpt")
    fresh = load_trainable(load_model(base, cfg, list(COLOURS)), tmp_path / "ckpt")
    pixels = torch.randn(2, 3, 16, 16)
    assert torch.equal(model(pixel_values=pixels).logits, fresh(pixel_values=pixels).logits)


# ---------------------------------------------------------------- init


@pytest.mark.slow
def test_init_writes_an_image_study_that_validates_and_runs(tmp_path, tiny_vit_dir, capsys):
    import shutil

    from helpers import filled_hypothesis

    root = tmp_path / "s"
    code, out, err = run_cli(capsys, "init", root, "--task", "image_classification")
    assert code == 0, err
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 2 and "data.source.path" in err  # the template names a folder to fill
    write_colour_folder(root / "data", per_label=6)
    shutil.copytree(tiny_vit_dir, root / "models" / "vit-base")
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 0, err
    assert "warning" not in out + err
    raw = yaml.safe_load((root / "study.yaml").read_text())
    assert raw["model"]["architecture"] == "image" and raw["data"]["cleaning"] == []
    assert {g["metric"] for g in raw["guardrails"]} == {"accuracy", "macro_f1", "f1"}
    augment = raw["preprocess"]["image"]
    assert augment["train_random_crop"] and augment["train_flip"]
    assert run_cli(capsys, "register", "-s", root)[0] == 2  # the TODO hypothesis is refused
    raw["hypothesis"] = filled_hypothesis(raw)
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "1")
    assert code == 0, err
    assert "training view" in out and "random_crop" in out and "random_flip" in out
    code, out, err = run_cli(capsys, "smoke", "-s", root)
    assert code == 0, err
    assert "images per step" in out and "tokens per step" not in out


# ---------------------------------------------------------------- the dossier


def test_dossier_shows_thumbnails_of_the_flipped_images(tmp_path, tiny_vit_dir, capsys):
    import base64
    import html
    import re
    from collections import Counter

    from tunelab.stages.report.sections.flipped_images import PER_CATEGORY

    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=20)
    splits = {"train": 0.6, "validation": 0.3, "test": 0.1, "seed": 0}
    set_ = {"data.splits": splits, "training.max_steps": 6}
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"}, set=set_)
    for args in (["register"], ["data"], ["baseline"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "v1", "--json")
    assert code == 0, err
    run_id = json.loads(out[out.find("{") :])["run_id"]
    for args in (["eval", run_id], ["compare"], ["report"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    compare = json.loads(next((root / "records" / "compare").glob("*.json")).read_text())
    flips = compare["runs"][0]["flips"]
    assert flips["num_improved"] + flips["num_regressed"] > 0
    eval_dir = root / "records" / "runs" / compare["runs"][0]["eval_run"]
    preds = {
        p["id"]: p
        for p in map(
            json.loads, (eval_dir / "predictions-validation.jsonl").read_text().splitlines()
        )
    }
    want = 0
    for key in ("improved", "regressed"):
        per_gold = Counter(preds[i]["gold"] for i in flips[key])
        want += sum(min(PER_CATEGORY, n) for n in per_gold.values())
    page = (root / "report" / "dossier.html").read_text()
    thumbs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)" style', page)
    assert len(thumbs) == want
    for caption, data in thumbs:
        example_id = caption.split(":")[0]
        assert example_id in flips["improved"] + flips["regressed"]
        assert f"gold {preds[example_id]['gold']}" in caption
        assert f"variant {preds[example_id]['prediction']}" in caption
        assert Image.open(io.BytesIO(base64.b64decode(data))).size == (96, 80)  # 24x20 scaled
    for key, direction in (("improved", "wrong -> right"), ("regressed", "right -> wrong")):
        assert (html.escape(f"v1: {direction} on validation") in page) == bool(flips[key])
    assert thumbs[0][0] in (root / "report" / "dossier.md").read_text()

    # the other direction, on the same records: the baseline as the variant, flips swapped
    from tunelab.core.record_parts import CompareEntry
    from tunelab.core.record_types import Compare
    from tunelab.core.study import Study
    from tunelab.stages.report.collect import collect
    from tunelab.stages.report.document import Gallery
    from tunelab.stages.report.sections.context import Dossier
    from tunelab.stages.report.sections.flipped_images import flipped_galleries

    study = Study.open(root)
    dossier = Dossier(study, collect(study), tmp_path / "plots")
    swapped = CompareEntry.of(
        "compare.json",
        {
            "run_id": "swapped",
            "name": "swapped",
            "eval_run": compare["baseline"]["eval_run"],
            "flips": {"improved": flips["regressed"], "regressed": flips["improved"]},
        },
    )
    baseline = {"run_id": "v1", "eval_run": compare["runs"][0]["eval_run"]}
    back = Compare.of("compare.json", {**compare, "baseline": baseline})
    galleries = [g for g in flipped_galleries(dossier, back, swapped) if isinstance(g, Gallery)]
    regressed = next(g for g in galleries if "right -> wrong" in (g.caption or ""))
    per_gold = Counter(preds[i]["gold"] for i in flips["improved"])
    assert len(regressed.thumbs) == sum(min(PER_CATEGORY, n) for n in per_gold.values())
    golds = [t.caption.split("gold ")[1].split(";")[0] for t in regressed.thumbs]
    assert golds == sorted(golds)  # grouped by category

    # an image edited after the snapshot is not shown as if it were the one evaluated
    first = preds[thumbs[0][0].split(":")[0]]["image"]
    snap = next((root / "records" / "data").iterdir())
    (snap / first).write_bytes(png_bytes(colour_image(0, 999)))
    assert run_cli(capsys, "report", "-s", root)[0] == 0
    page = (root / "report" / "dossier.html").read_text()
    shown = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)" style', page)
    assert thumbs[0][0] not in [caption for caption, _ in shown]
    assert "1 flipped image(s) not shown (missing from the data snapshot" in page


# ---------------------------------------------------------------- a view per epoch


def augmenting_preprocessor(tmp_path: Path, model_dir: Path, seed: int = 0):
    from transformers import AutoImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    study = write_image_study(tmp_path / "s", model_dir, {"format": "folder", "path": "d"})
    raw = yaml.safe_load((study / "study.yaml").read_text())
    raw["preprocess"] = {"image": {"train_random_crop": 0.6, "train_flip": True}}
    raw["training"]["seed"] = seed
    cfg = validate_config(raw)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    return Preprocessor(processor, cfg, get_task(cfg, list(COLOURS)), "image")


def test_each_epoch_sees_a_new_view_and_a_restart_reads_the_same_tensors(tmp_path, tiny_vit_dir):
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.stages.train.batches import DataOrder, Position, StepSource

    rows = []
    for i, (label, channel) in enumerate(list(COLOURS.items()) * 2):
        path = tmp_path / f"{i}.png"
        colour_image(channel, 70 + i, size=(37, 23)).save(path)
        rows.append({"id": f"e{i}", "label": label, "image_path": str(path), "text": path.name})
    pre = augmenting_preprocessor(tmp_path, tiny_vit_dir)
    encoded = [pre.encode_train(r) for r in rows]
    view = pre.train_views(rows, encoded)

    def pixels(i: int, epoch: int):
        return view(i, epoch)["pixel_values"]

    for i in range(len(rows)):
        assert torch.equal(pixels(i, 0), encoded[i]["pixel_values"])  # epoch 0: as encoded
        epochs = [pixels(i, e) for e in range(3)]
        assert not any(torch.equal(epochs[a], epochs[b]) for a, b in ((0, 1), (0, 2), (1, 2)))
        assert torch.equal(pixels(i, 2), epochs[2])  # seeded: drawn again, the same view
    # another process (a resumed run) builds its own preprocessor: the same views
    again = augmenting_preprocessor(tmp_path / "again", tiny_vit_dir)
    assert torch.equal(again.encode_train(rows[3], 2)["pixel_values"], pixels(3, 2))
    other_seed = augmenting_preprocessor(tmp_path / "seed1", tiny_vit_dir, seed=1)
    assert not torch.equal(other_seed.encode_train(rows[3], 2)["pixel_values"], pixels(3, 2))
    assert pre.describe()["augmentation_sha256"] != other_seed.describe()["augmentation_sha256"]

    # the loop's stream over three epochs, and a restart from the position after step 3
    def source(p: Any) -> StepSource:
        views = p.train_views(rows, [p.encode_train(r) for r in rows])
        return StepSource(encoded, DataOrder(len(rows), 0), 4, 1, 0, "image", views=views)

    straight, position, positions = [], Position(), []
    for _ in range(5):  # 20 examples: epochs 0, 1, 2 and part of 3
        batches, position = source(pre).next(position)
        straight.append(batches[0]["pixel_values"])
        positions.append(position)
    assert positions[-1].epoch == 3
    resumed, position = [], positions[2]
    fresh = source(again)
    for _ in range(2):
        batches, position = fresh.next(position)
        resumed.append(batches[0]["pixel_values"])
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[3:], strict=True))
    # without augmentation every epoch reads the encodings as they are
    from tunelab.core.config import validate_config

    plain = write_image_study(tmp_path / "plain", tiny_vit_dir, {"format": "folder", "path": "d"})
    cfg = validate_config(yaml.safe_load((plain / "study.yaml").read_text()))
    assert Preprocessor(pre.tokenizer, cfg, pre.task, "image").train_views(rows, encoded) is None


def test_an_augmented_run_resumed_after_sigterm_equals_the_straight_run(
    tmp_path, tiny_vit_dir, capsys
):
    import os
    import signal

    from helpers.train_run import assert_same_result
    from tunelab.core.study import Study
    from tunelab.stages.train import stage as train_stage
    from tunelab.stages.train.callbacks import RunInterrupted
    from tunelab.stages.train.resume import resume_run

    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=6)
    training = {"max_steps": 8, "micro_batch_size": 4, "checkpoint_every_steps": 2}
    set_ = {f"training.{k}": v for k, v in (training | {"eval_every_steps": 4}).items()}
    write_image_study(
        root, tiny_vit_dir, {"format": "folder", "path": "data"}, set=set_, preprocess=AUGMENT
    )
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    study = Study.open(root)
    straight = train_stage.run(study, name="straight")
    epochs = [r.get("epoch") for r in map(json.loads, (straight.dir / "metrics.jsonl").open())]
    assert max(e for e in epochs if e is not None) > 2  # the run reads more than two epochs

    def stop_after_step_3(
        what: str, step: float, total: float | None = None, text: str = ""
    ) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves a checkpoint and stops

    with pytest.raises(RunInterrupted):
        train_stage.run(study, name="stopped", progress=stop_after_step_3)
    (row,) = [r for r in study.ledger.list_runs() if r.name == "stopped"]
    resumed = resume_run(Study.open(root), row.id)
    assert_same_result(resumed.dir, straight.dir)  # exact losses, bit-identical adapter


def test_the_loop_reads_the_epoch_views(tmp_path, tiny_vit_dir, capsys, monkeypatch):
    """The same run with one view per example for every epoch: equal in the first epoch, then
    not."""
    from tunelab.core.study import Study
    from tunelab.lib.preprocess.images import ImagePreprocessor
    from tunelab.stages.train import stage as train_stage

    root = tmp_path / "s"
    write_colour_folder(root / "data", per_label=6)
    training = {"max_steps": 6, "micro_batch_size": 4, "eval_every_steps": 0}
    set_ = {f"training.{k}": v for k, v in training.items()}
    write_image_study(
        root, tiny_vit_dir, {"format": "folder", "path": "data"}, set=set_, preprocess=AUGMENT
    )
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    study = Study.open(root)

    def losses(run: Any) -> list[tuple[float, float]]:
        rows = map(json.loads, (run.dir / "metrics.jsonl").open())
        return [(r["epoch"], r["loss"]) for r in rows if r.get("loss") is not None]

    per_epoch = losses(train_stage.run(study, name="per-epoch"))
    monkeypatch.setattr(ImagePreprocessor, "train_views", lambda self, rows, encoded: None)
    one_view = losses(train_stage.run(study, name="one-view"))
    first = [k for k, (epoch, _) in enumerate(per_epoch) if epoch <= 1.0]
    assert first and len(first) < len(per_epoch)
    assert [per_epoch[k] for k in first] == [one_view[k] for k in first]
    assert per_epoch[len(first) :] != one_view[len(first) :]


# ---------------------------------------------------------------- sizing conv nets


def conv_net(kind: str):
    """A small ResNet (basic or bottleneck layers) or ConvNeXt built from a config."""
    import torch
    from transformers import (
        ConvNextConfig,
        ConvNextForImageClassification,
        ResNetConfig,
        ResNetForImageClassification,
    )

    torch.manual_seed(0)
    if kind == "convnext":
        cfg = ConvNextConfig(
            hidden_sizes=[8, 16], depths=[2, 1], num_stages=2, num_labels=3, image_size=32
        )
        return ConvNextForImageClassification(cfg).train()
    basic = kind == "resnet-basic"
    cfg = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 24] if basic else [16, 32],
        depths=[1, 2, 1] if basic else [2, 1],
        layer_type="basic" if basic else "bottleneck",
        downsample_in_first_stage=not basic,
        num_labels=3,
        image_size=40 if basic else 48,
    )
    return ResNetForImageClassification(cfg).train()


@pytest.mark.parametrize("kind", ["resnet-basic", "resnet-bottleneck", "convnext"])
@pytest.mark.parametrize("trains", ["full", "head", "last-stage", "lora"])
def test_conv_net_activations_equal_what_autograd_saves(kind, trains):
    """The walk of a conv net's feature maps predicts, byte for byte, what autograd keeps for
    backward, whatever trains: everything, the head only, the last stage, LoRA adapters."""
    import torch

    from tunelab.stages.sizing.facts import count_saved_bytes, model_facts
    from tunelab.stages.sizing.memory import Case, ModelFacts, estimate_memory

    model = conv_net(kind)
    if trains == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["pwconv1", "pwconv2"] if kind == "convnext" else ["convolution"]
        lora = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.1,
            target_modules=targets,
            modules_to_save=["classifier"],
        )
        model = get_peft_model(model, lora).train()
    else:
        for name, p in model.named_parameters():
            last = ".stages.1." in name
            p.requires_grad_(
                trains == "full" or "classifier" in name or (trains == "last-stage" and last)
            )
    facts = model_facts(model, "image", lora_rank=4, lora_dropout=0.1)
    assert ModelFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    size = facts.conv["image_size"]
    if trains == "lora" and kind != "convnext":  # LoRA inside a convolution is not walked
        assert facts.approximate
        assert estimate_memory(facts, Case(seq_len=1, micro_batch=2)).approximate
        return
    assert not facts.approximate and facts.conv["trains"]
    for batch in (2, 5):
        pixels = torch.randn(batch, 3, size, size)
        saved = count_saved_bytes(model, lambda p=pixels: model(pixel_values=p).logits)
        estimate = estimate_memory(facts, Case(seq_len=1, micro_batch=batch))
        assert estimate.activations == saved > 0 and not estimate.approximate
        assert estimate.peak_total > estimate.weights + saved
    assert estimate_memory(facts, Case(seq_len=1, micro_batch=2, precision="bf16")).approximate
