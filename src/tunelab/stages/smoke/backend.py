"""`tunelab env --check`: whether the study's model, extensions and adaptation method can run
on this backend, before a rented machine is paid to find out. Pure: an env.json and a config in,
checks out."""

from __future__ import annotations

from typing import Any

# ROCm architectures bitsandbytes and flash-attn build for (MI200, MI300)
ROCM_DATACENTER = ("gfx90a", "gfx942")


def backend_checks(env: dict[str, Any], cfg: Any) -> list[dict[str, Any]]:
    """[{check, ok, detail}] for this environment and study config; ok None where it does not
    apply."""
    backend = env.get("backend")
    ext = env.get("extensions") or {}
    caps = [g.get("capability") or "" for g in env.get("gpus") or []]
    out = []
    method = cfg.adaptation.method
    if method == "qlora":
        if backend == "cpu":
            ok, why = False, "QLoRA's 4-bit base needs a GPU (bitsandbytes); this backend is cpu"
        elif not ext.get("bitsandbytes"):
            ok, why = False, "bitsandbytes is not installed (pip install tunelab[qlora])"
        elif backend == "rocm" and not all(c.split(":")[0] in ROCM_DATACENTER for c in caps):
            ok, why = False, f"bitsandbytes on ROCm supports {ROCM_DATACENTER}; found {caps}"
        else:
            ok, why = True, f"bitsandbytes {ext['bitsandbytes']} on {backend}"
        out.append({"check": "adaptation qlora", "ok": ok, "detail": why})
    precision = cfg.training.precision
    if precision == "bf16":
        ok = backend == "cpu" or bool(env.get("bf16_supported"))
        out.append({"check": "precision bf16", "ok": ok,
                    "detail": "supported" if ok else "this GPU has no bf16; use fp16 or fp32"})  # fmt: skip
    if ext.get("flash-attn"):
        if backend == "cuda":
            majors = [int(c.split(".")[0]) for c in caps if c[:1].isdigit()]
            ok = bool(majors) and min(majors) >= 8
            why = f"compute capability {caps}; flash-attn needs 8.0 (Ampere) or newer"
        elif backend == "rocm":
            ok = bool(caps) and all(c.split(":")[0] in ROCM_DATACENTER for c in caps)
            why = f"ROCm architectures {caps}; flash-attn builds for {ROCM_DATACENTER}"
        else:
            ok, why = False, "flash-attn is installed but needs a GPU; this backend is cpu"
        out.append({"check": "flash-attn", "ok": ok, "detail": why})
    return out
