"""A base model without its weights, and the base's safetensors read row by row.

Sharded loading (FSDP, `tunelab.stages.train.sharded_load`) never holds the whole base in one
process: `load_skeleton` builds the model of `load_model` with every parameter on the meta
device (no storage) and its buffers real (rotary frequencies are computed, not loaded);
`WeightFiles` reads any rows `[start, end)` of a tensor from the base's safetensors files,
touching only those bytes.

The skeleton's parameters are placeholders on the CPU, not meta tensors: each is one zero
expanded to the parameter's shape (no storage). peft creates an adapter's tensors (LoRA's
matrices) on the device of the layer it adapts; on a CPU placeholder they keep the values the
seeded generator gives them, exactly those of a model loaded whole (loading weights draws
nothing from the generator, and peft draws in the same order). On meta they would be lost.
Before sharding the placeholders become meta tensors (`placeholders_to_meta`): FSDP shards only
contiguous tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import ModelError
from tunelab.lib.models._quiet import quiet_transformers

if TYPE_CHECKING:
    import torch

    from tunelab.core.config import StudyConfig
    from tunelab.lib.models.loading import BaseModel

INDEX_FILE = "model.safetensors.index.json"


class WeightFiles:
    """The tensors of a model folder's safetensors files (one file or an index of shards)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: self.folder / v for k, v in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise ModelError(
                    f"{self.folder}: no safetensors weights to load shard by shard",
                    hint="the base must be a folder of safetensors files (or use --strategy ddp)",
                )
            self.file_of = {}
            for f in files:
                for key in self._keys(f):
                    self.file_of[key] = f
        self.bytes_read = 0

    @staticmethod
    def _keys(path: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())

    def key_for(self, name: str, prefix: str) -> str | None:
        """The file's key of a model parameter or buffer `name` (with or without the model's
        `base_model_prefix`), or None when the files do not hold it."""
        for key in (name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}"):
            if key in self.file_of:
                return key
        return None

    def read_rows(self, key: str, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `[start, end)` of tensor `key` (its first dimension) in `dtype`; a 0-d tensor
        whole. Only those rows' bytes are read."""
        from safetensors import safe_open

        with safe_open(str(self.file_of[key]), framework="pt") as f:
            part = f.get_slice(key)
            t = part[start:end] if part.get_shape() else f.get_tensor(key)
        self.bytes_read += t.numel() * t.element_size()
        return t.to(dtype)


def skeleton_config(base: BaseModel, labels: list[str] | None) -> Any:
    """The transformers config `load_model` would build the model from."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": base.trust_remote_code}
    if labels:
        kwargs.update(
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
        )
    with quiet_transformers():
        return AutoConfig.from_pretrained(base.path, **kwargs)


def load_skeleton(base: BaseModel, cfg: StudyConfig) -> torch.nn.Module:
    """The causal LM of `load_model(base, cfg)` with its parameters on the meta device.

    Refuses what sharded loading does not cover: a base other than a causal LM (an encoder's new
    head would be initialized differently from a whole load), a 4-bit base, and a base whose
    files lack a parameter.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from tunelab.lib.models.loading import DTYPES

    if base.architecture != "causal_lm" or cfg.adaptation.method == "qlora":
        raise ModelError(
            "sharded loading covers causal LMs in full precision "
            f"(this base: {base.architecture}, adaptation {cfg.adaptation.method})",
            hint="load whole on every rank (training.sharded_load: false) or use --strategy ddp",
        )
    dtype = getattr(torch, DTYPES[cfg.model.dtype])
    config = skeleton_config(base, None)
    with quiet_transformers(), init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=base.trust_remote_code
        )
    model.tie_weights()  # from_config ties only tensors that have storage
    files = WeightFiles(base.path)
    prefix = getattr(model, "base_model_prefix", "")
    missing = [n for n, _ in model.named_parameters() if files.key_for(n, prefix) is None]
    if missing:
        raise ModelError(
            f"{base.path}: tensors missing from the checkpoint: {missing[:5]}",
            hint="a causal LM must load completely; check the weight files",
        )
    model.tunelab_new_params = []
    model.tunelab_weight_files = files
    model.tunelab_placeholders = _to_placeholders(model)
    return model


def _to_placeholders(model: torch.nn.Module) -> set[int]:
    """Replace every meta parameter by a storage-less CPU placeholder (a tied parameter stays
    one object); returns the placeholders' ids."""
    import torch

    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                zero = torch.zeros((), dtype=p.dtype).expand(p.shape)
                made[id(p)] = torch.nn.Parameter(zero, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return {id(p) for p in made.values()}


def placeholders_to_meta(model: torch.nn.Module) -> list[str]:
    """Replace the placeholders by meta parameters (FSDP shards only contiguous tensors, and
    allocates no storage for meta ones); returns their names as `model` names them."""
    import torch

    names = placeholder_names(model)
    ids = skeleton_of(model).tunelab_placeholders
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or id(p) not in ids:
                continue
            if id(p) not in made:
                meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                made[id(p)] = torch.nn.Parameter(meta, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return names


def placeholder_names(model: torch.nn.Module) -> list[str]:
    """The names (as `model` names them, e.g. under peft) of the skeleton's placeholders."""
    ids = getattr(skeleton_of(model), "tunelab_placeholders", set())
    return [n for n, p in model.named_parameters() if id(p) in ids]


def skeleton_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (the one `load_skeleton` marked)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
