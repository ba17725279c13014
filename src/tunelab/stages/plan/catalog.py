"""The catalog of rental GPUs (`gpus.toml` beside this module): datasheet figures with their
source, a default price, the default utilization by architecture and method, and the host's
time per transformer block in eager PyTorch.

`gpus()`, `find_gpu(id)` (ConfigError naming the ids), `gpu_of_device(cuda_name)`,
`default_utilization(arch, method)`, `host_cost()`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tunelab.core.errors import ConfigError

CATALOG = Path(__file__).with_name("gpus.toml")


@dataclass(frozen=True)
class Gpu:
    id: str
    name: str
    arch: str
    tflops_bf16: float
    tflops_fp16: float
    tflops_fp32: float
    memory_gb: float
    bandwidth_gbs: float
    interconnect: str
    interconnect_gbs: float
    price_per_hour: float
    source: str
    url: str  # where the datasheet is published

    def peak_flops(self, precision: str) -> float:
        """FLOP/s of dense matrix products at `precision` (bf16 | fp16 | fp32)."""
        return {"bf16": self.tflops_bf16, "fp16": self.tflops_fp16}.get(
            precision, self.tflops_fp32
        ) * 1e12

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9


@dataclass(frozen=True)
class UtilizationRange:
    """A share of the matrix peak: `low` and `high` bound the plan's range."""

    low: float
    value: float
    high: float
    source: str


@dataclass(frozen=True)
class HostCost:
    """Seconds the host spends issuing one block's kernels (eager PyTorch)."""

    train_block_pass_s: float
    train_source: str
    infer_block_s: float
    infer_source: str


@cache
def _raw() -> dict[str, Any]:
    return tomllib.loads(CATALOG.read_text())


def currency() -> str:
    """The currency of the catalog's prices (ISO 4217 code)."""
    return str(_raw()["currency"])


def gpus() -> list[Gpu]:
    """Every catalog GPU, in the file's order."""
    return [Gpu(id=key, **entry) for key, entry in _raw()["gpus"].items()]


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def find_gpu(name: str) -> Gpu:
    """The catalog GPU called `name` (its id, any case, with or without dashes). Raises
    ConfigError naming the ids when none or several match."""
    found = [g for g in gpus() if _key(g.id) == _key(name)]
    if not found:
        found = [g for g in gpus() if _key(name) and _key(g.id).startswith(_key(name))]
    if len(found) == 1:
        return found[0]
    ids = ", ".join(g.id for g in gpus())
    what = "matches several catalog GPUs" if found else "is not in the GPU catalog"
    raise ConfigError(f"--gpu {name!r} {what}", hint=f"choose one of {ids}")


def gpu_of_device(device_name: str | None) -> Gpu | None:
    """The catalog GPU a CUDA device name (as env.json records it) is, or None."""
    if not device_name:
        return None
    key = _key(device_name)
    patterns = {
        "B200": "b200",
        "H200": "h200",
        "H100-NVL": "h100nvl",
        "H100-PCIe": "h100pcie",
        "H100-SXM": "h100",
        "A100-40GB": "a100.*40g",
        "A100-80GB": "a100",
        "L40S": "l40s",
        "L4": r"(?<![0-9])l4(?![0-9])",
        "RTX-4090": "rtx4090",
        "RTX-5090": "rtx5090",
        "MI300X": "mi300x",
        "MI325X": "mi325x",
        "MI355X": "mi355x",
        "A10": r"(?<![0-9])a10g?(?![0-9])",
    }
    for gpu_id, pattern in patterns.items():
        if re.search(pattern, key):
            return next(g for g in gpus() if g.id == gpu_id)
    return None


def default_utilization(arch: str, method: str) -> UtilizationRange:
    """The catalog's utilization for an architecture and a method (freeze counts as full)."""
    entry = _raw()["utilization"][arch]
    low, value, high = entry["lora" if method == "lora" else "full"]
    return UtilizationRange(low, value, high, entry["source"])


def host_cost() -> HostCost:
    return HostCost(**_raw()["host"])
