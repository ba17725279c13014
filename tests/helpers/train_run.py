"""Comparing two runs' records: loss curves and final adapters equal."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tunelab.core.records import read_jsonl

CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "loss_tokens", "epoch", "val_loss")


def curve(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in CURVE_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def final_adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(
        str(run_dir / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")
    )


def assert_same_result(run_dir: Path, reference_dir: Path) -> None:
    """Same loss curve (exact floats) and bit-identical final adapter."""
    got, want = curve(run_dir), curve(reference_dir)
    assert got == want  # exact floats: loss, lr, grad norm, validation loss
    a, b = final_adapter(run_dir), final_adapter(reference_dir)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
