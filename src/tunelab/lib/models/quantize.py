"""QLoRA's 4-bit base: the bitsandbytes settings, a probe that they run here, the record.

`quantization_config(q)` is the transformers `BitsAndBytesConfig` for `adaptation.quantization`;
`qlora_problems(cfg)` is what `tunelab validate` refuses (bitsandbytes missing, or unable to run
the settings on the compute device); `quantization_record(q)` goes into the base identity and
the audit, since the 4-bit weights are the base as the run used it.

`qlora_problems(cfg)` also covers `training.optimizer` in `BNB_OPTIMIZERS` (AdamW8bit,
PagedAdamW8bit, built by `tunelab.stages.train.loop.build_optimizer` from bitsandbytes.optim);
`quantized_numel(p)` counts a packed 4-bit tensor by its weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunelab.core.errors import ModelError

if TYPE_CHECKING:
    from tunelab.core.config import StudyConfig
    from tunelab.core.config_training import QuantizationConfig

BNB_RANGE = (">=0.50", "<0.51")
INSTALL_HINT = "pip install 'tunelab[qlora]'"
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PROBE_FEATURES = 64  # one bitsandbytes block per row
# training.optimizer names served by bitsandbytes.optim (8-bit block-wise AdamW states)
BNB_OPTIMIZERS = ("AdamW8bit", "PagedAdamW8bit")
# transformers' names for a classification head (BERT, RoBERTa, DistilBERT, ViT, ConvNeXt, ...):
# bitsandbytes' default skips only an output embedding, so a head would load in 4 bits
CLASSIFIER_HEADS = ("classifier", "pre_classifier", "score")


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ModelError(
            f"adaptation.method qlora needs bitsandbytes, which cannot be imported ({exc})",
            hint=f"{INSTALL_HINT}, or choose adaptation.method lora",
        ) from None
    return bitsandbytes


def bnb_optimizer(name: str) -> Any:
    """bitsandbytes.optim's optimizer class `name` (ModelError naming the extra when absent)."""
    _bitsandbytes()
    import bitsandbytes.optim

    return getattr(bitsandbytes.optim, name)


def quantization_record(q: QuantizationConfig) -> dict[str, Any]:
    """The settings as recorded in the base identity and the audit (with bitsandbytes' version)."""
    return {
        "bits": 4,
        "quant_type": q.quant_type,
        "double_quant": q.double_quant,
        "compute_dtype": q.compute_dtype,
        "bitsandbytes": _bitsandbytes().__version__,
    }


def quantization_config(q: QuantizationConfig, architecture: str = "causal_lm") -> Any:
    """transformers' BitsAndBytesConfig loading every linear layer but the output one in 4 bits
    (a causal LM's lm_head; an encoder's or image model's classification head, which is new
    and trained in full: `CLASSIFIER_HEADS`)."""
    import torch
    from transformers import BitsAndBytesConfig

    _bitsandbytes()
    skip = list(CLASSIFIER_HEADS) if architecture in ("encoder", "image") else None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, COMPUTE_DTYPES[q.compute_dtype]),
        llm_int8_skip_modules=skip,
    )


def keep_weights_as_loaded(model: Any) -> None:
    """Turn off bitsandbytes' CPU inference repacking: it rewrites the frozen 4-bit weights in
    place on the first eval-mode forward (the update check would see them change) and needs
    in_features to be a multiple of its block size. A 4-bit layer's bias is cast to its
    compute dtype here, once: its forward casts it so in place, and computes with that copy."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            bias, dtype = module.bias, module.compute_dtype
            if bias is not None and dtype is not None and bias.dtype != dtype:
                bias.data = bias.data.to(dtype)


def quantized_numel(p: Any) -> int:
    """The number of weights a parameter stands for (a packed 4-bit tensor holds two per byte)."""
    state = getattr(p, "quant_state", None)
    return int(state.shape.numel()) if state is not None else p.numel()


def qlora_problems(cfg: StudyConfig) -> list[str]:
    """Why the study's qlora or 8-bit optimizer cannot run here (`field: why` lines; empty when
    it can or when neither is asked for): bitsandbytes missing or outside the tested range, or a 4-bit layer
    with the study's settings failing its forward and backward pass on the compute device."""
    if cfg.training.optimizer in BNB_OPTIMIZERS:
        try:
            _bitsandbytes()
        except ModelError as exc:
            return [f"training.optimizer {cfg.training.optimizer}: {exc.message} ({exc.hint})"]
    if cfg.adaptation.method != "qlora":
        return []
    q = cfg.adaptation.quantization
    try:
        bnb = _bitsandbytes()
    except ModelError as exc:
        return [f"adaptation.method: {exc.message} ({exc.hint})"]
    from packaging.version import Version

    if not Version("0.50") <= Version(bnb.__version__) < Version("0.51"):
        return [
            f"adaptation.method: qlora is tested with bitsandbytes {','.join(BNB_RANGE)}, "
            f"found {bnb.__version__} ({INSTALL_HINT})"
        ]
    from tunelab.lib.models.device import compute_device

    device = compute_device()
    try:
        _probe(bnb, q, device)
    except Exception as exc:
        return [
            f"adaptation.quantization: bitsandbytes {bnb.__version__} cannot run a 4-bit "
            f"{q.quant_type} layer with compute_dtype {q.compute_dtype} on {device.type} "
            f"({type(exc).__name__}: {str(exc)[:200]}); choose other settings or "
            "adaptation.method lora"
        ]
    return []


def _probe(bnb: Any, q: QuantizationConfig, device: Any) -> None:
    import torch

    n = PROBE_FEATURES
    dtype = getattr(torch, COMPUTE_DTYPES[q.compute_dtype])
    layer = bnb.nn.Linear4bit(
        n, n, quant_type=q.quant_type, compress_statistics=q.double_quant, compute_dtype=dtype
    )
    layer.support_avx512bf16_for_cpu = False
    layer = layer.to(device)  # quantizes the weight
    x = torch.ones(2, n, device=device, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    if not torch.isfinite(y.float()).all() or x.grad is None:
        raise RuntimeError("non-finite output or no gradient through the 4-bit layer")
