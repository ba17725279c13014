"""A user's folder of pictures as it comes: mixed modes and formats, system and hidden files,
EXIF-rotated photographs, animations, 16-bit scans, empty, truncated and oversized files.

Every odd file gets a stated treatment (read as transformers reads it, with a note) or a
located refusal with its fix, all refusals at once; never a traceback or a silent drop."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import yaml
from PIL import Image

from helpers import run_cli
from helpers.images import COLOURS, colour_image, png_bytes, write_colour_folder, write_image_study
from tunelab.stages.data.images import dhash, image_facts


def alpha_only(seed: int) -> Image.Image:
    """A picture drawn in the alpha band alone (black everywhere, opacity varies), as icons and
    exported drawings are."""
    rng = np.random.default_rng(seed)
    rgba = np.zeros((20, 24, 4), np.uint8)
    rgba[..., 3] = rng.integers(0, 256, size=(20, 24), dtype=np.uint8)
    return Image.fromarray(rgba, "RGBA")


def test_transparency_is_composited_on_white_as_transformers_converts(tmp_path, tiny_vit_dir):
    from transformers import AutoImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task

    root = write_image_study(tmp_path / "s", tiny_vit_dir, {"format": "folder", "path": "d"})
    cfg = validate_config(yaml.safe_load((root / "study.yaml").read_text()))
    processor = AutoImageProcessor.from_pretrained(tiny_vit_dir)
    pre = Preprocessor(processor, cfg, get_task(cfg, list(COLOURS)), "image")
    grey = np.asarray(colour_image(0, 3).convert("L"))
    palette = Image.fromarray(grey).convert("P", palette=Image.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    images = {
        "rgba": alpha_only(1),
        "la": Image.fromarray(np.stack([grey, 255 - grey], -1), "LA"),
        "p": palette,
        "cmyk": colour_image(2, 4).convert("CMYK"),
    }
    for name, img in images.items():
        path = tmp_path / f"{name}.{'jpg' if name == 'cmyk' else 'png'}"
        img.save(path)
        row = {"id": name, "label": "red", "image_path": str(path), "text": path.name}
        ours = pre.encode(row)["pixel_values"].numpy()
        theirs = processor(images=Image.open(path), return_tensors="np", do_convert_rgb=True)
        assert np.abs(ours - theirs["pixel_values"][0]).max() < 1e-5, name
    assert pre.describe()["steps"][0] == {"step": "convert", "mode": "RGB", "transparency": "white"}
    # two different pictures in the alpha band are different pictures (not one blank hash)
    a, b = (image_facts(png_bytes(alpha_only(s)), f"{s}.png") for s in (1, 2))
    assert a.pixel_sha256 != b.pixel_sha256 and a.dhash != b.dhash
    assert dhash(alpha_only(1)) == dhash(Image.open(tmp_path / "rgba.png"))


def exif_rotated_jpeg(img: Image.Image) -> bytes:
    """`img` stored turned a quarter, with EXIF orientation 6 (a viewer turns it back upright)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return png_bytes(img.transpose(Image.ROTATE_90), "JPEG", quality=95, exif=exif.tobytes())


def test_a_users_folder_reads_every_picture_and_states_what_it_skips(
    tmp_path, tiny_vit_dir, capsys
):
    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=6)
    (data / "red" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + b"\x00" * 20)
    (data / "red" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + b"\x00" * 20)
    (data / "green" / "notes.txt").write_text("scanned on tuesday\n")
    (data / "green" / ".thumbnails").mkdir()
    colour_image(1, 99, size=(8, 8)).save(data / "green" / ".thumbnails" / "t.png")
    (data / ".cache").mkdir()
    colour_image(0, 98).save(data / ".cache" / "x.png")
    colour_image(0, 97).save(data / "loose.png")
    colour_image(2, 96).convert("P").save(data / "blue" / "still.gif")  # one frame: read
    colour_image(2, 95).save(data / "blue" / "UPPER.JPG")
    colour_image(0, 94).save(data / "red" / "scan 2 été.png")
    upright = colour_image(1, 93, size=(30, 18))
    (data / "green" / "phone.jpg").write_bytes(exif_rotated_jpeg(upright))
    (data / "red" / "everything").symlink_to(data)  # a link back up: not read as red
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "skipped 7 entries that are not images of a label folder" in flat
    for entry in (
        "red/everything/ (a link to a folder; follow_links reads it)",
        ".cache/ (hidden)",
        "loose.png (not in a label folder)",
        "red/.DS_Store (hidden)",
        "red/Thumbs.db (system file)",
        "green/notes.txt (extension .txt)",
        "green/.thumbnails/ (hidden)",
    ):
        assert entry in flat, entry
    assert "green/phone.jpg (orientation 6)" in flat
    snap = next((root / "records" / "data").iterdir())
    manifest = json.loads((snap / "manifest.json").read_text())
    files = {f["path"] for f in manifest["source"]["files"]}
    assert {"blue/still.gif", "blue/UPPER.JPG", "red/scan 2 été.png", "green/phone.jpg"} <= files
    assert not any(".thumbnails" in f or f.startswith(".cache") for f in files)
    assert any("skipped 7 entries" in n for n in manifest["notes"])
    assert not any(f.startswith("red/everything") for f in files)
    facts = image_facts(exif_rotated_jpeg(upright), "phone.jpg")
    assert (facts.width, facts.height, facts.orientation) == (30, 18, 6)


def bomb_png() -> bytes:
    """A real small PNG whose header claims 20000 x 20000 pixels (over Pillow's limit)."""
    raw = png_bytes(colour_image(0, 1))
    body = bytearray(raw[16:29])
    body[0:8] = struct.pack(">II", 20000, 20000)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(body)) & 0xFFFFFFFF)
    return raw[:16] + bytes(body) + crc + raw[33:]


def test_every_unusable_file_is_named_with_its_fix_at_once(tmp_path, tiny_vit_dir, capsys):
    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=4)
    (data / "red" / "empty.png").write_bytes(b"")
    whole = (data / "red" / "1.png").read_bytes()
    (data / "red" / "cut.png").write_bytes(whole[: len(whole) // 2])
    frames = [colour_image(1, i).convert("P") for i in range(3)]
    frames[0].save(data / "green" / "anim.gif", save_all=True, append_images=frames[1:])
    deep = np.arange(20 * 24, dtype=np.uint16).reshape(20, 24) * 100
    Image.fromarray(deep).save(data / "blue" / "deep.png")  # 16-bit grey: mode I;16
    (data / "blue" / "bomb.png").write_bytes(bomb_png())
    (data / "blue" / "gone.png").symlink_to(data / "blue" / "nowhere.png")
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    run_cli(capsys, "register", "-s", root)
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 2 and "Traceback" not in err
    flat = " ".join(err.split())
    assert "6 image files cannot be used" in flat
    for expected in (
        "red/empty.png: an empty file (0 bytes)",
        "red/cut.png: not a readable image, cut short or damaged",
        "green/anim.gif: an animated GIF of 3 frames",
        "blue/deep.png: mode 'I;16' (PNG) does not convert to 8-bit RGB faithfully",
        "blue/bomb.png: too large to decode safely",
        "blue/gone.png: cannot be read",
    ):
        assert expected in flat, expected
    assert flat.count("fix:") == 6 and "then run `tunelab data` again" in flat
    assert "BytesIO" not in flat
    assert not (root / "records" / "data").exists() or not any(
        (root / "records" / "data").iterdir()
    )


def test_image_duplicates_are_told_in_image_terms(tmp_path, tiny_vit_dir, capsys):
    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=6)
    (data / "green" / "same.png").write_bytes((data / "red" / "0.png").read_bytes())
    write_image_study(root, tiny_vit_dir, {"format": "folder", "path": "data"})
    run_cli(capsys, "register", "-s", root)
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "near = dHash similarity >= 0.95, at most 3 of 64 bits apart" in flat
    assert "identical or near-identical images carry different labels" in flat
    assert "move each image to its category's folder" in flat
    assert "Jaccard" not in flat and "shingle" not in flat and "cleaning rule" not in flat


def test_the_exported_processor_gives_the_training_pixels_on_any_mode(
    tmp_path, tiny_vit_dir, capsys
):
    """The card's loading recipe (AutoImageProcessor on the export's tokenizer folder) gives
    the pixel values training read, for grey and transparent pictures and the study's own
    mean and std; a chain the processor's form cannot hold is said, not silently different."""
    from transformers import AutoImageProcessor

    from tunelab.core.config import validate_config
    from tunelab.lib.preprocess.images import processor_config_for, processor_gap, resolve_chain
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.export import check_export

    root = tmp_path / "s"
    data = write_colour_folder(root / "data", per_label=8)
    colour_image(0, 77).convert("L").save(data / "red" / "grey.png")
    own = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.6, 0.7]}
    write_image_study(
        root, tiny_vit_dir, {"format": "folder", "path": "data"}, preprocess={"image": own}
    )
    for args in (["register"], ["data"], ["baseline"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "v1", "--json")
    run_id = json.loads(out[out.find("{") :])["run_id"]
    assert run_cli(capsys, "eval", run_id, "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "export", run_id, "-s", root)
    assert code == 0, err
    export = next((root / "records" / "exports").iterdir())
    manifest = json.loads((export / "tunelab-manifest.json").read_text())
    assert manifest["limitations_detail"]["processor"]["matches"] is True
    assert "pixel_values are the training transforms'" in (export / "README.md").read_text()
    cfg = validate_config(yaml.safe_load((root / "study.yaml").read_text()))
    theirs = AutoImageProcessor.from_pretrained(export / "tokenizer")
    pre = Preprocessor(
        AutoImageProcessor.from_pretrained(tiny_vit_dir), cfg, get_task(cfg, list(COLOURS)), "image"
    )
    alpha_only(5).save(tmp_path / "icon.png")
    for path in (data / "red" / "grey.png", tmp_path / "icon.png"):
        ours = pre.encode({"id": "x", "label": "red", "image_path": str(path), "text": "x"})
        got = theirs(images=Image.open(path), return_tensors="np")["pixel_values"][0]
        assert np.abs(ours["pixel_values"].numpy() - got).max() < 1e-5, path.name
    result = check_export(export, tiny_vit_dir)
    assert result["processor"]["matches"] and result["example"]["matches_recorded"]
    code, out, err = run_cli(capsys, "check-export", str(export), "--base", str(tiny_vit_dir))
    assert code == 0, err
    assert "gives the training transforms' pixel values" in " ".join(out.split())
    # ConvNeXt's processor holds no square resize: the gap is measured and named, not hidden
    from transformers import ConvNextImageProcessor

    convnext = ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.875)
    resized = cfg.preprocess.image.model_copy(update={"resize": 20})
    study = cfg.model_copy(
        update={"preprocess": cfg.preprocess.model_copy(update={"image": resized})}
    )
    chain = resolve_chain(convnext, study)
    convnext.save_pretrained(tmp_path / "p")
    path = tmp_path / "p" / "preprocessor_config.json"
    path.write_text(json.dumps(processor_config_for(json.loads(path.read_text()), chain, resized)))
    gap = processor_gap(AutoImageProcessor.from_pretrained(tmp_path / "p"), chain, None)
    assert not gap["matches"] and "ConvNextImageProcessor" in gap["error"]
    from tunelab.stages.export.limitations import limitation_lines

    (line,) = limitation_lines({"processor": gap, "verify": {"passed": True}})
    assert "does not give the training transforms' pixel values" in line


def test_thumbnails_show_the_picture_the_model_reads(tmp_path):
    """Inspect's and the dossier's thumbnails: transparency on white (a picture in the alpha
    band is not a black square) and upright by the EXIF orientation."""
    import hashlib
    import io

    from tunelab.stages.inspect.images import thumbnail_png
    from tunelab.stages.report.sections.flipped_images import _thumbnail

    shown = np.asarray(Image.open(io.BytesIO(thumbnail_png(alpha_only(3)))))
    assert shown.std() > 10  # the drawing, not one flat colour
    data = exif_rotated_jpeg(colour_image(1, 93, size=(30, 18)))
    name = f"images/{hashlib.sha256(data).hexdigest()}.jpg"
    (tmp_path / "images").mkdir()
    (tmp_path / name).write_bytes(data)
    thumb = Image.open(io.BytesIO(_thumbnail(tmp_path, name)))
    assert thumb.width > thumb.height  # 30 x 18 upright, not the stored 18 x 30


def test_inspect_help_says_what_it_stops_on_for_images(capsys):
    code, out, err = run_cli(capsys, "inspect", "--help")
    assert code == 0
    assert "an image that does not convert faithfully" in " ".join(out.split())


def test_a_path_column_names_the_line_and_the_file(tmp_path, tiny_vit_dir, capsys):
    root = tmp_path / "s"
    data = write_colour_folder(root / "pics", per_label=3)
    (data / "red" / "empty.png").write_bytes(b"")
    rows = [
        {"path": f"pics/{p.parent.name}/{p.name}", "label": p.parent.name}
        for p in sorted(data.rglob("*.png"))
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {"format": "jsonl", "path": "data.jsonl"}
    write_image_study(root, tiny_vit_dir, source, set={"data.fields": {"image": "path"}})
    run_cli(capsys, "register", "-s", root)
    code, out, err = run_cli(capsys, "data", "-s", root)
    line = 1 + [r["path"] for r in rows].index("pics/red/empty.png")
    assert code == 2
    assert f"data.jsonl line {line} (field 'path': pics/red/empty.png): an empty file" in err
