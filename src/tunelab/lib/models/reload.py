"""Reload a saved model in a fresh process and compare its outputs with the live model.

A checkpoint is only as good as what a new process makes of it: `compare_fresh_reload` saves
nothing itself; it takes a folder written by `save_trainable`, starts the worker
`python -m tunelab.lib.models.reload SPEC` (`tunelab.core.worker`) which loads the base (checking its
identity), applies the folder and writes the logits for the given batch, and compares them with
the live model's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import CheckpointError
from tunelab.core.worker import Worker, serve

if TYPE_CHECKING:
    from tunelab.core.config import StudyConfig
    from tunelab.lib.models.loading import BaseModel


def _logits(model: Any, batch: dict[str, Any]):
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**batch).logits.float().cpu()
    finally:
        model.train(was_training)


def compare_fresh_reload(
    model: Any,
    cfg: StudyConfig,
    base: BaseModel,
    saved_dir: Path | str,
    method: str,
    batch: dict[str, Any],
    *,
    labels: list[str] | None = None,
    atol: float = 1e-5,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Logits of `model` vs. those of `saved_dir` reloaded in a new process, on `batch`.

    `batch` holds tensors for the model's forward (input_ids, attention_mask). Returns
    {max_abs_diff, atol, ok, seconds}. Raises the new process's TunelabError (a changed base:
    ModelError), or CheckpointError with its whole error when it fails otherwise.
    """
    from safetensors.torch import load_file, save_file

    live = _logits(model, batch)
    start = time.perf_counter()
    with Worker("tunelab.lib.models.reload") as worker:
        batch_file = worker.dir / "batch.safetensors"
        save_file({k: v.contiguous() for k, v in batch.items()}, str(batch_file))
        spec = {
            "config": cfg.to_dict(),
            "base_path": str(base.path),
            "architecture": base.architecture,
            "trust_remote_code": base.trust_remote_code,
            "identity": base.identity,
            "labels": labels,
            "saved_dir": str(Path(saved_dir).resolve()),
            "method": method,
            "batch": str(batch_file),
        }
        worker.run(spec, timeout_s=timeout_s).value(
            CheckpointError,
            f"reloading {saved_dir} in a new process failed",
            hint="the saved folder cannot be loaded on its own; check its files",
        )
        fresh = load_file(str(worker.dir / "logits.safetensors"))["logits"]
    diff = (live - fresh).abs().max().item() if live.shape == fresh.shape else float("inf")
    return {
        "max_abs_diff": diff,
        "atol": atol,
        "ok": diff <= atol,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _reload(spec: dict[str, Any], out: Path) -> None:
    """The worker's body: load the base and the saved folder, write the batch's logits."""
    from safetensors.torch import load_file, save_file

    from tunelab.core.config import validate_config
    from tunelab.lib.models.identity import verify_identity
    from tunelab.lib.models.loading import BaseModel, load_model
    from tunelab.lib.models.persist import load_trainable

    cfg = validate_config(spec["config"])
    base = BaseModel(
        path=Path(spec["base_path"]),
        architecture=spec["architecture"],
        identity=spec["identity"],
        trust_remote_code=spec["trust_remote_code"],
    )
    verify_identity(base.identity, base.path)
    model = load_model(base, cfg, spec["labels"])
    model = load_trainable(model, spec["saved_dir"], spec["method"])
    logits = _logits(model, load_file(spec["batch"]))
    save_file({"logits": logits.contiguous()}, str(out / "logits.safetensors"))


if __name__ == "__main__":
    sys.exit(serve(_reload))
