"""Resolve the study's base model (folder or converted GGUF) and load its tokenizer and model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.config import resolve_path
from tunelab.core.errors import ModelError
from tunelab.core.evidence import pinned_commit
from tunelab.lib.models._quiet import quiet_transformers
from tunelab.lib.models.adapt import head_module_names
from tunelab.lib.models.gguf import CONVERSION_FILE, convert_gguf
from tunelab.lib.models.hub import fetch_base, identity_patterns
from tunelab.lib.models.identity import (
    detect_architecture,
    hub_source,
    model_identity,
    read_model_config,
)

if TYPE_CHECKING:
    from tunelab.core.config import StudyConfig
    from tunelab.core.config_training import ModelConfig
    from tunelab.core.study import Study

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass
class BaseModel:
    """A resolved base model: a transformers folder, its architecture and its identity."""

    path: Path
    architecture: str  # "encoder" | "causal_lm" | "image"
    identity: dict[str, Any]
    trust_remote_code: bool = False
    config: dict[str, Any] = field(default_factory=dict, repr=False)


def resolve_base(study: Study) -> BaseModel:
    """The study's base model; a GGUF file is converted once into the cache (see models.gguf).
    A base named by hub id loads the commit the registered hypothesis pinned; for qlora the
    identity records the 4-bit settings (`quantization`), the base as the run used it."""
    base = resolve_model(study.config.model, root=study.root)
    if study.config.adaptation.method == "qlora":
        from tunelab.lib.models.quantize import quantization_record

        base.identity["quantization"] = quantization_record(study.config.adaptation.quantization)
    return base


def resolve_model(
    model_cfg: ModelConfig, root: Path | None = None, commit: str | None = None
) -> BaseModel:
    """`resolve_base` for a bare `model:` config section; relative paths are under `root`.

    A hub base (`model.name` without `model.path`) loads `commit` when given, else the commit
    pinned in `root`'s registered hypothesis, else what `model.revision` resolves to now.
    """
    hub = None
    if model_cfg.hub_id:
        if commit is None and root is not None:
            commit = pinned_commit(root, "model", model_cfg.hub_id)
        hub = fetch_base(model_cfg, commit)
        path = hub.path
    else:
        path = resolve_path(model_cfg.path, root)  # also `asset:NAME` (packaged assets)
        if not path.exists():
            raise ModelError(
                f"model.path {model_cfg.path!r}: {path} does not exist",
                hint="set model.path to a local transformers folder, or model.name to a hub id",
            )
    source: dict[str, Any] = {"hub": hub.record()} if hub else {}
    if model_cfg.gguf_file:
        gguf = path / model_cfg.gguf_file
        path = convert_gguf(path, model_cfg.gguf_file)
        conversion = json.loads((path / CONVERSION_FILE).read_text())
        source.update(
            gguf_file=str(gguf),
            gguf_sha256=conversion["gguf_sha256"],
            converted_by={k: conversion[k] for k in ("transformers", "torch")},
        )
    elif path.is_file():
        raise ModelError(
            f"model.path {model_cfg.path!r} is a file",
            hint="for a GGUF file set model.path to its folder and model.gguf_file to its name",
        )
    config = read_model_config(path)
    if config.get("auto_map") and not model_cfg.trust_remote_code:
        raise ModelError(
            f"{path}/config.json asks for custom code (auto_map) and trust_remote_code is off",
            hint="read the model's code first; then set model.trust_remote_code: true",
        )
    architecture = model_cfg.architecture
    if architecture == "auto":
        architecture = detect_architecture(config)
    identity = model_identity(
        path,
        name=model_cfg.name or _default_name(model_cfg),
        revision=hub.commit if hub else model_cfg.revision,
        trust_remote_code=model_cfg.trust_remote_code,
        source=source or None,
        patterns=identity_patterns(model_cfg, hub) if hub and not model_cfg.gguf_file else None,
    )
    identity["architecture"] = architecture
    return BaseModel(
        path=path,
        architecture=architecture,
        identity=identity,
        trust_remote_code=model_cfg.trust_remote_code,
        config=config,
    )


def resolve_recorded(
    model_cfg: ModelConfig, root: Path | None, identity: dict[str, Any] | None
) -> BaseModel:
    """The base a run recorded (`identity`): a hub base at the commit the run loaded."""
    hub = hub_source(identity or {})
    return resolve_model(model_cfg, root, commit=hub["commit"] if hub else None)


def base_folder(model_cfg: ModelConfig, root: Path | None = None) -> Path:
    """Where the base's files lie, without converting or downloading: model.path, or for a hub
    base its pinned (else cached) snapshot folder in the hub cache (which may be absent)."""
    if not model_cfg.hub_id:
        return resolve_path(model_cfg.path, root)
    from tunelab.core.hub import cached_commit, repo_folder

    repo = model_cfg.hub_id
    commit = (pinned_commit(root, "model", repo) if root else None) or cached_commit(
        repo, model_cfg.revision or "main"
    )
    return repo_folder(repo) / "snapshots" / str(commit)


def _default_name(model_cfg: ModelConfig) -> str:
    """The GGUF file's stem, else the folder's name."""
    if model_cfg.gguf_file:
        return Path(model_cfg.gguf_file).stem
    return Path(model_cfg.path).expanduser().resolve().name


def load_tokenizer(base: BaseModel):
    """The base's tokenizer (an image model: its image processor); a causal LM without a pad
    token gets pad = eos."""
    from transformers import AutoTokenizer

    if base.architecture == "image":
        from tunelab.lib.models.vision import load_image_processor

        return load_image_processor(base)

    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(base.path, trust_remote_code=base.trust_remote_code)
    except Exception as exc:
        raise ModelError(
            f"cannot load the tokenizer from {base.path}: {type(exc).__name__}: {exc}",
            hint="the folder needs tokenizer.json (or vocab files) and tokenizer_config.json",
        ) from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(base: BaseModel, cfg: StudyConfig, labels: list[str] | None = None):
    """The base model in `cfg.model.dtype` (qlora: its linear layers in 4 bits, bitsandbytes).

    encoder: AutoModelForSequenceClassification with a head for `labels`, initialized from
    `cfg.training.seed` so that runs are reproducible; causal_lm: AutoModelForCausalLM.
    The names of newly initialized tensors are kept in `model.tunelab_new_params`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    dtype = getattr(torch, DTYPES[cfg.model.dtype])
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": base.trust_remote_code,
        "output_loading_info": True,
    }
    if base.architecture in ("encoder", "image"):
        if not labels:
            raise ModelError(
                f"an {base.architecture} model needs the label set to build its classification "
                "head",
                hint="set task.labels or build a data snapshot first (`tunelab data`)",
            )
        if base.architecture == "image":
            from tunelab.lib.models.vision import image_model_class

            auto = image_model_class()
        else:
            auto = AutoModelForSequenceClassification
        kwargs.update(
            ignore_mismatched_sizes=True,  # a checkpoint's head for another label set is replaced
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
        )
    else:
        auto = AutoModelForCausalLM
    if cfg.adaptation.method == "qlora":
        from tunelab.lib.models.quantize import quantization_config

        kwargs["quantization_config"] = quantization_config(
            cfg.adaptation.quantization, base.architecture
        )
    torch.manual_seed(cfg.training.seed)  # the new head's initialization
    try:
        with quiet_transformers():
            model, info = auto.from_pretrained(base.path, **kwargs)
    except Exception as exc:
        raise ModelError(
            f"cannot load {base.architecture} model from {base.path}: {type(exc).__name__}: {exc}",
            hint="check model.architecture and that the folder is a complete transformers model",
        ) from None
    mismatched = sorted(
        k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())
    )
    heads = head_module_names(model, base.architecture)
    outside_head = [k for k in mismatched if k.split(".")[0] not in heads]
    if outside_head:
        raise ModelError(
            f"{base.path}: tensors with unexpected shapes: {outside_head[:5]}",
            hint="the weights do not match config.json; re-export the model folder",
        )
    if cfg.adaptation.method == "qlora":
        from tunelab.lib.models.quantize import keep_weights_as_loaded

        keep_weights_as_loaded(model)
    model.tunelab_new_params = sorted(set(info.get("missing_keys") or []) | set(mismatched))
    if base.architecture == "causal_lm" and model.tunelab_new_params:
        raise ModelError(
            f"{base.path}: tensors missing from the checkpoint: {model.tunelab_new_params[:5]}",
            hint="a causal LM must load completely; check the weight files",
        )
    return model
