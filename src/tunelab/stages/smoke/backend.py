"""`tunelab env --check`: whether the study's model, extensions and adaptation method work on
this machine's backend, before a rented machine is paid to find out by a crash.

Each check is real: the model is built from its config on the meta device (no weights read),
LoRA's target modules are looked up in it, QLoRA's 4-bit layer and an 8-bit optimizer run a
step on the compute device (bitsandbytes, on CUDA, ROCm or the CPU), the precision's autocast
runs a matmul, flash-attn is imported and called on the GPU after its compute capability (CUDA)
or architecture (ROCm) is read, and liger-kernel's fused cross-entropy runs forward and
backward. Each line is PASS, FAIL or N-A with its reason, and says whether the study needs it
here (`needed`): a check the study would use on this machine. `backend_checks(study)` returns
the lines; the CLI exits 2 when a needed one fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import TunelabError
from tunelab.core.records import dumps_json
from tunelab.core.run_parts import RunEnv

if TYPE_CHECKING:
    import torch

    from tunelab.core.config import StudyConfig
    from tunelab.core.study import Study

PASS, FAIL, NA = "PASS", "FAIL", "N-A"
# ROCm architectures flash-attn builds for (MI200, MI300, MI350)
ROCM_FLASH = ("gfx90a", "gfx942", "gfx950")
HALF = ("bf16", "fp16")


@dataclass
class Check:
    check: str
    result: str  # PASS | FAIL | N-A
    detail: str
    needed: bool = True  # the study uses it on this machine: a FAIL stops it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _why(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, TunelabError) else str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())[:200]}"


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name(device: torch.device) -> str:
    """'NVIDIA H200 (compute capability 9.0)', 'AMD Instinct MI300X (gfx942)' or 'cpu'."""
    import torch

    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return f"{props.name} ({props.gcnArchName.split(':')[0]})"
    return f"{props.name} (compute capability {props.major}.{props.minor})"


def _backend_line(env: RunEnv, device: torch.device) -> Check:
    if device.type == "cpu":
        why = f"cpu: {(env.cpu or {}).get('name')}, {env.logical_cores} cores"
        if env.backend != "cpu":
            why += f" (TUNELAB_DEVICE=cpu; this machine has {env.backend})"
    else:
        version = f"ROCm {env.rocm}" if env.rocm else f"CUDA {env.cuda}"
        why = f"{env.backend}: {_device_name(device)}, {version}, driver {env.driver or '?'}"
    return Check("backend", PASS, f"{why}; torch {env.torch}")


# ------------------------------------------------------------------ the model


def meta_model(study: Study) -> tuple[Any, str]:
    """(the study's base model built from its config on the meta device, its architecture);
    no weight is read. Raises ModelError (or what transformers raises) when it cannot be built."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from tunelab.core.errors import ModelError
    from tunelab.lib.models._quiet import quiet_transformers
    from tunelab.lib.models.gguf import convert_gguf
    from tunelab.lib.models.identity import detect_architecture, read_model_config
    from tunelab.lib.models.loading import base_folder
    from tunelab.lib.models.vision import image_model_class

    mcfg = study.config.model
    folder = base_folder(mcfg, study.root)
    if not folder.is_dir():
        raise ModelError(f"the base's folder {folder} does not exist",
                         hint="check model.path, or pin a hub base with `tunelab register`")  # fmt: skip
    if mcfg.gguf_file:
        folder = convert_gguf(folder, mcfg.gguf_file)
    config = read_model_config(folder)
    if config.get("auto_map") and not mcfg.trust_remote_code:
        raise ModelError(f"{folder}/config.json asks for custom code and trust_remote_code is off")
    arch = mcfg.architecture if mcfg.architecture != "auto" else detect_architecture(config)
    auto = {"causal_lm": AutoModelForCausalLM, "encoder": AutoModelForSequenceClassification}
    with quiet_transformers(), init_empty_weights():
        tconfig = AutoConfig.from_pretrained(folder, trust_remote_code=mcfg.trust_remote_code)
        model = auto.get(arch, image_model_class()).from_config(
            tconfig, trust_remote_code=mcfg.trust_remote_code
        )
    model.tie_weights()  # from_config ties only tensors that have storage
    return model, arch


def _model_line(study: Study) -> tuple[Check, Any, str | None]:
    try:
        model, arch = meta_model(study)
    except Exception as exc:  # noqa: BLE001 - any failure to build it is the finding
        return Check("model", FAIL, f"cannot be built: {_why(exc)}"), None, None
    n = sum(p.numel() for p in model.parameters())
    attention = getattr(model.config, "_attn_implementation", None)
    detail = f"{type(model).__name__} ({arch}), {n / 1e6:.1f}M parameters, attention {attention}"
    return Check("model", PASS, detail), model, arch


# ------------------------------------------------------------------ method and optimizer


def _targets(cfg: StudyConfig, model: Any) -> str:
    """What the adaptation reaches in `model` (ModelError when its modules are absent)."""
    from tunelab.core.errors import ModelError
    from tunelab.lib.models.adapt import resolve_lora_targets

    a = cfg.adaptation
    if a.method == "freeze":
        names = [n for n, _ in model.named_modules() if any(t in n for t in a.trainable)]
        if not names:
            raise ModelError(f"adaptation.trainable {a.trainable} matches no module of the model")
        return f"{len(names)} modules left trainable"
    if a.method == "full":
        return "every parameter trained"
    found = resolve_lora_targets(model, a.target_modules)
    if not found:  # all-linear: peft resolves it when it adapts the model
        return "LoRA on every linear module but the output layer (all-linear)"
    return f"LoRA on {len(found)} modules ({', '.join(a.target_modules)})"


def _adaptation_line(cfg: StudyConfig, model: Any) -> Check:
    from tunelab.lib.models.quantize import qlora_problems

    name = f"adaptation {cfg.adaptation.method}"
    problems = [p for p in qlora_problems(cfg) if not p.startswith("training.optimizer")]
    if problems:
        return Check(name, FAIL, "; ".join(problems))
    if model is None:
        return Check(name, NA, "the model could not be built (see model)")
    try:
        detail = _targets(cfg, model)
    except TunelabError as exc:
        return Check(name, FAIL, f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    if cfg.adaptation.method == "qlora":
        q = cfg.adaptation.quantization
        detail += (f"; a 4-bit {q.quant_type} layer (compute {q.compute_dtype}) ran forward and "
                   f"backward here, bitsandbytes {_version('bitsandbytes')}")  # fmt: skip
    return Check(name, PASS, detail)


def _optimizer_line(cfg: StudyConfig, device: torch.device) -> Check | None:
    """An 8-bit optimizer (bitsandbytes) takes a step on the device; None for torch's own."""
    import torch

    from tunelab.lib.models.quantize import BNB_OPTIMIZERS, bnb_optimizer

    name = cfg.training.optimizer
    if name not in BNB_OPTIMIZERS:
        return None
    try:
        # 8-bit states start at 4,096 elements (bitsandbytes' min_8bit_size)
        p = torch.nn.Parameter(torch.ones(4096, device=device))
        opt = bnb_optimizer(name)([p], lr=1e-3)
        p.grad = torch.ones_like(p)
        opt.step()
        if not torch.isfinite(p).all():
            raise RuntimeError("the step left non-finite weights")
    except Exception as exc:  # noqa: BLE001 - the extension's own failure is the finding
        return Check(f"optimizer {name}", FAIL, f"cannot step on {device.type}: {_why(exc)}")
    return Check(f"optimizer {name}", PASS, f"bitsandbytes {_version('bitsandbytes')} stepped")


# ------------------------------------------------------------------ precision and kernels


def _precision_line(cfg: StudyConfig, device: torch.device) -> tuple[Check, str]:
    import torch

    from tunelab.stages.train.precision import precision_choice

    chosen, why = precision_choice(cfg.training.precision, device)
    name = f"precision {cfg.training.precision}"
    if chosen == "fp32":
        return Check(name, PASS, f"fp32 ({why})"), chosen
    if device.type == "cuda" and chosen == "bf16" and not torch.cuda.is_bf16_supported():
        return Check(name, FAIL, f"{_device_name(device)} has no bf16; use fp16 or fp32"), chosen
    dtype = torch.bfloat16 if chosen == "bf16" else torch.float16
    try:
        with torch.autocast(device.type, dtype=dtype):
            y = torch.ones(16, 16, device=device) @ torch.ones(16, 16, device=device)
        if y.dtype != dtype or not torch.isfinite(y).all():
            raise RuntimeError(f"autocast computed in {y.dtype}")
    except Exception as exc:  # noqa: BLE001 - the backend's failure is the finding
        return Check(name, FAIL, f"{chosen} autocast fails on {device.type}: {_why(exc)}"), chosen
    return Check(name, PASS, f"{chosen} autocast ran a matmul ({why})"), chosen


def _flash_problem(device: torch.device) -> str | None:
    """Why flash-attn cannot run on `device`; None after a real varlen call ran."""
    import torch

    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - an ABI mismatch with torch raises ImportError/OSError
        return f"cannot be imported ({_why(exc)}): a build for another torch or CUDA"
    if device.type != "cuda":
        return "needs a CUDA or ROCm GPU; this device is cpu"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = props.gcnArchName.split(":")[0]
        if arch not in ROCM_FLASH:
            return f"ROCm architecture {arch}: flash-attn builds for {', '.join(ROCM_FLASH)}"
    elif (props.major, props.minor) < (8, 0):
        return f"{_device_name(device)}: FlashAttention-2 needs 8.0 (Ampere) or newer"
    try:
        q = torch.ones(4, 2, 64, device=device, dtype=torch.float16)  # [tokens, heads, dim]
        cu = torch.tensor([0, 2, 4], device=device, dtype=torch.int32)
        flash_attn_varlen_func(q, q, q, cu, cu, 2, 2, causal=True)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - "no kernel image" and the like
        return f"a varlen call failed on {_device_name(device)}: {_why(exc)}"
    return None


def _flash_line(cfg: StudyConfig, device: torch.device, precision: str, arch: str | None) -> Check:
    requested = cfg.training.attention == "flash_varlen"
    if importlib.util.find_spec("flash_attn") is None:
        if requested:
            return Check("flash-attn", FAIL, "training.attention flash_varlen: not installed")
        return Check("flash-attn", NA, "not installed; packed rows use torch's own attention",
                     needed=False)  # fmt: skip
    # auto tries it first where it can run (`stages.train.attention.candidates`)
    used = requested or (
        cfg.training.attention == "auto"
        and device.type == "cuda"
        and precision in HALF
        and arch == "causal_lm"
    )
    problem = _flash_problem(device)
    if problem:
        return Check("flash-attn", FAIL, problem, needed=used)
    detail = f"flash-attn {_version('flash-attn') or _version('flash_attn')} ran on "
    return Check("flash-attn", PASS, detail + _device_name(device), needed=used)


def _liger_line(device: torch.device, arch: str | None) -> Check:
    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        return Check("liger-kernel", NA, "not installed; the loss uses tunelab's fused "
                     "cross-entropy", needed=False)  # fmt: skip
    # the loss takes it on CUDA for a causal LM (`stages.train.losses.cross_entropy_kind`)
    used = device.type == "cuda" and arch == "causal_lm"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        if device.type != "cuda":
            return Check("liger-kernel", NA, "installed; its Triton kernels run on GPUs only",
                         needed=False)  # fmt: skip
        hidden = torch.ones(4, 64, device=device, requires_grad=True)  # [tokens, hidden]
        weight = torch.ones(128, 64, device=device)  # [vocab, hidden]
        targets = torch.tensor([0, 1, 2, 3], device=device)
        liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum").backward()
    except Exception as exc:  # noqa: BLE001 - Triton's failure to compile is the finding
        return Check("liger-kernel", FAIL, f"fused cross-entropy fails: {_why(exc)}", needed=used)
    return Check("liger-kernel", PASS, f"liger-kernel {_version('liger-kernel')} ran "
                 f"forward and backward on {_device_name(device)}", needed=used)  # fmt: skip


def _this_env(env: dict[str, Any]) -> RunEnv:
    """This machine's environment read as a run's env.json reads (its JSON, as written)."""
    return RunEnv.of(Path("this machine's environment"), json.loads(dumps_json(env)))


def backend_checks(study: Study) -> list[Check]:
    """The checks of `study` on this machine, in the order a run meets them."""
    from tunelab.core.env import capture_env
    from tunelab.lib.models.device import compute_device

    device = compute_device()
    cfg = study.config
    model_line, model, arch = _model_line(study)
    precision_line, precision = _precision_line(cfg, device)
    lines = [
        _backend_line(_this_env(capture_env()), device),
        model_line,
        _adaptation_line(cfg, model),
        _optimizer_line(cfg, device),
        precision_line,
        _flash_line(cfg, device, precision, arch),
        _liger_line(device, arch),
    ]
    return [line for line in lines if line is not None]
