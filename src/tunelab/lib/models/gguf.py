"""Convert a GGUF file once into a cached transformers folder (the base model tunelab uses).

transformers de-quantizes GGUF weights on load but refuses to `save_pretrained` such a model, so
the conversion rebuilds the model from its config (without `quantization_config`), copies the
state dict in and saves plain safetensors plus the tokenizer. The result is byte-identical
between runs, so the folder's file hashes serve as the base model's identity.

Cache: `$TUNELAB_CACHE` or `~/.cache/tunelab`, folder `gguf/<sha256 of the GGUF file>/`. The
folder is written to a temporary name and moved into place with one rename, under a file lock,
so a concurrent or killed conversion never leaves half a folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from tunelab.core.errors import ModelError
from tunelab.core.hashing import sha256_file, sha256_text

CONVERSION_FILE = "tunelab-conversion.json"


def cache_root() -> Path:
    """Where converted models live: `$TUNELAB_CACHE` or `~/.cache/tunelab`."""
    env = os.environ.get("TUNELAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tunelab"


def gguf_sha256(path: Path) -> str:
    """sha256 of a GGUF file, remembered in a small json beside the cache (size + mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    index_dir = cache_root() / "gguf-hashes"
    index = index_dir / f"{sha256_text(str(path))[:32]}.json"
    try:
        known = json.loads(index.read_text())
        if known["size"] == st.st_size and known["mtime_ns"] == st.st_mtime_ns:
            return known["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    index_dir.mkdir(parents=True, exist_ok=True)
    tmp = index.with_name(f".{index.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(
        json.dumps(
            {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        )
    )
    os.replace(tmp, index)
    return digest


def convert_gguf(folder: Path | str, filename: str) -> Path:
    """The cached transformers folder for `folder/filename`, converting it on first use.

    Raises ModelError when the file is missing or transformers cannot read it.
    """
    source = Path(folder) / filename
    if not source.is_file():
        raise ModelError(
            f"GGUF file {source} not found",
            hint="check model.path (the folder) and model.gguf_file (the file name inside it)",
        )
    digest = gguf_sha256(source)
    final = cache_root() / "gguf" / digest
    if (final / CONVERSION_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds the folder
        if (final / CONVERSION_FILE).is_file():
            return final
        # Holding the lock, any temporary folder for this file is a killed conversion's.
        for stale in final.parent.glob(f".{digest}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.with_name(f".{digest}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            _convert_into(source, tmp, digest)
            if final.exists():  # a half folder from an older, non-atomic writer
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_into(source: Path, out: Path, digest: str) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tunelab.lib.models._quiet import quiet_transformers

    start = time.perf_counter()
    folder, name = str(source.parent), source.name
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many kinds for unreadable GGUF
        raise ModelError(
            f"cannot read GGUF file {source}: {type(exc).__name__}: {exc}",
            hint="pip install gguf; only GGUF architectures transformers supports can be converted",
        ) from None
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        out.mkdir(parents=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    (out / CONVERSION_FILE).write_text(
        json.dumps(
            {
                "source": str(source),
                "gguf_file": name,
                "gguf_sha256": digest,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "seconds": round(time.perf_counter() - start, 1),
            },
            indent=2,
        )
        + "\n"
    )
