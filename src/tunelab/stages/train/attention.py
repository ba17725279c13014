"""Attention for packed rows: each example attends only to itself, in one kernel call per layer.

transformers keeps packed examples apart by building a block-diagonal mask over the whole row
and handing it to SDPA. That is exact but pays for the full `[tokens, tokens]` score matrix,
and the masked kernel cannot skip the blocks above the diagonal. The routes here compute the
examples' own causal triangles only, best first:

- `flash_varlen`: FlashAttention-2's `flash_attn_varlen_func` (the `flash_attn` package, CUDA,
  fp16/bf16), one call over the row with the examples' cumulative lengths;
- `torch_varlen`: PyTorch's own `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16);
- `flex`: FlexAttention with a document mask, compiled (`torch.compile(flex_attention)`): on
  CUDA a fused kernel that skips the masked blocks (torch 2.13 has no FlexAttention backward
  on CPU);
- `per_example`: SDPA once per example (`is_causal=True`) in a Python loop: on CPU the fastest
  (the loop costs little beside the matmuls), on a GPU a launch-bound loop.

Each route is registered with transformers as an attention implementation (`IMPLEMENTATIONS`)
and does exactly what "sdpa" does unless the call carries `tunelab_segments` (a `Segments`:
the example boundaries of a packed row, passed by `tunelab.stages.train.losses`), with no cache, no
sliding window, soft-capping or attention sinks: generation, padded batches and evaluation are
untouched. A route that cannot run a call (dropout on a route without it, an unexpected dtype)
runs that call example by example, which is exact too. Which route a model gets is decided by
`tunelab.stages.train.losses.check_model` (the packed rows must equal the padded ones) from the
candidates `candidates()` names.

`ROUTES` (flash_varlen, torch_varlen, flex, per_example), `IMPLEMENTATIONS[route]` (the
transformers name), `PACKED_SDPA` (the per-example one); `unavailable(route, device, dtype)`,
`candidates(requested, device, dtype)`, `use_route(model, route)`, `restore_sdpa(model)`;
`segment_bounds(position_ids) -> Segments`, passed to the model as `tunelab_segments` (plain
SDPA without segments; not saved with the model).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ROUTES = ("flash_varlen", "torch_varlen", "flex", "per_example")
IMPLEMENTATIONS = {route: f"tunelab_packed_{route}" for route in ROUTES}
PACKED_SDPA = IMPLEMENTATIONS["per_example"]
_HALF = (torch.float16, torch.bfloat16)
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


@dataclass(eq=False)
class Segments:
    """The examples of one packed row: `bounds` = (0, end of example 1, ..., tokens).

    Device tensors the kernels need (cumulative lengths, a flex block mask) are made once per
    forward pass and shared by every layer (and by the recomputation of checkpointed layers).
    """

    bounds: tuple[int, ...]
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def tokens(self) -> int:
        return self.bounds[-1]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        key = ("cu", device)
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        return self._cache[key]

    def block_mask(self, device: torch.device) -> Any:
        key = ("flex", device)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            doc = torch.repeat_interleave(
                torch.arange(len(self.lengths), device=device),
                torch.tensor(self.lengths, device=device),
            )  # [tokens]: the example each position belongs to

            def same_example_causal(b, h, q, k):  # noqa: ANN001
                return (doc[q] == doc[k]) & (q >= k)

            n = self.tokens
            self._cache[key] = create_block_mask(
                same_example_causal, None, None, n, n, device=device
            )
        return self._cache[key]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Segments):
            return self.bounds == other.bounds
        return isinstance(other, tuple) and self.bounds == other

    __hash__ = None  # type: ignore[assignment]


def segment_bounds(position_ids: torch.Tensor) -> Segments | None:
    """The examples of a packed row [1, tokens] whose positions restart at 0 per example."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        return None
    return Segments((*starts, position_ids.shape[1]))


# ------------------------------------------------------------------ the kernels


def _per_example(q, k, v, segments: Segments, dropout: float, scaling, gqa: bool):  # noqa: ANN001
    # split, not slices: the backward of a split is one concatenation, that of each slice a
    # zero-filled tensor of the whole row
    lengths = segments.lengths
    outputs = [
        F.scaled_dot_product_attention(
            qi, ki, vi, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )
        for qi, ki, vi in zip(
            q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)  # [1, tokens, heads, dim]


def _flash_varlen(q, k, v, segments: Segments, dropout: float, scaling, gqa: bool):  # noqa: ANN001
    from flash_attn import flash_attn_varlen_func

    cu, n = segments.cu_seqlens(q.device), segments.max_len
    out = flash_attn_varlen_func(
        q[0].transpose(0, 1),  # [tokens, heads, dim]
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu,
        cu,
        n,
        n,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
    )
    return out.unsqueeze(0)


def _torch_varlen(q, k, v, segments: Segments, dropout: float, scaling, gqa: bool):  # noqa: ANN001
    from torch.nn.attention.varlen import varlen_attn

    cu, n = segments.cu_seqlens(q.device), segments.max_len
    out = varlen_attn(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu,
        cu,
        n,
        n,
        scale=scaling,
        window_size=(-1, 0),  # causal
        enable_gqa=gqa,
    )
    return out.unsqueeze(0)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q, k, v, segments: Segments, dropout: float, scaling, gqa: bool):  # noqa: ANN001
    mask = segments.block_mask(q.device)
    out = _compiled_flex()(q, k, v, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


_KERNELS = {
    "flash_varlen": _flash_varlen,
    "torch_varlen": _torch_varlen,
    "flex": _flex,
    "per_example": _per_example,
}
_NO_DROPOUT = ("torch_varlen", "flex")
_HALF_ONLY = ("flash_varlen", "torch_varlen")


@functools.cache
def _forward_for(route: str):  # noqa: ANN202
    kernel = _KERNELS[route]

    @torch.compiler.disable  # a compiled block calls it as is: no guard on the segments
    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers attention interface; query [1, heads, tokens, dim], key/value
        [1, kv_heads, tokens, dim]; returns ([1, tokens, heads, dim], None)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        segments = kwargs.pop("tunelab_segments", None)
        if not _segmentable(module, query, key, segments, is_causal, kwargs):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )
        dtype = compute_dtype(query)
        q, k, v = (t.to(dtype) for t in (query, key, value))
        gqa = q.shape[1] != k.shape[1]
        run = kernel
        if (dropout and route in _NO_DROPOUT) or (route in _HALF_ONLY and dtype not in _HALF):
            run = _per_example  # exact too; this call only
        return run(q, k, v, segments, dropout, scaling, gqa).contiguous(), None

    forward.__name__ = f"packed_{route}_forward"
    return forward


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's on `t`'s device when on, else `t`'s own."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


def _segmentable(module, query, key, segments, is_causal, kwargs) -> bool:  # noqa: ANN001
    if not isinstance(segments, Segments) or query.shape[0] != 1 or is_causal is False:
        return False
    if not getattr(module, "is_causal", True):
        return False
    if query.shape[2] != key.shape[2] or key.shape[2] != segments.tokens:
        return False  # a cache or a row that is not the one described
    return all(kwargs.get(name) is None for name in _UNSUPPORTED)


# ------------------------------------------------------------------ choosing


def unavailable(route: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `route` cannot serve a model computing in `dtype` on `device`; None when it can."""
    cuda = device.type == "cuda"
    if route == "flash_varlen":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash_attn is not installed"
        if not cuda:
            return "FlashAttention needs CUDA"
        if dtype not in _HALF:
            return f"FlashAttention needs fp16 or bf16 (this run computes in {_name(dtype)})"
    if route == "torch_varlen":
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        if not cuda:
            return "torch.nn.attention.varlen runs on CUDA only"
        if dtype not in _HALF:
            return f"varlen_attn needs fp16 or bf16 (this run computes in {_name(dtype)})"
    if route == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if not cuda:
            return "FlexAttention has no backward on CPU"
    return None


def candidates(
    requested: str, device: torch.device, dtype: torch.dtype
) -> tuple[list[str], list[dict[str, str]]]:
    """(routes to try in order, [{route, reason}] of those left out). `requested` is "auto" or
    a route name (then only that route; ConfigError when it cannot run here)."""
    from tunelab.core.errors import ConfigError

    auto = requested == "auto"
    names = ROUTES if auto else (requested,)
    tried, skipped = [], []
    for route in names:
        reason = unavailable(route, device, dtype)
        if reason is None:
            tried.append(route)
        elif not auto:
            raise ConfigError(
                f"training.attention: {route} cannot run here: {reason}",
                hint="use training.attention: auto (the best route this machine can run)",
            )
        else:
            skipped.append({"route": route, "reason": reason})
    return tried, skipped


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype)
    )


def register() -> None:
    """Make every route known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for route, name in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _forward_for(route))
        AttentionMaskInterface.register(name, sdpa_mask)


def route_of(model: torch.nn.Module) -> str | None:
    """The packed route a model is switched to, or None."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return next((r for r, n in IMPLEMENTATIONS.items() if n == name), None)


def use_route(model: torch.nn.Module, route: str) -> bool:
    """Switch a transformers model from "sdpa" (or another route) to `route`; False when it is
    on another implementation (eager, flash: left as they are) or cannot switch."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa" and route_of(model) is None:
        return False
    register()
    try:
        model.set_attn_implementation(IMPLEMENTATIONS[route])
    except (AttributeError, ValueError, TypeError, ImportError):
        return False
    return model.config._attn_implementation == IMPLEMENTATIONS[route]


def use_packed_sdpa(model: torch.nn.Module) -> bool:
    """Switch a model on "sdpa" to per-example attention (see `use_route`)."""
    return use_route(model, "per_example")


def restore_sdpa(model: torch.nn.Module) -> None:
    if route_of(model) is not None:
        model.set_attn_implementation("sdpa")
