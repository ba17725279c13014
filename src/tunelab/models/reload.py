"""Reload a saved model in a fresh process and compare its outputs with the live model.

A checkpoint is only as good as what a new process makes of it: `compare_fresh_reload` saves
nothing itself; it takes a folder written by `save_trainable`, starts
`python -m tunelab.models.reload SPEC` which loads the base (checking its identity), applies the
folder and writes the logits for the given batch, and compares them with the live model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.errors import CheckpointError

if TYPE_CHECKING:
    from tunelab.config import StudyConfig
    from tunelab.models.loading import BaseModel


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
    {max_abs_diff, atol, ok, seconds}. Raises CheckpointError when the new process fails.
    """
    from safetensors.torch import load_file, save_file

    live = _logits(model, batch)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tunelab-reload-") as tmp:
        tmp_path = Path(tmp)
        save_file(
            {k: v.contiguous() for k, v in batch.items()}, str(tmp_path / "batch.safetensors")
        )
        spec = {
            "config": cfg.to_dict(),
            "base_path": str(base.path),
            "architecture": base.architecture,
            "trust_remote_code": base.trust_remote_code,
            "identity": base.identity,
            "labels": labels,
            "saved_dir": str(Path(saved_dir).resolve()),
            "method": method,
            "batch": str(tmp_path / "batch.safetensors"),
            "out": str(tmp_path / "logits.safetensors"),
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run(
            [sys.executable, "-m", "tunelab.models.reload", str(tmp_path / "spec.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise CheckpointError(
                f"reloading {saved_dir} in a new process failed:\n{proc.stderr.strip()[-2000:]}",
                hint="the saved folder cannot be loaded on its own; check its files",
            )
        fresh = load_file(spec["out"])["logits"]
    diff = (live - fresh).abs().max().item() if live.shape == fresh.shape else float("inf")
    return {
        "max_abs_diff": diff,
        "atol": atol,
        "ok": diff <= atol,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _main(spec_path: str) -> None:
    from safetensors.torch import load_file, save_file

    from tunelab.config import validate_config
    from tunelab.models.identity import verify_identity
    from tunelab.models.loading import BaseModel, load_model
    from tunelab.models.persist import load_trainable

    spec = json.loads(Path(spec_path).read_text())
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
    save_file({"logits": logits.contiguous()}, spec["out"])


if __name__ == "__main__":
    _main(sys.argv[1])
