"""Greedy generation for evaluation: batches that do not wait for more than they must.

- Prompts are sorted by length into batches (least padding), results returned in the order of
  the prompts given.
- A batch ends as soon as every row ended: at EOS, or, for a task whose answer is one JSON
  object (extraction), at the token that completes that object (`answer_complete`): what a
  model writes after it is never read. The output is the text up to and including that token.
- Each batch runs on the model `EvalModels` chooses (the merged copy once the first batch agreed).
- The tokens every prompt starts with (a chat template's system prompt and the instruction)
  are computed once per model and their keys and values copied into each batch
  (`decoding.prefix_states`); the first batch's check starts from them too.
- With `evaluation.draft_tokens`, decoding (`tunelab.lib.inference.decoding`) writes the KV cache in place and
  checks drafts looked up in the prompt and the earlier answers in one forward pass, keeping
  what greedy decoding agrees with.

Outputs equal the greedy decoding of each prompt alone, cut at the same end (tests check it).

`generate_outputs(model, tokenizer, prompts, *, max_new_tokens, batch_size, tick=, stats=,
stop_at_answer=False)` (`model` may be an `eval_copy.EvalModels`), `pad_id_for(tokenizer)`,
`greedy_agreement`; `pad_sequences(seqs, pad_id, left=)` is `tunelab.lib.inference.decoding`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunelab.lib.inference.decoding import (
    SEPARATOR,
    Generated,
    Prefix,
    decode,
    forward_rows,
    in_place_cache,
    pad_sequences,
    prefix_states,
    shared_prefix_length,
)
from tunelab.lib.inference.eval_copy import as_models
from tunelab.lib.probes import StepClock
from tunelab.lib.tasks.json_text import answer_complete

# the earlier answers a batch's drafts may copy from (keys and punctuation repeat)
LOOKUP_ANSWERS = 2
# the fewest shared leading tokens worth the one-row pass that computes them once
SHARED_PREFIX_MIN = 8


def batches_of(order: Sequence[int], size: int) -> list[list[int]]:
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def pad_id_for(tokenizer: Any) -> int:
    """The id to pad with: the pad token, else EOS, else 0; always an int."""
    # an image processor has neither: 0, which image batches never use
    for tid in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        0,
    ):
        if tid is not None:
            return int(tid)
    return 0  # pragma: no cover


class AnswerEnd:
    """A stopping criterion for `generate`: a row ends at the token that completes its answer
    (`answer_complete` on the new text). `ends[row]` is then the number of new tokens kept."""

    def __init__(self, tokenizer: Any, prompt_width: int, rows: int):
        self.tokenizer = tokenizer
        self.width = prompt_width
        self.ends: list[int | None] = [None] * rows
        self._closes: dict[int, bool] = {}  # token id -> its text holds a closing brace

    def _may_close(self, token: int) -> bool:
        if token not in self._closes:
            self._closes[token] = "}" in self.tokenizer.decode([token])
        return self._closes[token]

    def complete(self, tokens: list[int]) -> bool:
        """Whether the answer is complete after `tokens` (the row's new tokens)."""
        if not tokens or not self._may_close(int(tokens[-1])):
            return False
        return answer_complete(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        new = input_ids.shape[1] - self.width
        for row in range(input_ids.shape[0]):
            if self.ends[row] is None and self.complete(input_ids[row, self.width :].tolist()):
                self.ends[row] = new
        done = [end is not None for end in self.ends]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[Sequence[int]],
    config: Any,
    stop_at_answer: bool,
    timed: bool,
    lookup: Sequence[int] = (),
    draft_tokens: int = 0,
    prefix: Prefix | None = None,
) -> Generated:
    """The new tokens of each prompt (cut at EOS or the answer's end) and the batch's figures:
    with `draft_tokens` or a shared `prefix`, by `decoding.decode` (in-place cache,
    prompt-lookup drafts; `lookup`: earlier answers); else, or for a model whose cache it cannot
    take, by `generate`."""
    pad_id = pad_id_for(tokenizer)
    cache = in_place_cache(model) if draft_tokens or prefix is not None else None
    if cache is None:
        return _generate_with_hf(model, tokenizer, prompts, config, stop_at_answer, timed)
    end = AnswerEnd(tokenizer, 0, len(prompts)) if stop_at_answer else None
    got = decode(
        model,
        cache,
        prompts,
        max_new_tokens=config.max_new_tokens,
        pad_id=pad_id,
        eos_id=tokenizer.eos_token_id,
        answered=end.complete if end is not None else (lambda tokens: False),
        lookup=lookup,
        draft_tokens=draft_tokens,
        prefix=prefix,
    )
    got.stats = {"prompt_tokens": max(len(p) for p in prompts), **got.stats} if timed else {}
    return got


def _generate_with_hf(
    model: Any,
    tokenizer: Any,
    prompts: list[Sequence[int]],
    config: Any,
    stop_at_answer: bool,
    timed: bool,
) -> Generated:
    """`_generate_batch` through `transformers`' `generate` (left padding, KV cache)."""
    import torch

    pad_id = pad_id_for(tokenizer)
    eos = tokenizer.eos_token_id
    ids, mask = pad_sequences(prompts, pad_id, left=True)
    device = next(model.parameters()).device
    clock = StepClock()
    end = AnswerEnd(tokenizer, ids.shape[1], len(prompts)) if stop_at_answer else None
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            streamer=clock if timed else None,
            stopping_criteria=[end] if end is not None else None,
        )
    new = out[:, ids.shape[1] :].cpu().tolist()  # [batch, new tokens]
    tokens, ends = [], []
    for row, seq in enumerate(new):
        how = "budget"
        if end is not None and end.ends[row] is not None:
            seq, how = seq[: end.ends[row]], "answer"
        if eos is not None and eos in seq:
            seq, how = seq[: seq.index(eos)], "eos"
        tokens.append(seq)
        ends.append(how)
    stats = {"prompt_tokens": int(ids.shape[1]), **clock.split()} if timed else {}
    return Generated(tokens, ends, stats)


def greedy_agreement(
    model: Any,
    tokenizer: Any,
    prompts: list[Sequence[int]],
    got: Generated,
    prefix: Prefix | None = None,
) -> tuple[bool, float | None, str]:
    """Whether `model` decodes `got` greedily: fed each prompt and its output in one forward
    pass (after `prefix`, the keys and values of the tokens every prompt starts with, in
    `model`), its argmax must be every output token and, where the output ended at EOS, EOS
    after it. Returns (agrees, None, detail with the smallest top-2 logit margin met)."""
    eos = tokenizer.eos_token_id
    seqs = [list(p) + t for p, t in zip(prompts, got.tokens, strict=True)]
    wanted = [
        t + ([eos] if how == "eos" else []) for t, how in zip(got.tokens, got.ends, strict=True)
    ]
    keep = max(len(w) for w in wanted) + 1
    logits, _ = forward_rows(
        model,
        seqs,
        pad_id=pad_id_for(tokenizer),
        logits_to_keep=keep,
        # a prefix exists only for a model whose cache decode takes (prefix_states)
        cache=in_place_cache(model) if prefix is not None else None,
        prefix=prefix,
    )
    logits = logits.float()  # [batch, keep, vocab]: the last `keep` positions
    top = logits.topk(2, dim=-1)
    differ, margin = 0, float("inf")
    for row, want in enumerate(wanted):
        if not want:
            continue
        # the position before output token k predicts it; the row ends at the right edge
        first = keep - 1 - len(got.tokens[row])
        picks = top.indices[row, first : first + len(want), 0].tolist()
        gaps = top.values[row, first : first + len(want)]
        margin = min(margin, float((gaps[:, 0] - gaps[:, 1]).min()))
        differ += picks != want
    n = len(wanted)
    shown = f", smallest top-2 logit margin {margin:.3g}" if margin != float("inf") else ""
    if differ:
        return False, None, f"{differ} of {n} outputs not greedy for the model as loaded{shown}"
    return True, None, f"{n} outputs greedy for the model as loaded (teacher-forced){shown}"


class SharedPrefixes:
    """The keys and values of the tokens all `prompts` start with, per model they run on
    (computed on first use; None when fewer than `SHARED_PREFIX_MIN` tokens are shared or the
    model's cache is not one `decoding.decode` takes)."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        shared = shared_prefix_length(prompts)
        self.tokens = list(prompts[0][:shared]) if shared >= SHARED_PREFIX_MIN else []
        self._states: list[tuple[Any, Prefix | None]] = []  # (model, its prefix): kept alive

    def __call__(self, model: Any) -> Prefix | None:
        if not self.tokens:
            return None
        for seen, states in self._states:
            if seen is model:
                return states
        states = prefix_states(model, self.tokens)
        self._states.append((model, states))
        return states


def generate_outputs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
    stats: list[dict[str, Any]] | None = None,
    stop_at_answer: bool = False,
    draft_tokens: int = 0,
) -> list[str]:
    """Greedy continuations of each prompt (left padding, KV cache, stop at EOS, or at the end of
    the answer with `stop_at_answer`); only the new tokens are decoded, special tokens dropped.

    `model`: a model, or an `EvalModels` choosing merged or not. `stats`, when given, receives
    one entry per batch: `rows` (indices into `prompts`), `prompt_tokens` (the padded width),
    `steps` (tokens generated: the batch runs until its last row ended), `prefill_s` (up to the
    first new token), `decode_s` (the rest), and where `decoding.decode` ran, `forwards` (the
    decoding forward passes), `proposed` and `kept` (draft tokens).

    `draft_tokens`: the most tokens a row proposes per step (0: `generate`, one per step)."""
    from transformers import GenerationConfig

    models = as_models(model)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id_for(tokenizer),
    )
    outputs: list[str] = [""] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    recent: list[list[int]] = []  # the answers so far, where drafts are looked up too
    prefixes = SharedPrefixes(prompts)
    for batch in batches_of(order, batch_size):
        rows = [prompts[i] for i in batch]
        lookup = [t for answer in recent[-LOOKUP_ANSWERS:] for t in (*answer, SEPARATOR)]

        def compute(m: Any, rows: list[Sequence[int]] = rows, lookup: list[int] = lookup):
            timed = stats is not None
            return _generate_batch(
                m, tokenizer, rows, config, stop_at_answer, timed, lookup, draft_tokens, prefixes(m)
            )

        def agrees(m: Any, got: Generated, rows: list[Sequence[int]] = rows):
            return greedy_agreement(m, tokenizer, rows, got, prefixes(m))

        got = models.run(compute, agrees=agrees)
        if stats is not None:
            stats.append({"rows": list(batch), **got.stats})
        for row, i in enumerate(batch):
            outputs[i] = tokenizer.decode(got.tokens[row], skip_special_tokens=True)
        recent.extend(got.tokens)
        tick(len(batch))
    return outputs
