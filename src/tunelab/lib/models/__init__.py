"""Base model identity and loading; full / LoRA / freeze adaptation; audit; update check.

- `resolve_base(study) -> BaseModel` (GGUF converted once into a cache, see `models.gguf`)
- `load_tokenizer(base)`, `load_model(base, cfg, labels)`, `compute_device()` (CUDA when present)
- `adapt(model, cfg.adaptation, architecture) -> (model, audit)` (the audit is a dict)
- `capture_params(model)`, `check_update(before, model, step, method) -> violations`
- `save_trainable` / `load_trainable` (checkpoints), `compare_fresh_reload` (a new process
  reloads a saved model and must give the same outputs)
"""

from tunelab.lib.models.adapt import (
    adapt,
    enable_activation_checkpointing,
    head_module_names,
    linear_module_names,
)
from tunelab.lib.models.audit import param_group, parameter_audit, strip_wrappers
from tunelab.lib.models.device import compute_device
from tunelab.lib.models.gguf import cache_root, convert_gguf
from tunelab.lib.models.identity import (
    detect_architecture,
    hash_file,
    hub_source,
    model_identity,
    verify_identity,
)
from tunelab.lib.models.loading import (
    BaseModel,
    load_model,
    load_tokenizer,
    resolve_base,
    resolve_model,
    resolve_recorded,
)
from tunelab.lib.models.persist import (
    load_trainable,
    method_of,
    save_trainable,
    saved_method,
    trainable_dirname,
)
from tunelab.lib.models.reload import compare_fresh_reload
from tunelab.lib.models.update import (
    ParamSnapshot,
    UpdateResult,
    capture_params,
    check_update,
    classify_update,
)

__all__ = [
    "BaseModel",
    "ParamSnapshot",
    "UpdateResult",
    "adapt",
    "cache_root",
    "capture_params",
    "check_update",
    "classify_update",
    "compare_fresh_reload",
    "compute_device",
    "convert_gguf",
    "detect_architecture",
    "enable_activation_checkpointing",
    "hash_file",
    "head_module_names",
    "hub_source",
    "linear_module_names",
    "load_model",
    "load_tokenizer",
    "load_trainable",
    "method_of",
    "model_identity",
    "param_group",
    "parameter_audit",
    "resolve_base",
    "resolve_model",
    "resolve_recorded",
    "save_trainable",
    "saved_method",
    "strip_wrappers",
    "trainable_dirname",
    "verify_identity",
]
