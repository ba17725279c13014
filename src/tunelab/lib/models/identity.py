"""Who the base model is: file hashes of its weights, tokenizer and config, and its architecture.

The identity is recorded with every run and bound into every export; `verify_identity` refuses a
folder whose files no longer match it.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from tunelab.core.errors import ModelError
from tunelab.core.hashing import sha256_file_cached, sha256_json

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
TOKENIZER_FILES = (
    "preprocessor_config.json",  # an image model's processor: its "tokenizer"
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
CONFIG_FILES = ("config.json", "generation_config.json")

ENCODER_TYPES = {
    "bert",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "xlm-roberta",
    "camembert",
    "mpnet",
    "ernie",
    "modernbert",
    "xlm",
    "megatron-bert",
    "nomic_bert",
}

# a 538 MB weights file is hashed once per process
hash_file = sha256_file_cached


def identity_files(path: Path, patterns: list[str] | None = None) -> list[str]:
    """Names (relative to `path`) of the weight, tokenizer and config files that define a model;
    with `patterns` (fnmatch), only those matching one of them."""
    path = Path(path)
    names = []
    for p in sorted(path.iterdir()):
        if not p.is_file():
            continue
        name = p.name
        if patterns is not None and not any(fnmatch(name, pat) for pat in patterns):
            continue
        if (
            name.endswith(WEIGHT_SUFFIXES)
            or name in TOKENIZER_FILES
            or name in CONFIG_FILES
            or name.endswith(".safetensors.index.json")
            or name.endswith(".bin.index.json")
        ):
            if name.startswith("training_args") or name.startswith("optimizer"):
                continue
            names.append(name)
    return names


def _has_weights(names: list[str]) -> bool:
    return any(n.endswith(WEIGHT_SUFFIXES) for n in names)


def model_identity(
    path: Path,
    *,
    name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    source: dict[str, Any] | None = None,
    patterns: list[str] | None = None,
) -> dict[str, Any]:
    """The identity of the model folder `path` (only its files matching `patterns` when given:
    a hub snapshot may hold files a load does not read).

    `sha256` covers the file hashes and trust_remote_code (what the model *is*), not its name or
    where it lies, so a copied folder keeps its identity.
    """
    path = Path(path).resolve()
    names = identity_files(path, patterns)
    if not _has_weights(names):
        raise ModelError(
            f"{path}: no weight file (*.safetensors, *.bin, *.gguf) in this folder",
            hint="point model.path at a transformers model folder (config.json + weights)",
        )
    files = {n: hash_file(path / n) for n in names}
    if revision is None and path.parent.name == "snapshots":
        revision = path.name  # a Hugging Face cache folder: snapshots/<commit>/
    identity: dict[str, Any] = {
        "name": name or path.name,
        "revision": revision,
        "path": str(path),
        "files": files,
        "trust_remote_code": bool(trust_remote_code),
    }
    if source:
        identity["source"] = source
    if patterns is not None:
        identity["patterns"] = list(patterns)
    identity["sha256"] = sha256_json({"files": files, "trust_remote_code": bool(trust_remote_code)})
    return identity


def verify_identity(identity: dict[str, Any], path: Path | str | None = None) -> None:
    """Raise ModelError listing every file of `path` that no longer matches `identity`.

    `path` defaults to the identity's own path. Checked: every recorded file exists with the same
    sha256, and no weight file was added.
    """
    path = Path(path or identity["path"]).resolve()
    if not path.is_dir():
        raise ModelError(
            f"base model folder {path} not found",
            hint="the run or export was made from this base; restore it or point model.path at it",
        )
    problems = []
    for name, digest in sorted(identity["files"].items()):
        f = path / name
        if not f.is_file():
            problems.append(f"  - {name}: missing")
        elif hash_file(f) != digest:
            problems.append(f"  - {name}: sha256 {hash_file(f)[:12]}..., expected {digest[:12]}...")
    for name in identity_files(path, identity.get("patterns")):
        if name not in identity["files"] and name.endswith(WEIGHT_SUFFIXES):
            problems.append(f"  - {name}: weight file not in the recorded identity")
    if problems:
        raise ModelError(
            f"base model at {path} does not match the recorded identity "
            f"{identity.get('name')} ({identity['sha256'][:12]}):\n" + "\n".join(problems),
            hint="use the exact base the run was trained on (same weight and tokenizer files)",
        )


def read_model_config(path: Path) -> dict[str, Any]:
    f = Path(path) / "config.json"
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(
            f"{path}: no config.json, not a transformers model folder",
            hint="model.path must hold config.json and weights, or set model.gguf_file",
        ) from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{f}: not valid JSON (line {exc.lineno})") from None


def detect_architecture(config: dict[str, Any]) -> str:
    """'encoder' for BERT-like models, 'causal_lm' for *ForCausalLM / decoder models, 'image'
    for image classifiers and backbones (ViT, ConvNeXt, ResNet, ...)."""
    from tunelab.lib.models.vision import is_image_config

    archs = config.get("architectures") or []
    model_type = str(config.get("model_type", "")).lower()
    if is_image_config(config):
        return "image"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal_lm"
    if model_type in ENCODER_TYPES or model_type.replace("_", "-") in ENCODER_TYPES:
        return "encoder"
    if any(a.endswith(("ForSequenceClassification", "ForMaskedLM")) for a in archs):
        return "encoder"
    if config.get("is_decoder") or model_type in {"llama", "mistral", "qwen2", "qwen3", "gpt2"}:
        return "causal_lm"
    raise ModelError(
        f"cannot tell whether model type {model_type!r} (architectures {archs}) is an encoder or "
        "a causal LM",
        hint="set model.architecture: encoder or model.architecture: causal_lm in study.yaml",
    )


def hub_source(identity: dict[str, Any]) -> dict[str, Any] | None:
    """{repo_id, repo_type, revision, commit} of a base that came from the hub, else None."""
    return (identity.get("source") or {}).get("hub")
