"""Adaptation: full fine-tuning, LoRA through peft (on a 4-bit base: QLoRA), or freezing all but
named modules.

`adapt` returns the model to train and its parameter audit, and remembers on the model which
tensors are meant to train (`tunelab_expected_trainable`) so the update check can tell a module
frozen by mistake from one frozen on purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunelab.core.errors import ModelError
from tunelab.lib.models._quiet import quiet_transformers
from tunelab.lib.models.audit import parameter_audit

if TYPE_CHECKING:
    from tunelab.core.config_training import AdaptationConfig


LORA_FIELDS = {"target_modules", "rank", "alpha", "dropout", "modules_to_save"}
SETTINGS = LORA_FIELDS | {"trainable"}


def linear_module_names(model: Any) -> list[str]:
    """Names of the linear layers LoRA can adapt (nn.Linear and GPT-2 style Conv1D)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and n]


def head_module_names(model: Any, architecture: str) -> list[str]:
    """The classification head of an encoder: top-level children outside the base encoder."""
    if architecture not in ("encoder", "image"):
        return []
    prefix = getattr(model, "base_model_prefix", "")
    return [
        n
        for n, m in model.named_children()
        if n != prefix and any(True for _ in m.parameters(recurse=True))
    ]


def _matches(module_name: str, key: str) -> bool:
    return module_name == key or module_name.endswith("." + key)


def _suffixes(names: list[str]) -> list[str]:
    return sorted({n.split(".")[-1] for n in names})


def resolve_lora_targets(model: Any, target_modules: list[str] | str) -> list[str]:
    """The module names LoRA will adapt, or ModelError naming the available linear modules."""
    linear = linear_module_names(model)
    if target_modules == "all-linear":
        return []  # peft resolves it (every linear layer but the output layer); read back after
    missing = [t for t in target_modules if not any(_matches(n, t) for n in linear)]
    if missing:
        raise ModelError(
            f"adaptation.target_modules {missing} match no linear layer of the model",
            hint=f"available linear module names: {', '.join(_suffixes(linear))} "
            "(or use target_modules: all-linear)",
        )
    return [n for n in linear if any(_matches(n, t) for t in target_modules)]


def _expert_notes(model: Any) -> list[str]:
    """LoRA on a mixture-of-experts model: what it does not reach."""
    fused = [n for n, p in model.named_parameters() if ".experts." in n and not p.requires_grad]
    if not fused:
        return []
    return [
        f"the routed experts are fused parameters ({len(fused)} tensors such as "
        f"{fused[0].split('base_model.model.')[-1]}), not linear layers: LoRA's target_modules "
        "do not reach them, so they stay frozen; only the attention, the router where it is a "
        "linear layer, dense blocks and shared experts are adapted (audit groups experts, router)"
    ]


def adapt(model: Any, adaptation: AdaptationConfig, architecture: str) -> tuple[Any, dict]:
    """Prepare `model` for training by `adaptation.method`; returns (model, audit).

    Raises ModelError when a target, a module to save or a trainable pattern matches nothing.
    """
    method = adaptation.method
    new_params = list(getattr(model, "tunelab_new_params", []))
    notes: list[str] = []
    extra: dict[str, Any] = {}
    heads = head_module_names(model, architecture)
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        adapted, to_save, saves = [], [], "model"
    elif method in ("lora", "qlora"):
        if method == "qlora":
            model = _prepare_4bit(model)
            extra["quantization"] = _quantization_audit(model, adaptation)
        model, adapted, to_save, added = _apply_lora(model, adaptation, architecture, heads)
        saves = "adapter"
        extra["lora"] = {
            "rank": adaptation.rank,
            "alpha": adaptation.alpha,
            "dropout": adaptation.dropout,
            "target_modules": adaptation.target_modules,
        }
        extra["modules_to_save_added"] = added
        if added:
            notes.append(
                f"added {', '.join(added)} to modules_to_save: the new classification head "
                "must be trained and saved with the adapter"
            )
        frozen_new = [n for n in new_params if not any(n.startswith(m + ".") for m in to_save)]
        if frozen_new:
            notes.append(f"newly initialized tensors stay frozen at random values: {frozen_new}")
        notes += _expert_notes(model)
    elif method == "freeze":
        adapted = _apply_freeze(model, adaptation.trainable)
        to_save, saves = [], "trainable"
        extra["trainable_patterns"] = list(adaptation.trainable)
        frozen_new = [n for n in new_params if not any(s in n for s in adaptation.trainable)]
        if frozen_new:
            notes.append(
                f"newly initialized tensors stay frozen at random values: {frozen_new} "
                f"(add {heads or frozen_new} to adaptation.trainable to train them)"
            )
    else:  # the config validates the method; an unknown one here is a programming error
        raise AssertionError(f"unknown adaptation method {method!r}")
    used = {"full": set(), "lora": LORA_FIELDS, "qlora": LORA_FIELDS, "freeze": {"trainable"}}
    used = used[method]
    ignored = sorted((set(adaptation.model_fields_set) & SETTINGS) - used)
    if ignored:
        notes.append(
            f"ignored for method {method}: " + ", ".join(f"adaptation.{f}" for f in ignored)
        )
    extra["newly_initialized"] = new_params
    model.tunelab_expected_trainable = frozenset(
        n for n, p in model.named_parameters() if p.requires_grad
    )
    model.tunelab_method = method
    if not model.tunelab_expected_trainable:
        raise ModelError(
            f"adaptation {method!r} leaves no trainable parameter",
            hint="check adaptation.target_modules / adaptation.trainable",
        )
    audit = parameter_audit(
        model,
        method=method,
        adapted_modules=adapted,
        modules_to_save=to_save,
        saves=saves,
        extra=extra,
        notes=notes,
    )
    return model, audit


def _apply_lora(model: Any, adaptation: AdaptationConfig, architecture: str, heads: list[str]):
    from peft import LoraConfig, TaskType, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    resolve_lora_targets(model, adaptation.target_modules)
    module_names = [n for n, _ in model.named_modules() if n]
    to_save = list(adaptation.modules_to_save)
    unknown = [m for m in to_save if not any(_matches(n, m) for n in module_names)]
    if unknown:
        top = [n for n, _ in model.named_children()]
        raise ModelError(
            f"adaptation.modules_to_save {unknown} match no module of the model",
            hint=f"top-level modules: {', '.join(top)}; e.g. the head {heads or ['lm_head']}",
        )
    added = [h for h in heads if h not in to_save]
    to_save += added
    config = LoraConfig(
        r=adaptation.rank,
        lora_alpha=adaptation.alpha,
        lora_dropout=adaptation.dropout,
        target_modules=adaptation.target_modules,
        modules_to_save=list(to_save) or None,  # peft extends the list it is given
        # an image classifier: peft's generic PeftModel (it passes pixel_values through)
        task_type={"encoder": TaskType.SEQ_CLS, "image": None}.get(
            architecture, TaskType.CAUSAL_LM
        ),
    )
    with quiet_transformers():
        peft_model = get_peft_model(model, config)
    inner = peft_model.get_base_model()
    adapted = [n for n, m in inner.named_modules() if isinstance(m, LoraLayer)]
    saved = [n for n, m in inner.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    return peft_model, adapted, saved, added


def _prepare_4bit(model: Any) -> Any:
    """peft's preparation of a 4-bit base: norms and embeddings in fp32, inputs requiring grad
    (activation checkpointing stays training.activation_checkpointing's choice)."""
    from peft import prepare_model_for_kbit_training

    if not getattr(model, "is_loaded_in_4bit", False):
        raise AssertionError("qlora needs the base loaded in 4 bits (load_model)")
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _quantization_audit(model: Any, adaptation: AdaptationConfig) -> dict[str, Any]:
    from tunelab.lib.models.quantize import quantization_record, quantized_numel

    packed = [p for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    return {
        **quantization_record(adaptation.quantization),
        "quantized_tensors": len(packed),
        "quantized_params": sum(quantized_numel(p) for p in packed),
        "quantized_bytes": sum(p.numel() * p.element_size() for p in packed),
    }


def _apply_freeze(model: Any, patterns: list[str]) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    unmatched = [s for s in patterns if not any(s in n for n in names)]
    if unmatched:
        modules = sorted({".".join(n.split(".")[:-1]) for n in names})
        shown = ", ".join(modules[:12]) + (", ..." if len(modules) > 12 else "")
        raise ModelError(
            f"adaptation.trainable {unmatched} match no parameter name",
            hint=f"patterns are substrings of parameter names, e.g. {shown}",
        )
    trainable_modules = []
    for n, p in model.named_parameters():
        keep = any(s in n for s in patterns)
        p.requires_grad_(keep)
        if keep:
            module = ".".join(n.split(".")[:-1])
            if module not in trainable_modules:
                trainable_modules.append(module)
    return trainable_modules


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute activations in backward (non-reentrant), on a plain or a peft-wrapped model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ModelError(
            f"{type(inner).__name__} does not support activation checkpointing",
            hint="set training.activation_checkpointing: false",
        )
    kwargs = {"use_reentrant": False}
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5 name
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(inner.config, "use_cache"):
        inner.config.use_cache = False
