"""Base model identity and loading; full / LoRA / freeze adaptation; audit; update check.

- `resolve_base(study) -> BaseModel` (GGUF converted once into a cache, see `models.gguf`)
- `load_tokenizer(base)`, `load_model(base, cfg, labels)`, `compute_device()` (CUDA when present)
- `adapt(model, cfg.adaptation, architecture) -> (model, audit)` (the audit is a dict)
- `capture_params(model)`, `check_update(before, model, step, method) -> violations`
- `save_trainable` / `load_trainable` (checkpoints), `compare_fresh_reload` (a new process
  reloads a saved model and must give the same outputs)

- A `BaseModel` has `.path` (a transformers folder; GGUF converted once to a cache folder),
  `.architecture` ("encoder" | "causal_lm" | "image") and `.identity` (name, revision, path, the
  sha256 of every weight, tokenizer and config file, `trust_remote_code`, and `sha256` over the
  file hashes and trust_remote_code, not name or path). A hub base (`model.name` without
  `model.path`) adds `source.hub` {repo_id, repo_type, revision asked, commit}
  (`hub_source(identity)`), `revision` = the commit, and `patterns`. A QLoRA base adds
  `identity["quantization"]` (outside `identity["sha256"]`).
- `resolve_model(model_cfg, root=None, commit=None)` (resolve_base without a Study; `commit`,
  else the one pinned in root's hypothesis), `resolve_recorded(model_cfg, root, identity)` (the
  commit a run recorded), `base_folder(model_cfg, root)` (the files, without loading),
  `convert_gguf(folder, filename) -> Path`, `verify_identity(identity, path=None)` (ModelError
  listing changed files), `enable_activation_checkpointing(model)`.
- `load_model`: an encoder gets AutoModelForSequenceClassification with `num_labels` and
  id2label, a causal LM AutoModelForCausalLM, an image model AutoModelForImageClassification
  with a head for the labels; `load_tokenizer` returns an image model's image processor. It sets
  `model.tunelab_new_params` (tensors newly initialized, e.g. the head); `adapt` sets
  `model.tunelab_expected_trainable` and `model.tunelab_method`. method `qlora`: the base's
  linear layers in 4 bits (`quantize.quantization_config`), LoRA added after
  `prepare_model_for_kbit_training`; the audit gains `quantization` and counts a packed 4-bit
  tensor by its weights (`quantize.quantized_numel`).
- `save_trainable(model, dir, method=None)` / `load_trainable(model, dir, method=None,
  trainable=False)` (method defaults to the model's `tunelab_method` / the folder's files);
  `trainable_dirname(method)` -> "adapter" | "model"; audit["saves"] is "adapter" | "model" |
  "trainable". `load_trainable` takes a fresh `load_model` result (eval, verify, export: LoRA
  wraps it in a PeftModel) or an `adapt`ed model (resume).
- `compare_fresh_reload(model, cfg, base, saved_dir, method, batch, labels=None, atol=1e-5) ->
  {max_abs_diff, atol, ok, seconds}` raises the new process's TunelabError again (a changed
  base: ModelError), CheckpointError otherwise.
- `check_update` returns violations; LoRA A may not move on step 1.
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
