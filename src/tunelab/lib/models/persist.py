"""Save and load what a run trains: a peft adapter, a whole model, or the unfrozen tensors.

| method | folder name | files |
|---|---|---|
| lora   | adapter/ | adapter_config.json, adapter_model.safetensors (LoRA + modules_to_save) |
| full   | model/   | config.json, model.safetensors (save_pretrained; loads with from_pretrained) |
| freeze | model/   | trainable.safetensors (only the unfrozen tensors), trainable.json |

`load_trainable` loads such a folder onto a freshly loaded base model (evaluation, verify,
export) or into an already adapted one (resume).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunelab.core.errors import CheckpointError
from tunelab.lib.models._quiet import quiet_transformers

FREEZE_FILE = "trainable.safetensors"


def trainable_dirname(method: str) -> str:
    """'adapter' for LoRA and QLoRA, 'model' for full and freeze."""
    return "adapter" if method in ("lora", "qlora") else "model"


def method_of(model: Any) -> str:
    """The adaptation method `adapt` applied to `model` (a peft model without it: lora)."""
    method = getattr(model, "tunelab_method", None)
    if method:
        return method
    return "lora" if hasattr(model, "peft_config") else "full"


def saved_method(folder: Path | str) -> str:
    """The method a folder written by `save_trainable` was saved with, from its files."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        return "lora"
    if (folder / "trainable.json").is_file():
        return "freeze"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return "full"
    raise CheckpointError(
        f"{folder}: neither an adapter, a model nor a trainable-tensor file",
        hint="the checkpoint is incomplete; use an earlier one",
    )


def save_trainable(
    model: Any,
    out_dir: Path | str,
    method: str | None = None,
    weights: dict[str, Any] | None = None,
) -> Path:
    """Write what `method` (default: the model's own) trains into `out_dir`: the one writer of
    trained weights, for a model in memory and for FSDP's gathered state alike.

    `weights`: the trainable tensors gathered from a sharded model (name -> tensor), written in
    place of the model's own parameters. `out_dir` is created; callers make the surrounding
    checkpoint atomic.
    """
    method = method or method_of(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        if method in ("lora", "qlora"):
            model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        elif method == "full":
            # the names the model has in memory: transformers would rename some models' tensors
            # (ViT's q_proj back to attention.query) to their original checkpoint format, which
            # load_trainable's exact check then refuses; from_pretrained reads both
            model.save_pretrained(
                out, state_dict=weights, safe_serialization=True, save_original_format=False
            )
        elif method == "freeze":
            if weights is None:
                expected = _expected_trainable(model)
                weights = {
                    n: p.detach().cpu() for n, p in model.named_parameters() if n in expected
                }
            _write_freeze(out, {n: t.contiguous() for n, t in weights.items()})
        else:
            raise AssertionError(f"unknown method {method!r}")
    return out


def _write_freeze(out: Path, tensors: dict[str, Any]) -> None:
    """A `freeze` model's trained tensors, and the list of their names."""
    from safetensors.torch import save_file

    save_file(tensors, str(out / FREEZE_FILE), metadata={"format": "pt"})
    (out / "trainable.json").write_text(
        json.dumps({"method": "freeze", "tensors": sorted(tensors)}, indent=2) + "\n"
    )


def _expected_trainable(model: Any) -> frozenset[str]:
    expected = getattr(model, "tunelab_expected_trainable", None)
    if expected is not None:
        return expected
    return frozenset(n for n, p in model.named_parameters() if p.requires_grad)


def load_trainable(
    model: Any, in_dir: Path | str, method: str | None = None, *, trainable: bool = False
):
    """`model` with the saved tensors of `in_dir` loaded; returns the model to use.

    `method` defaults to what the folder's files say (see `saved_method`).

    `model` is a base model from `load_model` (then LoRA wraps it in a PeftModel) or a model
    already returned by `adapt` (resume). `trainable` keeps the adapter trainable when wrapping.
    Raises CheckpointError when files are missing or tensors do not fit the model.
    """
    src = Path(in_dir)
    method = method or saved_method(src)
    if method in ("lora", "qlora"):  # a QLoRA adapter loads onto the 4-bit base like any other
        return _load_lora(model, src, trainable)
    if method == "full":
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{src}: no model safetensors", hint="the checkpoint is incomplete"
            )
        _load_tensors(model, files, src, complete=True)
        return model
    if method == "freeze":
        f = src / FREEZE_FILE
        if not f.is_file():
            raise CheckpointError(f"{src}: no {FREEZE_FILE}", hint="the checkpoint is incomplete")
        names = _load_tensors(model, [f], src, complete=False)
        if trainable:
            for n, p in model.named_parameters():
                p.requires_grad_(n in names)
            model.tunelab_expected_trainable = frozenset(names)
        return model
    raise AssertionError(f"unknown method {method!r}")


def _load_lora(model: Any, src: Path, trainable: bool):
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = src / "adapter_model.safetensors"
    if not weights.is_file() or not (src / "adapter_config.json").is_file():
        raise CheckpointError(
            f"{src}: adapter_config.json or adapter_model.safetensors missing",
            hint="the checkpoint is incomplete; use an earlier one",
        )
    with quiet_transformers():
        if isinstance(model, PeftModel):
            result = set_peft_model_state_dict(model, load_file(str(weights)))
            unexpected = list(getattr(result, "unexpected_keys", []) or [])
            if unexpected:
                raise CheckpointError(
                    f"{src}: adapter tensors that fit no module: {unexpected[:5]}",
                    hint="the adapter was trained with another adaptation config",
                )
            return model
        return PeftModel.from_pretrained(model, src, is_trainable=trainable)


def _load_tensors(model: Any, files: list[Path], src: Path, *, complete: bool) -> set[str]:
    import torch
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    shape = sorted(n for n in state if n in own and own[n].shape != state[n].shape)
    if unexpected or shape:
        raise CheckpointError(
            f"{src}: tensors that do not fit the model: {(unexpected + shape)[:5]}",
            hint="the checkpoint belongs to another base model or adaptation",
        )
    with torch.no_grad():
        missing = model.load_state_dict(state, strict=False).missing_keys
    if complete and missing:
        # Tied weights (e.g. lm_head = embed_tokens) are saved once; they share storage.
        loaded = {own[n].data_ptr() for n in state}
        untied = [n for n in missing if own[n].data_ptr() not in loaded]
        if untied:
            raise CheckpointError(
                f"{src}: tensors missing from the checkpoint: {untied[:5]}",
                hint="the checkpoint is incomplete; use an earlier one",
            )
    return set(state)
