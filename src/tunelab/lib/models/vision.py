"""Image classification models: transformers' AutoModelForImageClassification and the base's
image processor (preprocessor_config.json), both from a local folder.

The processor's settings (size, crop, mean, std, resampling) are what `tunelab.lib.preprocess.images`
applies by default; tunelab runs the chain itself so that `tunelab inspect` can show each step.

`is_image_config(config)` makes `detect_architecture` answer "image"; `patch_tokens(config)` is
(image_size / patch_size)^2 + 1, an image model's "sequence length" for sizing.
`head_module_names` and LoRA (peft's generic PeftModel) take "image".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunelab.core.errors import ModelError
from tunelab.lib.models._quiet import quiet_transformers

if TYPE_CHECKING:
    from tunelab.lib.models.loading import BaseModel

# model types of transformers image backbones (a config without a *ForImageClassification head)
IMAGE_TYPES = {
    "vit",
    "deit",
    "beit",
    "convnext",
    "convnextv2",
    "resnet",
    "swin",
    "swinv2",
    "dinov2",
    "efficientnet",
    "mobilenet_v1",
    "mobilenet_v2",
    "mobilevit",
    "regnet",
    "levit",
    "poolformer",
    "segformer",
    "bit",
    "van",
    "cvt",
}


def is_image_config(config: dict[str, Any]) -> bool:
    """Whether a config.json describes an image classifier or an image backbone."""
    archs = config.get("architectures") or []
    model_type = str(config.get("model_type", "")).lower()
    return model_type in IMAGE_TYPES or any(a.endswith("ForImageClassification") for a in archs)


def load_image_processor(base: BaseModel) -> Any:
    """The base's image processor; ModelError when the folder has none."""
    from transformers import AutoImageProcessor

    if not (base.path / "preprocessor_config.json").exists():
        raise ModelError(
            f"{base.path}: no preprocessor_config.json, so the image transforms are unknown",
            hint="save the model's image processor into the folder "
            "(`AutoImageProcessor.from_pretrained(...).save_pretrained(folder)`)",
        )
    try:
        with quiet_transformers():
            proc = AutoImageProcessor.from_pretrained(
                base.path, trust_remote_code=base.trust_remote_code
            )
    except Exception as exc:
        raise ModelError(
            f"cannot load the image processor from {base.path}: {type(exc).__name__}: {exc}",
            hint="check preprocessor_config.json",
        ) from None
    return proc


def image_model_class() -> Any:
    from transformers import AutoModelForImageClassification

    return AutoModelForImageClassification


def pixels_for(model: Any, pixels: Any) -> Any:
    """`pixels` in the dtype and on the device of the model's weights (model.dtype bfloat16
    takes bfloat16 inputs)."""
    weight = next(p for p in model.parameters() if p.is_floating_point())
    return pixels.to(weight.device, dtype=weight.dtype)


def patch_tokens(config: dict[str, Any]) -> int | None:
    """Tokens a ViT-like model sees per image ((size / patch)^2 + the CLS token), or None for a
    model without patches (ConvNeXt, ResNet): the memory model walks transformer blocks."""
    size, patch = config.get("image_size"), config.get("patch_size")
    if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0:
        return None
    return (size // patch) ** 2 + 1


def refused_input_size(model_dir: Any, height: int, width: int) -> dict[str, Any] | None:
    """The model's own input check on `[1, 3, height, width]` pixel values: the image model of
    `model_dir`'s config.json built on the meta device (no weights, no memory) and run forward.

    Returns None when the model takes that size, else `{"message": what the model raised,
    "model_size": [h, w] of its config (None when it names none)}`. A model that interpolates
    its position embeddings (DINOv2) or pools convolutions (ConvNeXt) takes any size, so it is
    never refused; a model that refuses its own config's size too (or cannot run on the meta
    device) is not judged here: None."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(model_dir)
        classes = [
            auto._model_mapping[type(config)]
            for auto in (AutoModelForImageClassification, AutoModel)
            if type(config) in auto._model_mapping
        ]
        cls = classes[0][0] if isinstance(classes[0], tuple) else classes[0]
        with torch.device("meta"), quiet_transformers():
            model = cls(config)
    except Exception:  # noqa: BLE001 - a model that cannot be built here is not judged
        return None
    size = getattr(config, "image_size", None)
    own = [size, size] if isinstance(size, int) else list(size) if size else None

    def error_at(h: int, w: int) -> str | None:
        try:
            with torch.no_grad():
                model(pixel_values=torch.empty(1, 3, h, w, device="meta"))
        except Exception as exc:  # noqa: BLE001 - the model's refusal is the finding
            return f"{type(model).__name__}: {type(exc).__name__}: {exc}"
        return None

    message = error_at(height, width)
    if message is None or error_at(*(own or [224, 224])) is not None:
        return None
    return {"message": message, "model_size": own}
