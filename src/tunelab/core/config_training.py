"""The study config's sections for the model and its training: model, quantization,
adaptation, preprocess (text and images), training, evaluation and budget.
`tunelab.core.config.StudyConfig` gathers them.

- `EVALUATION_SPEED_FIELDS` (`evaluation.num_threads`, `evaluation.draft_tokens`) are left out of
  the locked evaluation spec. `preprocess.image` (`ImageTransformsConfig`) is absent from the
  dump when unset.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictFloat, field_validator, model_serializer, model_validator

from tunelab.core.config_sections import HUB_ID, Section, without_defaults, without_unset

# ---------------------------------------------------------------- model and adaptation


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local transformers folder, or a folder holding gguf_file."
    )
    gguf_file: str | None = Field(
        None, description="GGUF file inside path (or in the hub repo), converted once to a cache."
    )
    name: str | None = Field(
        None,
        description="Hub repo id (org/name) when path is absent; with path, the base's human name.",
    )
    revision: str | None = Field(
        None, description="Hub branch, tag or 40-hex commit of name (default main); hub only."
    )
    allow_pickle: bool = Field(
        False, description="Hub repo without safetensors: load its *.bin / *.pt pickles."
    )
    architecture: Literal["auto", "encoder", "causal_lm", "image"] = "auto"
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @property
    def hub_id(self) -> str | None:
        """The hub repo id when the base comes from the hub (name without path), else None."""
        return self.name if self.path is None else None

    @model_validator(mode="after")
    def _check_source(self) -> ModelConfig:
        if self.path is None and not self.name:
            raise ValueError("set model.path (a local folder) or model.name (a hub repo id)")
        if self.path is not None and self.revision is not None:
            raise ValueError(
                "model.path and model.revision: choose one (a local folder is pinned by its "
                "files' sha256; a revision pins a hub repo named by model.name without path)"
            )
        if self.path is None and not HUB_ID.fullmatch(self.name or ""):
            raise ValueError(
                f"model.name {self.name!r} is not a hub repo id (org/name); for a local folder "
                "set model.path"
            )
        return self


class QuantizationConfig(Section):
    """qlora: how bitsandbytes stores the frozen base (4 bits) and computes with it."""

    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type of the base.")
    double_quant: bool = Field(
        True, description="Quantize the block-wise scales too (about 0.4 bit per weight less)."
    )
    compute_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="dtype the 4-bit weights are dequantized to for each matmul."
    )


class AdaptationConfig(Section):
    method: Literal["full", "lora", "freeze", "qlora"] = Field(
        "lora", description="qlora: LoRA on a base loaded in 4 bits (bitsandbytes)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )
    rank: int = Field(8, ge=1)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0, lt=1)
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Extra modules trained and saved in full, e.g. a classifier head.",
    )
    trainable: list[str] = Field(
        default_factory=list,
        description="freeze: names (substrings) of the modules left trainable.",
    )
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="qlora: the 4-bit base's settings."
    )

    @model_validator(mode="after")
    def _check_method(self) -> AdaptationConfig:
        if self.method == "freeze" and not self.trainable:
            raise ValueError("method 'freeze' needs adaptation.trainable (modules left trainable)")
        return self


# ---------------------------------------------------------------- preprocessing


class ImageTransformsConfig(Section):
    """image_classification: the transform chain; unset sizes and statistics come from the
    base model's image processor (preprocessor_config.json)."""

    resize: int | None = Field(
        None, ge=1, description="Resize to this square size in pixels (processor's size if unset)."
    )
    crop: int | None = Field(
        None, ge=1, description="Center crop to this square size (processor's crop_size if set)."
    )
    mean: list[float] | None = Field(None, description="Per-channel mean (processor's if unset).")
    std: list[float] | None = Field(None, description="Per-channel std (processor's if unset).")
    train_random_crop: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Training only: crop a random square of this share of the side, then resize.",
    )
    train_flip: bool = Field(False, description="Training only: random horizontal flip.")


class PreprocessConfig(Section):
    max_seq_len: int = Field(256, ge=8)
    template: Literal["chat", "plain"] = Field(
        "chat", description="chat: the tokenizer's chat template; plain: plain_template."
    )
    plain_template: str = Field(
        "{instruction}\n\n### Input:\n{input}\n\n### Answer:\n",
        description="Prompt template with {instruction} and {input}; the target follows it.",
    )
    truncation_side: Literal["left", "right"] = Field(
        "right", description="Which side of the prompt input is cut when too long."
    )
    train_on_prompt: bool = False
    allow_target_truncation: bool = False
    image: ImageTransformsConfig | None = Field(
        None, description="image_classification: resize, crop, normalize, training augmentation."
    )
    instruction_role: Literal["user", "system"] = Field(
        "user",
        description="Chat turn holding task.instruction; system falls back to the user turn "
        "(with a note) where the template refuses a system role.",
    )
    chat_template_kwargs: dict[str, bool | int | float | str] | None = Field(
        None, description="Arguments of the chat template, e.g. {enable_thinking: false}."
    )

    @model_serializer(mode="wrap")
    def _drop_unset_image(self, handler: Any) -> dict[str, Any]:
        # absent when unset, so the locked evaluation specs of text studies keep their sha256
        out = without_unset(self, handler, "image")
        out = {k: v for k, v in out.items() if k != "chat_template_kwargs" or v is not None}
        if out.get("instruction_role") == "user":
            out.pop("instruction_role")
        return out


# ---------------------------------------------------------------- training


# the URL schemes a shard store may use: a folder (file), a bucket of a cloud's object store
# (fsspec's s3fs, gcsfs, adlfs), or fsspec's in-process memory (tests)
SHARD_STORE_SCHEMES = ("file", "s3", "gs", "gcs", "az", "abfs", "abfss", "memory")


def shard_store_problem(value: str) -> str | None:
    """Why `value` cannot be training.shard_store (None when it can): an absolute folder, or a
    URL of SHARD_STORE_SCHEMES with a bucket or path after `://`."""
    if "://" not in value:
        if not value.startswith("/"):
            return (
                "a folder must be absolute (the same path on every node), e.g. /mnt/shared/ckpt; "
                "or give a URL such as s3://bucket/prefix"
            )
        return None
    scheme, rest = value.split("://", 1)
    if scheme not in SHARD_STORE_SCHEMES:
        return f"unknown scheme {scheme!r}: use one of {', '.join(SHARD_STORE_SCHEMES)}"
    if scheme == "file" and not rest.startswith("/"):
        return "a file:// URL names an absolute folder: file:///mnt/shared/ckpt"
    if not rest.strip("/"):
        return f"{scheme}:// names no bucket or folder"
    return None


class TrainingConfig(Section):
    seed: int = 0
    micro_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides num_epochs.")
    num_epochs: float = Field(1.0, gt=0)
    optimizer: str = Field(
        "AdamW",
        description="Any torch.optim optimizer by name, or AdamW8bit / PagedAdamW8bit "
        "(bitsandbytes, the qlora extra).",
    )
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = 0.0
    betas: Annotated[tuple[StrictFloat, StrictFloat], Field(strict=False)] = (0.9, 0.999)
    schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float | None = 1.0
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast on a CUDA device with bf16, else fp32."
    )
    compile: bool = Field(False, description="torch.compile each decoder block.")
    attention: Literal["auto", "flash_varlen", "torch_varlen", "flex", "per_example"] = Field(
        "auto", description="Attention of packed rows; auto: the best that runs here and is exact."
    )
    activation_checkpointing: bool = False
    packing: bool = Field(True, description="Padding-free batches for causal LMs where exact.")
    eval_every_steps: int | None = None
    checkpoint_every_steps: int | None = None
    keep_last_checkpoints: int = Field(2, ge=1)
    update_check_steps: int = Field(
        2, ge=1, description="Steps after which every trainable tensor must have moved."
    )
    num_threads: int | None = None
    log_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Live mirrors of the step metrics: tensorboard (event files in the run "
        "folder), mlflow (the server or store named by MLFLOW_TRACKING_URI), wandb (WANDB_* "
        "settings).",
    )

    shard_store: str | None = Field(
        None,
        description="Where a full fine-tune under FSDP on several nodes writes its checkpoint "
        "shards: a folder every node mounts (/mnt/shared/ckpt, file:///...) or an fsspec URL "
        "(s3://bucket/prefix, gs://..., az://...); needed there, unused otherwise.",
    )

    @field_validator("shard_store")
    @classmethod
    def _check_shard_store(cls, value: str | None) -> str | None:
        if value is None:
            return value
        problem = shard_store_problem(value)
        if problem:
            raise ValueError(f"training.shard_store {value!r}: {problem}")
        return value

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return without_unset(self, handler, "shard_store")

    @model_validator(mode="after")
    def _check_log_to(self) -> TrainingConfig:
        if len(set(self.log_to)) != len(self.log_to):
            raise ValueError(f"training.log_to names a backend twice: {self.log_to}")
        return self


class EvaluationConfig(Section):
    split: Literal["validation", "test"] = "validation"
    batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    decoding: Literal["greedy"] = "greedy"
    seed: int = 0
    max_examples: int | None = Field(
        None, description="Evaluate the first N examples of the split."
    )
    bootstrap_samples: int = 1000
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1.0,
        description="Two-sided level of every interval; each one-sided "
        "test (a guardrail, the primary metric) runs at (1 - confidence) / 2.",
    )
    interval_method: Literal["wilson", "bootstrap"] = Field(
        "wilson",
        description="Interval of a rate judged against an absolute bound "
        "(json_valid_rate >= 0.99): Wilson score, or the bootstrap. Deltas always use the "
        "paired bootstrap.",
    )
    multiplicity: Literal["holm", "bonferroni", "none"] = Field(
        "holm", description="Family-wise error control over the guardrail checks of a comparison."
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for inference; unset: the cores free when it starts (the "
        "process's cores less other processes' threads runnable now). Not part of the locked "
        "procedure.",
    )
    draft_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="Tokens a row may propose per decoding step, looked up in its prompt and "
        "the earlier answers, and kept only where greedy decoding agrees (0: `generate`, one "
        "token per step). Speed alone: the outputs are the greedy ones. Not part of the locked "
        "procedure.",
    )

    @model_serializer(mode="wrap")
    def _drop_default_tests(self, handler: Any) -> dict[str, Any]:
        return without_defaults(self, handler, EVALUATION_TEST_FIELDS)


# the tests a decision runs: locked with the spec, absent from it at their defaults
EVALUATION_TEST_FIELDS = ("confidence", "interval_method", "multiplicity")
# evaluation settings of speed alone: outside the locked evaluation spec
EVALUATION_SPEED_FIELDS = {"num_threads", "draft_tokens"}


class BudgetConfig(Section):
    rental_days: Literal[3, 7, 30] = 7
    gpu_hour_price: float = Field(2.5, ge=0)
    gpu: str = "1x H100 80GB"
    hours_per_day: float = Field(24.0, gt=0, le=24)
    num_variants: int = Field(4, ge=1, description="Experiments the study intends to run.")
