"""What the memory model needs to know about a loaded (and adapted) model: `model_facts`.

The roles of the parameters of each transformer block (q k v o gate up down norm1 norm2) are
read from their names, so the estimate knows which linear layers train in full, which carry a
LoRA adapter and which are frozen. Also `count_saved_bytes`: the bytes autograd really keeps for
backward during a forward pass, to check the analytic walk against.

`model_facts(model, architecture)`; ViT / DeiT blocks are walked as the "bert" family
(approximate); ResNet and ConvNeXt give family "resnet" | "convnext" with `conv` (image_size:
the config's or `DEFAULT_IMAGE_SIZE`). `count_saved_bytes(model, forward, backward=None)` keeps
nothing afterwards (without `backward` the graph holds keys, not tensors: no backward through it;
with it, detached aliases, and `backward(out)` runs once the hooks are left: the same count).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tunelab.stages.sizing.stage_walk import stages_of
from tunelab.stages.sizing.terms import ModelFacts

_LLAMA_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "granite"}
_BERT_TYPES = {"bert", "roberta", "xlm-roberta", "camembert", "electra"}
# ViTs: a BERT-like encoder over patch tokens (pre-norm); walked as "bert", approximate
_VIT_TYPES = {"vit", "deit", "swin"}
_LAYER = re.compile(r"\.layers?\.(\d+)\.")
# conv nets, walked feature map by feature map (sizing.memory): their config's fields
_CONV_TYPES = {"resnet", "convnext"}
_CONV_FIELDS = (
    "num_channels",
    "embedding_size",
    "hidden_sizes",
    "depths",
    "layer_type",
    "hidden_act",
    "downsample_in_first_stage",
    "downsample_in_bottleneck",
    "patch_size",
    "layer_scale_init_value",
    "drop_path_rate",
)
DEFAULT_IMAGE_SIZE = 224  # what `tunelab size` feeds a model whose config names no image size
_ROLES_LLAMA = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    # mixture-of-experts blocks (tunelab.lib.models.moe): fused experts, router, shared experts
    "mlp.experts": "experts",
    "block_sparse_moe.experts": "experts",
    "mlp.gate": "router",
    "mlp.router": "router",
    "block_sparse_moe.router": "router",
    "mlp.shared_expert_gate": "router",
    **{
        f"{m}.{p}": "shared"
        for m in ("mlp.shared_expert", "mlp.shared_experts")
        for p in ("gate_proj", "up_proj", "down_proj")
    },
    "shared_mlp.input_linear": "shared",
    "shared_mlp.output_linear": "shared",
}
_ROLES_BERT = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "norm2",
}


_ROLES_VIT = {
    "attention.q_proj": "q",
    "attention.k_proj": "k",
    "attention.v_proj": "v",
    "attention.o_proj": "o",
    "layernorm_before": "norm1",
    "mlp.fc1": "up",
    "mlp.fc2": "down",
    "layernorm_after": "norm2",
}


_STAGE_BLOCK = re.compile(r"\.layers\.(\d+)\.blocks\.(\d+)\.")


def _flat_blocks(name: str, stages: list[dict[str, int]] | None) -> str:
    """A Swin block's name with its stage and block numbers as one layer index:
    'encoder.layers.1.blocks.0.mlp.fc1' -> 'encoder.layers.2.mlp.fc1' after a stage of 2."""
    found = _STAGE_BLOCK.search(name) if stages else None
    if found is None:
        return name
    stage, block = int(found.group(1)), int(found.group(2))
    flat = sum(s["depth"] for s in stages[:stage]) + block
    return name[: found.start()] + f".layers.{flat}." + name[found.end() :]


def _plain(name: str) -> str:
    """A parameter name without peft's wrappers: adapters and saved-module copies removed."""
    name = name.removeprefix("module.").removeprefix("base_model.model.")
    name = re.sub(r"\.lora_[AB]\.[^.]+\.", ".", name)
    name = name.replace(".modules_to_save.default.", ".").replace(".original_module.", ".")
    return name.replace(".base_layer.", ".")


def _role(name: str, roles: dict[str, str]) -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' -> 'q' (the module path after the layer index)."""
    module = name.rsplit(".", 1)[0]
    parts = _LAYER.split(module, maxsplit=1)
    return roles.get(parts[-1]) if len(parts) == 3 else None


@dataclass
class _Counted:
    """What walking a model's parameters finds: bytes by dtype, what trains and where."""

    layer_training: list[dict[str, str]]
    weight_bytes: dict[str, int] = field(default_factory=dict)
    trainable: int = 0
    trainable_bytes: int = 0
    largest: int = 0
    total: int = 0
    top: dict[str, str | None] = field(
        default_factory=lambda: {"embed": None, "final_norm": None, "pooler": None, "head": None}
    )
    quant: _QuantCount = field(default_factory=lambda: _QuantCount())


def _count_parameters(
    model: Any, roles: dict[str, str], stages: list[dict[str, int]] | None, layers: int
) -> _Counted:
    """Each parameter once (tied ones shared): its bytes, and if it trains, its block and role
    ("weight" or "lora") or its place outside the blocks (embed, pooler, head, final norm)."""
    out = _Counted([{} for _ in range(layers)])
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        dtype = str(p.dtype).removeprefix("torch.")
        out.weight_bytes[dtype] = out.weight_bytes.get(dtype, 0) + p.numel() * p.element_size()
        out.total += out.quant.add(p)
        if not p.requires_grad:
            continue
        out.trainable += p.numel()
        out.trainable_bytes += p.numel() * p.element_size()
        out.largest = max(out.largest, p.numel() * p.element_size())
        kind = "lora" if ".lora_" in name else "weight"
        plain = _flat_blocks(_plain(name), stages)
        m = _LAYER.search(plain)
        if m:
            role = _role(plain, roles)
            if role is not None and int(m.group(1)) < layers:
                current = out.layer_training[int(m.group(1))].get(role)
                out.layer_training[int(m.group(1))][role] = (
                    "weight" if current == "weight" else kind
                )
            continue
        module = plain.rsplit(".", 1)[0]
        if "embed" in module or module.startswith(("wte", "wpe")):
            out.top["embed"] = "weight"
        elif "pooler" in module:
            out.top["pooler"] = kind
        elif module.split(".")[0] in ("lm_head", "classifier", "score"):
            out.top["head"] = kind
        elif "norm" in module.lower():
            out.top["final_norm"] = kind
    return out


def _dropouts(cfg: Any, family: str) -> tuple[float, float]:
    """(attention, hidden) dropout of the model's config."""
    if family == "llama":
        return float(getattr(cfg, "attention_dropout", 0.0) or 0.0), 0.0
    attention = float(getattr(cfg, "attention_probs_dropout_prob", None) or 0.0)
    return attention, float(getattr(cfg, "hidden_dropout_prob", None) or 0.0)


def model_facts(model: Any, architecture: str, *, lora_rank: int = 0, lora_dropout: float = 0.0):
    """ModelFacts of `model` as adapted (trainable flags read from requires_grad)."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", "")
    if model_type in _CONV_TYPES:
        return _conv_facts(model, architecture, lora_rank=lora_rank, lora_dropout=lora_dropout)
    family = "bert" if model_type in _BERT_TYPES | _VIT_TYPES else "llama"
    approximate = model_type not in _LLAMA_TYPES | _BERT_TYPES
    roles = _ROLES_BERT if family == "bert" else _ROLES_LLAMA
    if model_type in _VIT_TYPES:
        roles = _ROLES_VIT
    stages = stages_of(cfg)
    layers = sum(s["depth"] for s in stages) if stages else int(cfg.num_hidden_layers)
    heads = stages[-1]["heads"] if stages else int(getattr(cfg, "num_attention_heads", 1))
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    counted = _count_parameters(model, roles, stages, layers)
    top = counted.top
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and architecture == "causal_lm"
    if tied and top["embed"] and not top["head"]:
        top["head"] = top["embed"]
    dropout_attn, dropout_hidden = _dropouts(cfg, family)
    return ModelFacts(
        family=family,
        architecture=architecture,
        hidden=hidden,
        intermediate=int(getattr(cfg, "intermediate_size", 4 * hidden)),
        layers=layers,
        heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(getattr(cfg, "vocab_size", 0) or 0),  # an image model has none
        num_labels=int(getattr(cfg, "num_labels", 0) or 0)
        if architecture in ("encoder", "image")
        else 0,
        tied_embeddings=tied,
        attention_dropout=dropout_attn,
        hidden_dropout=dropout_hidden,
        param_dtype=_param_dtype(counted.weight_bytes, counted.quant),
        weight_bytes=counted.weight_bytes,
        num_params=counted.total,
        trainable_params=counted.trainable,
        trainable_bytes=counted.trainable_bytes,
        largest_trainable_bytes=counted.largest,
        layer_training=tuple(counted.layer_training),
        lora_rank=lora_rank,
        lora_dropout=lora_dropout,
        approximate=approximate,
        moe=_moe_of(cfg),
        stages=stages,
        **counted.quant.facts(model),
        **top,
    )


def _moe_of(cfg: Any) -> dict[str, Any] | None:
    from tunelab.lib.models.moe import moe_shape

    shape = moe_shape(cfg.to_dict()) if hasattr(cfg, "to_dict") else None
    return shape.to_dict() if shape else None


def _conv_facts(model: Any, architecture: str, *, lora_rank: int, lora_dropout: float):
    """ModelFacts of a ResNet or ConvNeXt: the config the walk needs and, per module path, what
    trains ("weight" or "lora"); marked approximate where the walk does not follow the model."""
    cfg = model.config
    conv = {k: getattr(cfg, k) for k in _CONV_FIELDS if getattr(cfg, k, None) is not None}
    conv["image_size"] = int(getattr(cfg, "image_size", None) or DEFAULT_IMAGE_SIZE)
    trains: dict[str, str] = {}
    weight_bytes: dict[str, int] = {}
    trainable = trainable_bytes = largest = total = 0
    prefix = f"{cfg.model_type}."
    for name, p in model.named_parameters():
        dtype = str(p.dtype).removeprefix("torch.")
        weight_bytes[dtype] = weight_bytes.get(dtype, 0) + p.numel() * p.element_size()
        total += p.numel()
        if not p.requires_grad:
            continue
        trainable += p.numel()
        trainable_bytes += p.numel() * p.element_size()
        largest = max(largest, p.numel() * p.element_size())
        plain = _plain(name).removeprefix(prefix)
        path = plain.rsplit(".", 1)[0] if plain.endswith((".weight", ".bias")) else plain
        if path.startswith("classifier"):
            path = "classifier"
        kind = "lora" if ".lora_" in name else "weight"
        trains[path] = "weight" if trains.get(path) == "weight" else kind
    conv["trains"] = trains
    # LoRA on a convolution, drop path and other activations are not walked
    lora_conv = any(k == "lora" and "pwconv" not in p for p, k in trains.items())
    approximate = (
        lora_conv
        or float(conv.get("drop_path_rate") or 0.0) > 0
        or conv.get("hidden_act", "relu") not in ("relu", "gelu")
    )
    hidden = int(cfg.hidden_sizes[-1])
    return ModelFacts(
        family=cfg.model_type,
        architecture=architecture,
        hidden=hidden,
        intermediate=4 * hidden,
        layers=sum(int(d) for d in cfg.depths),
        heads=1,
        kv_heads=1,
        head_dim=hidden,
        vocab=0,
        num_labels=int(getattr(cfg, "num_labels", 0) or 0),
        param_dtype=max(weight_bytes, key=lambda d: weight_bytes[d]) if weight_bytes else "float32",
        weight_bytes=weight_bytes,
        num_params=total,
        trainable_params=trainable,
        trainable_bytes=trainable_bytes,
        largest_trainable_bytes=largest,
        lora_rank=lora_rank,
        lora_dropout=lora_dropout,
        head=trains.get("classifier"),
        approximate=approximate,
        conv=conv,
    )


class _QuantCount:
    """bitsandbytes' 4-bit parameters of a model: their weights, bytes and constants."""

    def __init__(self) -> None:
        self.params = self.tensors = self.constants = self.largest = self.packed_bytes = 0
        self.dtype = "float32"

    def add(self, p: Any) -> int:
        """The number of weights `p` stands for (a packed 4-bit tensor holds two per byte)."""
        state = getattr(p, "quant_state", None)
        if state is None:
            return p.numel()
        numel = int(state.shape.numel())
        self.params += numel
        self.tensors += 1
        self.largest = max(self.largest, numel)
        self.packed_bytes += p.numel() * p.element_size()
        self.dtype = str(state.dtype).removeprefix("torch.")
        parts = [state.absmax, state.code]
        if state.nested:
            parts += [state.state2.absmax, state.state2.code, state.offset]
        self.constants += sum(t.numel() * t.element_size() for t in parts)
        return numel

    def facts(self, model: Any) -> dict[str, Any]:
        if not self.params:
            return {}
        qc = getattr(model.config, "quantization_config", None)
        compute = getattr(qc, "bnb_4bit_compute_dtype", None) if qc is not None else None
        if isinstance(qc, dict):
            compute = qc.get("bnb_4bit_compute_dtype")
        return {
            "quant_params": self.params,
            "quant_tensors": self.tensors,
            "quant_constant_bytes": self.constants,
            "quant_largest": self.largest,
            "quant_dtype": self.dtype,
            "quant_compute_dtype": str(compute or "bfloat16").removeprefix("torch."),
        }


def _param_dtype(weight_bytes: dict[str, int], quant: _QuantCount) -> str:
    """The dtype most of the parameters are kept in, the packed 4-bit bytes left out."""
    plain = dict(weight_bytes)
    if quant.packed_bytes:
        plain["uint8"] = plain.get("uint8", 0) - quant.packed_bytes
    plain = {k: v for k, v in plain.items() if v > 0}
    return max(plain, key=lambda d: plain[d]) if plain else "float32"


def count_saved_bytes(
    model: Any, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None
) -> int:
    """Bytes of the distinct tensors autograd saves while `forward()` runs (parameters excluded).

    Tensors are told apart by their storage, so views of one tensor count once. Without
    `backward` the forward is for counting only: its graph keeps nothing (backward through it
    raises), so every activation is freed when it returns. With it, the graph keeps a detached
    alias of each saved tensor and `backward(out)` runs on the forward's output once the hooks
    are left: the same bytes, and a forward and backward in one. A pack hook that returned the
    tensor itself would keep the tensors an op saves of its own output (softmax, SiLU, ...) in
    a reference cycle through the C++ graph that Python's garbage collector cannot see: on CUDA
    the whole forward's activations would still be allocated when the measured step begins.
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    # The storages stay alive until the forward ends, as the graph would keep them: no freed
    # block's address is reused by a later tensor and taken for one already counted.
    held: list[Any] = []

    def pack(t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen[key] = storage.nbytes()
            held.append(storage)
        return key if backward is None else t.detach()

    def unpack(saved: Any) -> torch.Tensor:
        if backward is None:
            raise RuntimeError("count_saved_bytes counts a forward's saved tensors; no backward")
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward()
    del held[:]
    if backward is not None:
        backward(out)
    del out
    return sum(seen.values())
