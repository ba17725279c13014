"""image_classification from `datasets` data sets: an Image column saved with save_to_disk
(hf_disk) or in a hub data set read offline from a hub cache; Datasets built in-process from
PIL images of mixed modes, with a corrupt one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from helpers import run_cli
from helpers.images import COLOURS, colour_image, png_bytes, write_image_study
from tunelab.core.errors import DataError

datasets = pytest.importorskip("datasets")

NAMES = list(COLOURS)  # ClassLabel names: red, green, blue
MODES = ("RGB", "L", "P", "RGBA")


def colour_rows(lo: int, n: int) -> tuple[list, list[int]]:
    """n images (modes cycling through MODES) and their ClassLabel ids."""
    images, labels = [], []
    for i in range(lo, lo + n):
        label = i % 3
        img = colour_image(label, 1000 + i, size=(20 + i % 5, 18))
        images.append(img.convert(MODES[i % len(MODES)]))
        labels.append(label)
    return images, labels


def colour_dataset(lo: int, n: int, label_feature=None) -> datasets.Dataset:
    images, labels = colour_rows(lo, n)
    feature = label_feature or datasets.ClassLabel(names=NAMES)
    features = datasets.Features(
        {"img": datasets.Image(), "colour": feature, "caption": datasets.Value("string")}
    )
    if isinstance(feature, datasets.Value) and feature.dtype == "string":
        labels = [NAMES[k] for k in labels]
    captions = [f"picture {i}" for i in range(lo, lo + n)]
    return datasets.Dataset.from_dict(
        {"img": images, "colour": labels, "caption": captions}, features=features
    )


def image_dataset_study(root: Path, model_dir: Path, source: dict, **fields) -> Path:
    fields = {"image": "img", "label": "colour", **fields}
    return write_image_study(root, model_dir, source, set={"data.fields": fields})


def test_saved_dataset_dict_is_a_snapshot_of_its_image_bytes(tmp_path, tiny_vit_dir, capsys):
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.data import stage as data_stage

    root = tmp_path / "s"
    parts = {"train": colour_dataset(0, 24), "validation": colour_dataset(24, 9)}
    parts["test"] = colour_dataset(33, 9)
    datasets.DatasetDict(parts).save_to_disk(str(root / "colours"))
    image_dataset_study(
        root, tiny_vit_dir, {"format": "hf_disk", "path": "colours"}, split="__split__"
    )
    study = Study.open(root)
    manifest = data_stage.run(study)
    assert manifest["splits"]["method"] == "column"
    assert manifest["counts"]["final"] == {"train": 24, "validation": 9, "test": 9}
    assert manifest["labels"] == sorted(NAMES)  # the ClassLabel's names, not "0", "1", "2"
    snap = load_snapshot(study)
    train = snap.rows("train")
    want = parts["train"].cast_column("img", datasets.Image(decode=False))
    for row, stored in zip(train, want, strict=True):
        data = stored["img"]["bytes"]  # the Image feature's bytes are what the snapshot keeps
        assert row["image_sha256"] == hashlib.sha256(data).hexdigest()
        assert Path(row["image_path"]).read_bytes() == data
        assert row["label"] == NAMES[stored["colour"]]
    facts = [json.loads(x) for x in (snap.dir / "images.jsonl").read_text().splitlines()]
    assert {f["mode"] for f in facts} == set(MODES)
    assert train[5]["text"] == "colours[train] row 5"
    # the later stages read the stored images: inspect shows the chain per category
    code, out, err = run_cli(capsys, "inspect", "-s", root)
    assert code == 0, err
    assert "RGBA" in out and "red" in out


def test_hub_data_set_with_an_image_column_and_string_labels(tmp_path, tiny_vit_dir, monkeypatch):
    from tunelab.core.hub_cache import write_snapshot
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.data import stage as data_stage

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    folder = tmp_path / "colours-repo"
    (folder / "data").mkdir(parents=True)
    for split, (lo, n) in {"train": (0, 18), "validation": (18, 6), "test": (24, 6)}.items():
        ds = colour_dataset(lo, n, datasets.Value("string"))
        ds.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text("# colours\n")
    commit = "c" * 40
    write_snapshot(folder, "tunelab-test/colours", repo_type="dataset", commit=commit)
    root = image_dataset_study(
        tmp_path / "s",
        tiny_vit_dir,
        {"format": "hub", "name": "tunelab-test/colours"},
        split="__split__",
    )
    study = Study.open(root)
    manifest = data_stage.run(study)
    assert manifest["source"]["hub"]["commit"] == commit
    assert manifest["counts"]["final"] == {"train": 18, "validation": 6, "test": 6}
    validation = load_snapshot(study).rows("validation")
    assert [r["label"] for r in validation] == [NAMES[i % 3] for i in range(18, 24)]
    assert validation[0]["text"] == "tunelab-test/colours[validation] row 0"


def saved(tmp_path: Path, ds: datasets.Dataset) -> Path:
    ds.save_to_disk(str(tmp_path / "s" / "colours"))
    return tmp_path / "s"


def test_a_corrupt_image_names_the_data_set_column_and_row(tmp_path, tiny_vit_dir, capsys):
    images, labels = colour_rows(0, 6)
    values = [{"bytes": png_bytes(img), "path": None} for img in images]
    values[3] = {"bytes": png_bytes(images[3])[:40], "path": None}  # cut short
    features = datasets.Features(
        {"img": datasets.Image(), "colour": datasets.ClassLabel(names=NAMES)}
    )
    ds = datasets.Dataset.from_dict({"img": values, "colour": labels}, features=features)
    root = image_dataset_study(
        saved(tmp_path, ds), tiny_vit_dir, {"format": "hf_disk", "path": "colours"}
    )
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 2, err
    assert "colours row 3 (column 'img', image): not a readable image" in err
    assert "hint:" in err and "Traceback" not in err
    assert not (root / "records" / "data").exists() or not any(
        (root / "records" / "data").iterdir()
    )


@pytest.mark.parametrize(
    ("fields", "label_feature", "message", "hint"),
    [
        ({"image": "picture"}, None, "colours: no column 'picture' for field 'image'", "'img'"),
        ({"image": "caption"}, None, "column 'caption' (field image) is Value(string)", "'img'"),
        (
            {},
            datasets.Value("int64"),
            "column 'colour' (field label) holds int64 values without names",
            "ClassLabel",
        ),
        ({"label": "nope"}, None, "colours: no column 'nope' for field 'label'", "data.fields"),
    ],
)
def test_bad_columns_are_named(tmp_path, tiny_vit_dir, fields, label_feature, message, hint):
    from tunelab.core.study import Study
    from tunelab.stages.data import stage as data_stage

    root = saved(tmp_path, colour_dataset(0, 6, label_feature))
    image_dataset_study(root, tiny_vit_dir, {"format": "hf_disk", "path": "colours"}, **fields)
    with pytest.raises(DataError) as exc:
        data_stage.run(Study.open(root))
    assert message in exc.value.message and hint in exc.value.hint


def test_an_unlabelled_row_and_a_path_outside_are_refused(tmp_path, tiny_vit_dir):
    from tunelab.core.study import Study
    from tunelab.stages.data import stage as data_stage

    images, _ = colour_rows(0, 3)
    features = datasets.Features(
        {"img": datasets.Image(), "colour": datasets.ClassLabel(names=NAMES)}
    )
    ds = datasets.Dataset.from_dict({"img": images, "colour": [0, -1, 2]}, features=features)
    root = image_dataset_study(
        saved(tmp_path, ds), tiny_vit_dir, {"format": "hf_disk", "path": "colours"}
    )
    with pytest.raises(DataError, match=r"colours row 1 \(column 'colour', label\): -1 is not"):
        data_stage.run(Study.open(root))

    # Image values that hold only a path (save_to_disk would embed the bytes: save a struct of
    # bytes and path, then declare it an Image): inside the folder read, outside refused
    struct = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    paths = [{"bytes": None, "path": "inside.png"}, {"bytes": None, "path": "../outside.png"}]
    ds = datasets.Dataset.from_dict({"img": paths, "colour": [0, 1]})
    ds = ds.cast(datasets.Features({"img": struct, "colour": features["colour"]}))
    root = saved(tmp_path / "b", ds)
    images[0].save(root / "colours" / "inside.png")
    images[1].save(root / "outside.png")
    info = root / "colours" / "dataset_info.json"
    meta = json.loads(info.read_text())
    meta["features"]["img"] = {"_type": "Image"}
    info.write_text(json.dumps(meta))
    image_dataset_study(root, tiny_vit_dir, {"format": "hf_disk", "path": "colours"})
    with pytest.raises(DataError, match=r"colours row 1 .*only the path '../outside.png'"):
        data_stage.run(Study.open(root))
