"""Greedy decoding of a batch: a KV cache written in place, and drafts looked up in the prompt.

- The cache keeps each layer's keys and values in a buffer with room to spare and writes each
  step into it (`transformers`' DynamicLayer concatenates: a copy of the whole cache per step).
- Prompt lookup: an extraction or format answer mostly copies its prompt (an address, a
  subject) or repeats what the evaluation's earlier answers wrote (the keys, the punctuation).
  At each step a row proposes the tokens that followed the latest earlier occurrence of its last
  tokens (`lookup_draft`); one forward pass over every row's proposals checks them, and a row
  keeps the proposed tokens that equal its own greedy choice at their position, then the model's
  choice after the last one kept. What is emitted is therefore what greedy decoding emits; only
  the number of forward passes changes. Rejected proposals stay in the cache, masked for every
  later position (a masked key gets zero attention weight).

- A shared prefix: an evaluation's prompts start with the same tokens (the system prompt and
  the instruction of a chat template). Their keys and values depend on those tokens alone, so
  they are computed once per model (`prefix_states`, one row) and copied into each batch's cache
  (`forward_rows`); each row's own tokens follow them, left padded, at the positions they have
  in the whole prompt. Only the row's own tokens are computed.

A model whose cache is not plain full attention (a sliding window counts cache positions, the
masked ones too) is decoded by `transformers`' `generate` instead (`in_place_cache` is None).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# the longest tail looked up; shorter tails are tried when it has no earlier occurrence
NGRAM = 3
# between the texts a lookup source joins: no token id, so no draft runs across it
SEPARATOR = -1


def lookup_draft(seq: Sequence[int], k: int, n_max: int = NGRAM) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the last n tokens
    of `seq`, for the longest n <= `n_max` that occurs earlier, up to a `SEPARATOR`; empty
    when none occurs."""
    end = len(seq)
    if k <= 0:
        return []
    for n in range(min(n_max, end - 1), 0, -1):
        tail = list(seq[end - n :])
        first = tail[0]
        for start in range(end - n - 1, -1, -1):
            if seq[start] == first and list(seq[start : start + n]) == tail:
                draft = list(seq[start + n : start + n + k])
                return draft[: draft.index(SEPARATOR)] if SEPARATOR in draft else draft
    return []


@functools.cache
def _in_place_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of a buffer that grows by doubling."""

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.length, self._k, self._v = 0, None, None
            need = self.length + key_states.shape[-2]
            if self._k is None or need > self._k.shape[-2]:
                self._k = _grown(self._k, key_states, self.length, 2 * need)
                self._v = _grown(self._v, value_states, self.length, 2 * need)
            self._k[..., self.length : need, :].copy_(key_states)
            self._v[..., self.length : need, :].copy_(value_states)
            self.length = need
            self.keys, self.values = self._k[..., :need, :], self._v[..., :need, :]
            return self.keys, self.values

    return InPlaceLayer


def _grown(buffer: Any, like: Any, used: int, capacity: int) -> Any:
    shape = (*like.shape[:-2], capacity, like.shape[-1])
    out = like.new_empty(shape)
    if buffer is not None and used:
        out[..., :used, :].copy_(buffer[..., :used, :])
    return out


def in_place_cache(model: Any) -> Any | None:
    """A cache of `InPlaceLayer`s for `model`, or None when its cache is not plain full
    attention (or its forward takes no cache and position ids)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if _cache_kwarg(model) is None:
        return None
    config = getattr(model, "config", None)
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: decode with generate
        return None
    layer = _in_place_layer()
    if cache.layers:
        if any(type(x) is not DynamicLayer for x in cache.layers):
            return None
        cache.layers = [layer() for _ in cache.layers]
    elif cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = layer
    else:
        return None
    return cache


def _cache_kwarg(model: Any) -> str | None:
    """The name `model`'s forward takes its cache under ("cache", or the older
    "past_key_values"), None when it takes no cache or no position ids."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(inner.forward).parameters
    if "position_ids" not in params or "attention_mask" not in params:
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, left: bool):
    """[batch, seq] input ids and attention mask, padded on the left or the right.

    Rows keep their token order; padding positions hold `pad_id` and mask 0, tokens mask 1.
    """
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        if not s:
            continue
        if left:
            ids[row, width - len(s) :] = torch.tensor(s)
            mask[row, width - len(s) :] = 1
        else:
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
    return ids, mask


@dataclass
class Generated:
    """One batch's new tokens per row (cut at the end, without EOS), how each ended ("eos",
    "answer", "budget"), and the batch's figures (`decode`: `steps`, the longest row's tokens
    with EOS counted, `forwards`, the draft tokens `proposed` and `kept`, `prefill_s`,
    `decode_s`)."""

    tokens: list[list[int]]
    ends: list[str]
    stats: dict[str, Any] = field(default_factory=dict)


def left_padded_positions(mask: Any) -> Any:
    """Position ids of left-padded rows: 0 at each row's first token (padding at 0 too)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class Prefix:
    """The tokens every prompt starts with, and their keys and values in one model (one row per
    layer): computed once, copied into each batch's cache."""

    tokens: list[int]
    layers: list[tuple[Any, Any]]


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt shares, leaving each at least one of its own (the
    last prompt position's logits give the first new token)."""
    if not prompts:
        return 0
    first, shortest = prompts[0], min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def prefix_states(model: Any, tokens: Sequence[int]) -> Prefix | None:
    """`tokens`' keys and values in `model` (None when its cache is not one `decode` takes)."""
    import torch

    cache = in_place_cache(model)
    if cache is None or not tokens:
        return None
    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], device=device)
    with torch.inference_mode():
        model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(len(tokens), device=device)[None],
            use_cache=True,
            logits_to_keep=1,
            **{_cache_kwarg(model): cache},
        )
    layers = [(x.keys.clone(), x.values.clone()) for x in cache.layers]
    return Prefix(list(tokens), layers)


def forward_rows(
    model: Any,
    seqs: Sequence[Sequence[int]],
    *,
    pad_id: int,
    logits_to_keep: int,
    cache: Any = None,
    prefix: Prefix | None = None,
) -> tuple[Any, Any]:
    """One forward pass over `seqs`, left padded: (the logits of the last `logits_to_keep`
    positions, the attention mask over what the cache then holds). With `prefix` (whose tokens
    every row starts with; `cache` required), its keys and values are copied into `cache` first
    and only the rows' own tokens are computed, at their positions in the whole sequence."""
    import torch

    device = next(model.parameters()).device
    skip = len(prefix.tokens) if prefix is not None else 0
    if prefix is not None and any(list(s[:skip]) != prefix.tokens for s in seqs):
        raise ValueError("a row does not start with the shared prefix")
    ids, mask = pad_sequences([s[skip:] for s in seqs], pad_id, left=True)
    positions = left_padded_positions(mask) + skip
    if prefix is not None:
        for index, (keys, values) in enumerate(prefix.layers):
            rows = (len(seqs), *keys.shape[1:])
            cache.update(keys.expand(rows), values.expand(rows), index)
        mask = torch.cat([torch.ones((len(seqs), skip), dtype=mask.dtype), mask], dim=1)
    mask = mask.to(device)
    extra = {_cache_kwarg(model): cache} if cache is not None else {}
    with torch.inference_mode():
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask,
            position_ids=positions.to(device),
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
            **extra,
        ).logits
    return logits, mask


@dataclass
class _Row:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    end: str | None = None
    valid: int = 0  # tokens of this row in the cache that later positions attend to

    def emit(self, token: int, eos: int | None, budget: int, answered: Callable) -> None:
        if token == eos:
            self.end = "eos"
            return
        self.tokens.append(token)
        if answered(self.tokens):
            self.end = "answer"
        elif len(self.tokens) >= budget:
            self.end = "budget"


def _chunks(
    rows: list[_Row], lookup: Sequence[int], draft_tokens: int, max_new_tokens: int
) -> list[list[int]]:
    """Each unfinished row's next input: its last token and a prompt-lookup draft ([] when
    the row has ended)."""
    chunks = []
    for r in rows:
        if r.end is not None:
            chunks.append([])
            continue
        room = max_new_tokens - len(r.tokens) - 1
        source = [*lookup, SEPARATOR, *r.prompt, *r.tokens] if lookup else r.prompt + r.tokens
        draft = lookup_draft(source, min(draft_tokens, room)) if draft_tokens else []
        chunks.append([r.tokens[-1], *draft])
    return chunks


def _step_inputs(rows: list[_Row], chunks: list[list[int]], width: int, pad_id: int) -> Any:
    """The step's input ids, attention mask and positions, each [rows, width] (right padded)."""
    import torch

    step_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    step_mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, c) in enumerate(zip(rows, chunks, strict=True)):
        if c:
            step_ids[i, : len(c)] = torch.tensor(c)
            step_mask[i, : len(c)] = 1
            positions[i, : len(c)] = torch.arange(r.valid, r.valid + len(c))
    return step_ids, step_mask, positions


def _accept(
    r: _Row,
    draft: list[int],
    pick: list[int],
    eos_id: int | None,
    max_new_tokens: int,
    answered: Callable[[list[int]], bool],
) -> int:
    """Emit the drafted tokens the model agreed with and its own next pick; returns how many
    drafted tokens were kept."""
    agree = 0
    while agree < len(draft) and pick[agree] == draft[agree]:
        agree += 1
    for token in [*draft[:agree], pick[agree]]:
        r.emit(token, eos_id, max_new_tokens, answered)
        if r.end is not None:
            break
    r.valid += 1 + agree
    return agree


def decode(
    model: Any,
    cache: Any,
    prompts: list[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    eos_id: int | None,
    answered: Callable[[list[int]], bool] = lambda tokens: False,
    lookup: Sequence[int] = (),
    draft_tokens: int = 4,
    prefix: Prefix | None = None,
) -> Generated:
    """Greedy continuations of `prompts` (left padded, one batch) on `cache` (from
    `in_place_cache`), with prompt-lookup drafts of at most `draft_tokens` (0: one token per
    step). `lookup`: further tokens drafts may be looked up in (earlier answers).
    `answered(tokens)`: whether a row's answer is complete after `tokens`. `prefix`: the
    keys and values of the tokens every prompt starts with (`prefix_states`)."""
    import torch

    device = next(model.parameters()).device
    kwarg = _cache_kwarg(model)
    rows = [_Row(list(p), valid=len(p)) for p in prompts]
    started = time.perf_counter()
    logits, mask = forward_rows(
        model, prompts, pad_id=pad_id, logits_to_keep=1, cache=cache, prefix=prefix
    )
    with torch.inference_mode():
        first = logits[:, -1].argmax(-1).tolist()
        prefill_s = time.perf_counter() - started
        for row, token in zip(rows, first, strict=True):
            row.emit(token, eos_id, max_new_tokens, answered)
        forwards, proposed, kept = 0, 0, 0
        while any(r.end is None for r in rows):
            chunks = _chunks(rows, lookup, draft_tokens, max_new_tokens)
            width = max(len(c) for c in chunks)
            step_ids, step_mask, positions = _step_inputs(rows, chunks, width, pad_id)
            mask = torch.cat([mask, step_mask.to(device)], dim=1)
            picks = (
                model(
                    input_ids=step_ids.to(device),
                    attention_mask=mask,
                    position_ids=positions.to(device),
                    use_cache=True,
                    logits_to_keep=width,
                    **{kwarg: cache},
                )
                .logits.argmax(-1)
                .tolist()
            )
            forwards += 1
            at = mask.shape[1] - width
            for i, (r, c) in enumerate(zip(rows, chunks, strict=True)):
                if not c:
                    continue
                agree = _accept(r, c[1:], picks[i], eos_id, max_new_tokens, answered)
                proposed, kept = proposed + len(c) - 1, kept + agree
                mask[i, at + 1 + agree : at + width] = 0  # the proposals not kept
    steps = max(len(r.tokens) + (r.end == "eos") for r in rows)
    stats = {
        "steps": steps,
        "forwards": forwards,
        "proposed": proposed,
        "kept": kept,
        "prefix_tokens": len(prefix.tokens) if prefix is not None else 0,
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(time.perf_counter() - started - prefill_s, 4) if forwards else 0.0,
    }
    return Generated([r.tokens for r in rows], [r.end or "budget" for r in rows], stats)
