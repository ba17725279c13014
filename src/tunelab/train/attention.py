"""Attention for packed rows: each example attends only to itself, computed example by example.

transformers keeps packed examples apart by building a block-diagonal mask over the whole row
and handing it to SDPA. That is exact but pays for the full `[tokens, tokens]` score matrix
(for 4 examples of unequal length, several times the work of the examples' own causal
triangles) and the masked kernel cannot skip the blocks above the diagonal. Here the same SDPA
runs once per example with `is_causal=True`: the work of the examples alone, the same result.

`PACKED_SDPA` is registered with transformers as an attention implementation. It does exactly
what "sdpa" does unless the call carries `tunelab_segments` (the example boundaries of a packed
row, passed by `tunelab.train.losses`), no cache, no sliding window, soft-capping or attention
sinks: generation, padded batches and evaluation are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_SDPA = "tunelab_packed_sdpa"
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def packed_sdpa_forward(
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

    bounds = kwargs.pop("tunelab_segments", None)
    if not _segmentable(module, query, key, bounds, is_causal, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    # split, not slices: the backward of a split is one concatenation, that of each slice a
    # zero-filled tensor of the whole row
    outputs = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )
        for q, k, v in zip(
            query.split(lengths, dim=2),
            key.split(lengths, dim=2),
            value.split(lengths, dim=2),
            strict=True,
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _segmentable(module, query, key, bounds, is_causal, kwargs) -> bool:
    if bounds is None or query.shape[0] != 1 or is_causal is False:
        return False
    if not getattr(module, "is_causal", True):
        return False
    if query.shape[2] != key.shape[2] or key.shape[2] != bounds[-1]:
        return False  # a cache or a row that is not the one described
    return all(kwargs.get(name) is None for name in _UNSUPPORTED)


def segment_bounds(position_ids: torch.Tensor) -> tuple[int, ...] | None:
    """(0, end of example 1, end of example 2, ..., tokens) of a packed row [1, tokens]."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        return None
    return (*starts, position_ids.shape[1])


def register() -> None:
    """Make `PACKED_SDPA` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_sdpa(model: torch.nn.Module) -> bool:
    """Switch a transformers model from "sdpa" to `PACKED_SDPA`; False when it is on another
    implementation (eager, flash: left as they are) or cannot switch."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    try:
        model.set_attn_implementation(PACKED_SDPA)
    except (AttributeError, ValueError, TypeError, ImportError):
        return False
    return model.config._attn_implementation == PACKED_SDPA


def restore_sdpa(model: torch.nn.Module) -> None:
    if getattr(model.config, "_attn_implementation", None) == PACKED_SDPA:
        model.set_attn_implementation("sdpa")
