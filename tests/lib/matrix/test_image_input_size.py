"""An image processor whose output the model cannot take is refused at `validate` and `inspect`
(exit 2), naming both sizes and the setting to change: a DeiT folder whose processor crops to
224 for a 32-pixel model, a `preprocess.image` override, a processor from another checkpoint.
Models that interpolate their position embeddings (DINOv2) or pool convolutions (ConvNeXt)
take any size and are not refused: the check is the model's own forward on the meta device,
and it agrees with the real forward."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from helpers import run_cli
from helpers.images import write_colour_folder, write_image_study
from tunelab.lib.models.tiny_families import save_family
from tunelab.lib.models.vision import refused_input_size


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Tiny vit, deit, dinov2, convnext folders (32-pixel models with 32-pixel processors)."""
    root = tmp_path_factory.mktemp("image-families")
    return {n: save_family(n, root / n) for n in ("vit", "deit", "dinov2", "convnext")}


def _with_processor(src, dst, processor):
    shutil.copytree(src, dst)
    processor.save_pretrained(dst)
    return dst


def _study(tmp_path, model_dir, **image):
    root = tmp_path / "study"
    write_colour_folder(root / "data", per_label=3)
    sections = {"preprocess": {"image": image}} if image else {}
    write_image_study(root, model_dir, {"format": "folder", "path": "data"}, **sections)
    return root


@pytest.mark.parametrize("name", ["vit", "deit", "dinov2", "convnext"])
def test_the_meta_check_agrees_with_the_real_forward(family_dirs, name):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(family_dirs[name]).eval()
    for side in (32, 224):
        refused = refused_input_size(family_dirs[name], side, side)
        try:
            with torch.no_grad():
                model(pixel_values=torch.zeros(1, 3, side, side))
            takes = True
        except ValueError:
            takes = False
        assert (refused is None) == takes, (name, side, refused)
    # the fixed-size families refuse 224, the interpolating and convolutional ones take it
    assert (refused_input_size(family_dirs[name], 224, 224) is None) == (
        name in ("dinov2", "convnext")
    )


def test_a_deit_processor_cropping_to_224_is_refused_at_validate_and_inspect(
    tmp_path, family_dirs, capsys
):
    from transformers import DeiTImageProcessor

    model = _with_processor(family_dirs["deit"], tmp_path / "deit-224", DeiTImageProcessor())
    root = _study(tmp_path, model)
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 2, out + err
    flat = " ".join(err.split())
    assert "224x224" in flat and "the model takes 32x32" in flat, flat
    assert "preprocessor_config.json: resize height 256, width 256; center_crop height 224" in flat
    assert "preprocess.image.resize: 32 and preprocess.image.crop: 32" in flat
    assert "Input image size (224*224) doesn't match model (32*32)" in flat
    for args in (["register"], ["data"]):
        assert run_cli(capsys, *args, "-s", root)[0] == 0, args
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--per-category", "1")
    assert code == 2, out + err
    flat = " ".join(err.split())
    assert "(image_size)" in flat and "224x224" in flat and "32x32" in flat, flat
    assert "preprocess.image.resize: 32" in flat
    # the override the message names makes the same folder pass
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["preprocess"] = {"image": {"resize": 32, "crop": 32}}
    (root / "study.yaml").write_text(yaml.safe_dump(raw))
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 0, err


def test_an_override_the_model_cannot_take_is_refused_naming_it(tmp_path, family_dirs, capsys):
    root = _study(tmp_path, family_dirs["vit"], resize=24)
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 2
    flat = " ".join(err.split())
    assert "24x24 pixel values (from preprocess.image resize 24)" in flat, flat
    assert "the model takes 32x32" in flat


def test_a_processor_from_another_checkpoint_is_refused(
    tmp_path, family_dirs, tiny_vit_dir, capsys
):
    """The 32-pixel ViT folder carrying the 16-pixel tiny ViT's preprocessor_config.json."""
    from transformers import AutoImageProcessor

    other = AutoImageProcessor.from_pretrained(tiny_vit_dir)
    model = _with_processor(family_dirs["vit"], tmp_path / "vit-other", other)
    code, out, err = run_cli(capsys, "validate", "-s", _study(tmp_path, model))
    assert code == 2
    flat = " ".join(err.split())
    assert "16x16" in flat and "the model takes 32x32" in flat, flat


def test_an_interpolating_model_is_not_refused_any_size(tmp_path, family_dirs, capsys):
    from transformers import BitImageProcessor

    model = _with_processor(family_dirs["dinov2"], tmp_path / "dinov2-224", BitImageProcessor())
    code, out, err = run_cli(capsys, "validate", "-s", _study(tmp_path, model))
    assert code == 0, err
