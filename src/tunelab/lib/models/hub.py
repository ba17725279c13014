"""A base model named by hub id: only the files a transformers / peft load needs, at one commit.

Weights are safetensors; `*.bin` / `*.pt` pickles (which run code when loaded) are fetched only
when `model.allow_pickle` is on and the repo has no safetensors.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tunelab.core.errors import ModelError
from tunelab.core.hub import COMMIT_RE, HubSnapshot, download, listed_files
from tunelab.lib.models.identity import CONFIG_FILES, TOKENIZER_FILES

if TYPE_CHECKING:
    from tunelab.core.config_training import ModelConfig

MODEL_PATTERNS = [*CONFIG_FILES, *TOKENIZER_FILES, "*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt", "*.pth"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def model_patterns(model_cfg: ModelConfig) -> list[str]:
    """The files fetched for this base: a GGUF file alone, else config, tokenizer and
    safetensors (and the repo's *.py when trust_remote_code is on)."""
    if model_cfg.gguf_file:
        return [model_cfg.gguf_file]
    return MODEL_PATTERNS + (["*.py"] if model_cfg.trust_remote_code else [])


def identity_patterns(model_cfg: ModelConfig, snap: HubSnapshot) -> list[str]:
    """The files of the snapshot folder that make up the base (a cache filled by a full
    `hf download` holds more): what `fetch_base` fetched."""
    patterns = model_patterns(model_cfg)
    return patterns if _has(snap, (".safetensors",)) else patterns + PICKLE_PATTERNS


def fetch_base(model_cfg: ModelConfig, commit: str | None = None) -> HubSnapshot:
    """`model.name` at `commit` (a pin) or at `model.revision` (default main), in the cache.

    The returned snapshot's `revision` is what study.yaml asks for, its `commit` what was loaded.
    Raises ModelError (see `tunelab.core.hub.download`), and for a repo without safetensors.
    """
    repo = model_cfg.hub_id
    assert repo, "fetch_base is for a base named by hub id"
    asked = model_cfg.revision or "main"
    if commit is not None and not COMMIT_RE.fullmatch(commit):
        raise ModelError(f"pinned commit {commit!r} of {repo} is not 40 hex digits")
    patterns = model_patterns(model_cfg)
    snap = download(repo, commit or asked, allow_patterns=patterns)
    if not model_cfg.gguf_file and not _has(snap, (".safetensors",)):
        snap = _pickle_fallback(model_cfg, snap, patterns)
    return dataclasses.replace(snap, revision=asked)


def pin_base(model_cfg: ModelConfig) -> HubSnapshot:
    """What `tunelab register` pins: `model.revision` resolved to its commit, with config.json
    alone fetched (the weights come with the first stage that loads them, at that commit), so
    that planning before renting needs no download of the weights. A repo whose listing shows
    only pickled weights (or no GGUF file of that name) is refused here already."""
    repo, asked = model_cfg.hub_id, model_cfg.revision or "main"
    assert repo, "pin_base is for a base named by hub id"
    snap = dataclasses.replace(
        download(repo, asked, allow_patterns=["config.json"]), revision=asked
    )
    listed = listed_files(snap)
    if listed is None:
        return snap
    if model_cfg.gguf_file and model_cfg.gguf_file not in listed:
        raise ModelError(
            f"{repo}@{snap.commit[:12]}: no file {model_cfg.gguf_file!r} in the repo",
            hint="set model.gguf_file to one of: "
            + ", ".join(n for n in listed if n.endswith(".gguf")),
        )
    if not model_cfg.gguf_file and not any(n.endswith(".safetensors") for n in listed):
        if not model_cfg.allow_pickle or not any(n.endswith(PICKLE_SUFFIXES) for n in listed):
            _pickle_fallback(model_cfg, snap, model_patterns(model_cfg))
    return snap


def _has(snap: HubSnapshot, suffixes: tuple[str, ...]) -> bool:
    return any(p.name.endswith(suffixes) for p in snap.path.iterdir())


def _pickle_fallback(model_cfg: ModelConfig, snap: HubSnapshot, patterns: list[str]) -> HubSnapshot:
    listed = listed_files(snap)
    pickles = [n for n in listed or [] if n.endswith(PICKLE_SUFFIXES)]
    where = f"{snap.repo_id}@{snap.commit[:12]}"
    if not model_cfg.allow_pickle:
        found = f"only pickled weights ({', '.join(pickles[:3])})" if pickles else "no weights"
        raise ModelError(
            f"{where}: no *.safetensors weights in the repo, {found}",
            hint="convert them to safetensors (load the model, `save_pretrained(dir)`) and point "
            "model.path at the folder; or, for a repo you trust, set model.allow_pickle: true "
            "(a pickle runs code when it is loaded)",
        )
    snap = download(snap.repo_id, snap.commit, allow_patterns=patterns + PICKLE_PATTERNS)
    if not _has(snap, PICKLE_SUFFIXES):
        raise ModelError(
            f"{where}: no weight file at all (*.safetensors, *.bin, *.pt)",
            hint="check model.name and model.revision: the repo holds no model weights",
        )
    return snap
