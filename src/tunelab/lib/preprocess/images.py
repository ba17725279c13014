"""Image transforms: the chain from an image file to the `pixel_values` a model reads.

The deterministic chain (every split, evaluation included): convert to RGB (as transformers'
`convert_to_rgb`: transparency composited onto white) -> resize -> center crop (when set) -> rescale to [0, 1] -> normalize with the mean and std. Sizes, statistics and
the resampling filter come from the base's image processor unless `preprocess.image` sets them.
Training examples may first pass a seeded augmentation (`preprocess.image.train_random_crop`,
`train_flip`): a new random view of each example every epoch, drawn from `training.seed`, the
epoch and the example id, so a rerun, and a resumed run, see the same views. Evaluation never
augments (`encode` is the deterministic chain; only `encode_train` augments).

`ImagePreprocessor` has the interface of `tunelab.lib.preprocess.text.Preprocessor` (`Preprocessor(...)`
returns one for an `image` architecture): `encode`, `encode_train`, `check`, `find_problems`, `describe`,
`template_sha256` (the chain's recipe, recorded in runs and checked by evaluation).

`encode(example) -> {"id", "pixel_values": Tensor [3, H, W], "label"}`, `encode_train(example,
epoch=0)`, `train_views(rows, encoded)` (`view(i, epoch)`, or None when nothing augments),
`chain` (`Chain`: `steps(train)`). An export's `tokenizer/preprocessor_config.json` is set to
the chain (`processor_config_for`) and measured by `processor_gap(processor, chain, image) ->
{matches, max_abs_diff, error}` (export's `limitations_detail.processor`, check-export's
`processor`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tunelab.core.config import StudyConfig
from tunelab.core.errors import PreprocessError
from tunelab.core.hashing import sha256_json, stable_u64
from tunelab.lib.preprocess.decode import ACCEPTED_MODES, model_rgb, open_image
from tunelab.lib.preprocess.problems import Problem, _problem, raise_problems

RECIPE_VERSION = 3  # raised when a rule changes the pixels, so stored recipes stop matching
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class Chain:
    """The transform settings, resolved from the processor and `preprocess.image`."""

    height: int
    width: int
    shortest_edge: int | None  # resize keeping the aspect ratio (then crop), else exact size
    crop: tuple[int, int] | None
    resample: int
    rescale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_random_crop: float | None
    train_flip: bool

    def steps(self, train: bool = False) -> list[dict[str, Any]]:
        """The steps in order, with their settings (what inspect prints and the recipe hashes)."""
        out: list[dict[str, Any]] = [{"step": "convert", "mode": "RGB", "transparency": "white"}]
        if train and self.train_random_crop:
            out.append({"step": "random_crop", "share": self.train_random_crop, "train_only": True})
        if train and self.train_flip:
            out.append({"step": "random_flip", "p": 0.5, "train_only": True})
        resize = (
            {"shortest_edge": self.shortest_edge}
            if self.shortest_edge
            else {"height": self.height, "width": self.width}
        )
        out.append({"step": "resize", **resize, "resample": _RESAMPLE_NAMES.get(self.resample)})
        if self.crop:
            out.append({"step": "center_crop", "height": self.crop[0], "width": self.crop[1]})
        out.append({"step": "rescale", "factor": self.rescale})
        out.append({"step": "normalize", "mean": list(self.mean), "std": list(self.std)})
        return out


def _size_of(value: Any) -> tuple[int | None, int | None, int | None]:
    """(height, width, shortest_edge) of a processor's size setting."""
    if isinstance(value, int):
        return value, value, None
    if value is not None and not isinstance(value, dict):  # transformers' SizeDict
        value = {k: getattr(value, k) for k in ("height", "width", "shortest_edge")}
        value = {k: v for k, v in value.items() if v is not None}
    if isinstance(value, dict):
        if "height" in value and "width" in value:
            return int(value["height"]), int(value["width"]), None
        if "shortest_edge" in value:
            s = int(value["shortest_edge"])
            return s, s, s
    return None, None, None


def resolve_chain(processor: Any, cfg: StudyConfig) -> Chain:
    """The chain for this base's processor and the study's `preprocess.image`."""
    own = cfg.preprocess.image
    height, width, shortest = _size_of(getattr(processor, "size", None))
    if own and own.resize:
        height, width, shortest = own.resize, own.resize, None
    if height is None or width is None:
        raise PreprocessError(
            f"the image processor ({type(processor).__name__}) gives no image size",
            hint="set preprocess.image.resize in study.yaml",
        )
    crop = None
    if getattr(processor, "do_center_crop", False):
        ch, cw, _ = _size_of(getattr(processor, "crop_size", None))
        crop = (ch, cw) if ch and cw else None
    crop_pct = getattr(processor, "crop_pct", None)
    if shortest and crop_pct and not (own and own.resize):
        # ConvNeXt's processor (also ResNet's checkpoints): below 384 the shortest edge goes
        # to edge / crop_pct, then the centre edge x edge; from 384 on a square warp
        if shortest < 384:
            crop, shortest = (shortest, shortest), int(shortest / float(crop_pct))
        else:
            shortest = None
    if own and own.crop:
        crop = (own.crop, own.crop)
    mean = own.mean if own and own.mean else getattr(processor, "image_mean", None)
    std = own.std if own and own.std else getattr(processor, "image_std", None)
    if not getattr(processor, "do_normalize", True) and not (own and own.mean):
        mean, std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
    mean, std = list(mean or [0.0, 0.0, 0.0]), list(std or [1.0, 1.0, 1.0])
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise PreprocessError(
            f"image mean {mean} / std {std}: need 3 values each, std above 0",
            hint="fix preprocess.image.mean and std (one value per RGB channel)",
        )
    rescale = getattr(processor, "rescale_factor", 1 / 255)
    if not getattr(processor, "do_rescale", True):
        rescale = 1.0
    resample = getattr(processor, "resample", 2)
    return Chain(
        height=height,
        width=width,
        shortest_edge=shortest,
        crop=crop,
        resample=int(resample if resample is not None else 2),
        rescale=float(rescale),
        mean=tuple(float(x) for x in mean),
        std=tuple(float(x) for x in std),
        train_random_crop=own.train_random_crop if own else None,
        train_flip=bool(own.train_flip) if own else False,
    )


def _center_crop(img: Any, height: int, width: int) -> Any:
    left = max(0, (img.width - width) // 2)
    top = max(0, (img.height - height) // 2)
    return img.crop((left, top, left + width, top + height))


def apply_chain(
    img: Any, chain: Chain, rng: random.Random | None = None, trace: list | None = None
):
    """pixel_values [3, H, W] float32 (numpy) of a Pillow image; `rng` turns on the training
    augmentation. `trace`, when given, receives (step, size, mode) after each step."""

    def note(step: str, im: Any, **extra: Any) -> None:
        if trace is not None:
            trace.append({"step": step, "size": [im.width, im.height], "mode": im.mode, **extra})

    img = model_rgb(img)
    note("convert", img)
    if rng is not None and chain.train_random_crop:
        side = max(1, round(min(img.width, img.height) * chain.train_random_crop))
        left = rng.randint(0, img.width - side)
        top = rng.randint(0, img.height - side)
        img = img.crop((left, top, left + side, top + side))
        note("random_crop", img, box=[left, top, left + side, top + side])
    if rng is not None and chain.train_flip:
        flipped = rng.random() < 0.5
        if flipped:
            img = img.transpose(0)  # Image.FLIP_LEFT_RIGHT
        note("random_flip", img, flipped=flipped)
    if chain.shortest_edge:
        edge = chain.shortest_edge  # the long side truncated, as transformers computes it
        if img.width <= img.height:
            w, h = edge, int(edge * img.height / img.width)
        else:
            w, h = int(edge * img.width / img.height), edge
        img = img.resize((w, h), chain.resample)
    else:
        img = img.resize((chain.width, chain.height), chain.resample)
    note("resize", img)
    if chain.crop:
        img = _center_crop(img, *chain.crop)
        note("center_crop", img)
    arr = np.asarray(img, dtype=np.float32) * chain.rescale  # [H, W, 3]
    arr = (arr - np.array(chain.mean, np.float32)) / np.array(chain.std, np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))  # [3, H, W]


def example_rng(seed: int, example_id: str, epoch: int = 0) -> random.Random:
    """The augmentation's generator of one example in one epoch: fixed by the seed, the epoch
    and the id (epoch 0's key is the seed and the id alone)."""
    key = f"{seed}:{example_id}" if epoch == 0 else f"{seed}:{epoch}:{example_id}"
    return random.Random(stable_u64(key))


def open_example_image(example: dict[str, Any]) -> Any:
    """The Pillow image of a snapshot example (`image_path`, set when the snapshot is read)."""
    path = example.get("image_path")
    if not path:
        raise PreprocessError(
            f"example {example.get('id')!r} has no image (image_path)",
            hint="image examples come from a snapshot of an image_classification study "
            "(`tunelab data`)",
        )
    with open(path, "rb") as f:
        data = f.read()
    return open_image(data, f"{path} (example {example.get('id')})")


class ImagePreprocessor:
    """The image chain behind the Preprocessor interface (see the module docstring)."""

    def __init__(self, tokenizer: Any, cfg: StudyConfig, task: Any, architecture: str):
        if getattr(task, "modality", None) != "image":
            raise PreprocessError(
                f"an image model can only do image_classification, the task is {task.kind!r}",
                hint="set task.kind: image_classification, or use a text model",
            )
        self.tokenizer = tokenizer  # the image processor
        self.cfg = cfg.preprocess
        self.task = task
        self.architecture = architecture
        self.seed = cfg.training.seed
        self.notes: list[str] = []
        self.eos_id = self.eos_token = None
        self.pad_id = 0
        self.chain = resolve_chain(tokenizer, cfg)
        self.template_sha256 = sha256_json(self.recipe())

    def recipe(self) -> dict[str, Any]:
        """What evaluation applies (the deterministic chain): the template sha256 hashes it;
        training's augmentation is hashed apart (`augmentation_sha256`), so variants that
        augment differently are evaluated, and compared, by one procedure."""
        return {
            "version": RECIPE_VERSION,
            "kind": "image",
            "processor": type(self.tokenizer).__name__,
            "steps": self.chain.steps(train=False),
        }

    def describe(self) -> dict[str, Any]:
        train_steps = self.chain.steps(train=True)
        return {
            "template_sha256": self.template_sha256,
            "kind": "image",
            "steps": self.chain.steps(train=False),
            "train_steps": train_steps,
            "augmentation_sha256": sha256_json(
                {"steps": train_steps, "seed": self.seed, "views": "per epoch"}
            ),
            "notes": list(self.notes),
        }

    def _encode(self, example: dict[str, Any], train: bool, epoch: int = 0) -> dict[str, Any]:
        import torch

        img = open_example_image(example)
        if img.mode not in ACCEPTED_MODES:
            raise PreprocessError(
                f"example {example.get('id')!r} ({example.get('text')}): image mode {img.mode!r} "
                "does not convert to RGB faithfully",
                hint=f"convert the file to one of {', '.join(ACCEPTED_MODES)} (8 bits per "
                "channel), then `tunelab data`",
            )
        rng = example_rng(self.seed, str(example["id"]), epoch) if train else None
        pixels = apply_chain(img, self.chain, rng)
        label = self.task.label_to_index.get(str(example.get("label")), -1)
        return {"id": example["id"], "pixel_values": torch.from_numpy(pixels), "label": label}

    def encode(self, example: dict[str, Any]) -> dict[str, Any]:
        """The deterministic chain: {"id", "pixel_values": [3, H, W] float32, "label": int}."""
        return self._encode(example, train=False)

    def encode_train(self, example: dict[str, Any], epoch: int = 0) -> dict[str, Any]:
        """The training form in `epoch`: the seeded augmentation first, when configured."""
        return self._encode(example, train=True, epoch=epoch)

    def train_views(
        self, rows: Sequence[dict[str, Any]], encoded: Sequence[dict[str, Any]]
    ) -> Callable[[int, int], dict[str, Any]] | None:
        """`view(i, epoch)`: training example i as augmented in that epoch (epoch 0: `encoded`,
        its `encode_train`s); None when nothing augments (every epoch sees `encoded`)."""
        if not (self.chain.train_random_crop or self.chain.train_flip):
            return None

        def view(i: int, epoch: int) -> dict[str, Any]:
            return encoded[i] if epoch == 0 else self.encode_train(rows[i], epoch)

        return view

    def find_problems(self, encoded: Sequence[dict[str, Any]]) -> list[Problem]:
        out = []
        for e in encoded:
            if e["label"] < 0:
                out.append(_problem(e["id"], "no_label", "the label is not in the label set"))
            if not bool(torch_isfinite(e["pixel_values"])):
                out.append(
                    Problem(
                        str(e["id"]),
                        "non_finite_pixels",
                        "pixel_values hold NaN or infinity",
                        "check preprocess.image.std (no zero) and the image file",
                    )
                )
        return out

    def check(self, encoded: Sequence[dict[str, Any]]) -> None:
        raise_problems(self.find_problems(encoded))


def torch_isfinite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


# ---------------------------------------------------------------- the exported processor

PROCESSOR_ATOL = 1e-5


def processor_config_for(base_config: dict[str, Any], chain: Chain, own: Any) -> dict[str, Any]:
    """The base's preprocessor_config.json set to what the chain applies, for an export: RGB
    conversion on (transformers' processors leave grey, palette and RGBA images unconverted
    unless told), the chain's mean, std and rescale, and the study's own resize and crop
    (`own`: preprocess.image) where the processor's form holds them."""
    out = dict(base_config)
    out.update(
        do_convert_rgb=True,
        do_rescale=True,
        rescale_factor=chain.rescale,
        do_normalize=True,
        image_mean=list(chain.mean),
        image_std=list(chain.std),
    )
    if own is not None and own.resize:
        out.update(do_resize=True, size={"height": own.resize, "width": own.resize})
        out.pop("crop_pct", None)
    if own is not None and own.crop:
        out.update(do_center_crop=True, crop_size={"height": own.crop, "width": own.crop})
    return out


def _probe_images(example_image: Any | None) -> list[Any]:
    """The images the exported processor is checked on: the export's example, and a picture
    with transparency on a palette-free odd-sized canvas (the conversion and the resize)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, size=(23, 37, 4), dtype=np.uint8)
    probes = [Image.fromarray(rgba, "RGBA")]
    return ([example_image] if example_image is not None else []) + probes


def processor_gap(processor: Any, chain: Chain, example_image: Any | None) -> dict[str, Any]:
    """How far `processor(images=...)` is from the chain's pixel values on the probe images:
    {matches, max_abs_diff, error}; error names what the processor raised or a shape apart."""
    gap, error = 0.0, None
    for img in _probe_images(example_image):
        ours = apply_chain(img, chain)
        try:
            theirs = processor(images=img, return_tensors="np")["pixel_values"][0]
        except Exception as exc:  # noqa: BLE001 - any processor failure is the finding
            error = f"{type(processor).__name__} raised {type(exc).__name__}: {exc}"
            break
        if theirs.shape != ours.shape:
            error = f"{type(processor).__name__} gives {list(theirs.shape)}, the chain {list(ours.shape)}"
            break
        gap = max(gap, float(np.abs(theirs - ours).max()))
    matches = error is None and gap <= PROCESSOR_ATOL
    return {"matches": matches, "max_abs_diff": None if error else gap, "error": error}


# ---------------------------------------------------------------- the size the model takes


def chain_output_size(chain: Chain) -> tuple[int, int]:
    """(height, width) of the chain's pixel values for a square image (the chain itself run)."""
    from PIL import Image

    pixels = apply_chain(Image.new("RGB", (97, 97)), chain)
    return int(pixels.shape[1]), int(pixels.shape[2])


def _size_source(chain: Chain, own: Any, model_dir: Any) -> str:
    """Which setting made the chain's output size: the study's override or the processor."""
    if own is not None and (own.resize or own.crop):
        set_ = [f"{k} {getattr(own, k)}" for k in ("resize", "crop") if getattr(own, k)]
        return "preprocess.image " + ", ".join(set_)
    steps = [s for s in chain.steps() if s["step"] in ("resize", "center_crop")]
    said = "; ".join(
        s["step"] + " " + ", ".join(f"{k} {v}" for k, v in s.items() if k in _SIZE_KEYS)
        for s in steps
    )
    return f"the image processor of {model_dir} (preprocessor_config.json: {said})"


_SIZE_KEYS = ("height", "width", "shortest_edge")


def input_size_problem(
    chain: Chain, own: Any, model_dir: Any, size: tuple[int, int] | None = None
) -> tuple[str, str] | None:
    """(why, fix) when the model of `model_dir` cannot take the chain's pixel values (`size`: [H, W] of a
    transformed image; the chain's output for a square image when not given), naming both
    sizes and the setting to change; None when it takes them (the model's own input check,
    `tunelab.lib.models.vision.refused_input_size`)."""
    from tunelab.lib.models.vision import refused_input_size

    height, width = size or chain_output_size(chain)
    refused = refused_input_size(model_dir, height, width)
    if refused is None:
        return None
    model_size = refused["model_size"]
    takes = f"{model_size[0]}x{model_size[1]}" if model_size else "another size"
    fix = (
        f"set preprocess.image.resize: {model_size[0]} and preprocess.image.crop: {model_size[0]}"
        if model_size and model_size[0] == model_size[1]
        else "set preprocess.image.resize and preprocess.image.crop to the model's image_size"
    )
    return (
        f"the image transforms give {height}x{width} pixel values (from "
        f"{_size_source(chain, own, model_dir)}), the model takes {takes} "
        f"({refused['message']})",
        f"{fix} in study.yaml, or save the model's own image processor into {model_dir}",
    )


def study_input_size_problems(cfg: StudyConfig, root: Any) -> list[str]:
    """`tunelab validate`'s image-size check: `field: why` when the base is a local image
    model folder whose model cannot take what the chain gives. Anything that stops the check
    earlier (no folder, no processor, a hub base) is reported by the stage that loads it."""
    import json
    from pathlib import Path

    from tunelab.core.config import resolve_path
    from tunelab.lib.models.vision import is_image_config

    if cfg.task.kind != "image_classification" or not cfg.model.path or cfg.model.hub_id:
        return []
    try:
        folder = resolve_path(cfg.model.path, Path(root))
        config = json.loads((folder / "config.json").read_text())
        if not is_image_config(config) or not (folder / "preprocessor_config.json").is_file():
            return []
        from transformers import AutoImageProcessor

        chain = resolve_chain(AutoImageProcessor.from_pretrained(folder), cfg)
    except Exception:  # noqa: BLE001 - the stages that load the folder say what is wrong
        return []
    problem = input_size_problem(chain, cfg.preprocess.image, folder)
    return [f"preprocess.image: {problem[0]}; {problem[1]}"] if problem else []
