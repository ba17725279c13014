"""The checks of the loss mask, the stop conditions of `tunelab inspect` and of training.

Labels follow the transformers convention: aligned with input_ids, `IGNORE_INDEX` (-100) where
no loss.

- `example_problems(pre, ex) -> [Problem]`: one encoded example against the stop conditions
  (no label, too long, target truncated, no loss positions, labels shifted, EOS without loss or
  missing, a loss span that is not the target);
- `check_collated(encoded, labels_rows, pad_id, eos_id) -> [Problem]` finds a collator that
  masks labels by value (`eos_masked_by_pad`);
- `check_template_match(train_sha, eval_sha)` refuses an evaluation whose prompt recipe differs
  from training's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunelab.core.errors import PreprocessError
from tunelab.lib.preprocess.problems import Problem, _problem

IGNORE_INDEX = -100


def check_template_match(train_sha: str | None, eval_sha: str | None) -> None:
    """Refuse an evaluation whose prompt recipe differs from the one the model was trained with."""
    if train_sha and eval_sha and train_sha != eval_sha:
        raise PreprocessError(
            f"prompt template mismatch: training used template sha256 {train_sha[:12]}, "
            f"evaluation renders with {eval_sha[:12]}",
            hint="evaluate with the same preprocess settings, instruction and tokenizer as "
            "training (compare the run's preprocess.json with study.yaml, then "
            "`tunelab inspect`); a changed template is a new variant: train it",
        )


def _as_list(row: Any) -> list[int]:
    return [int(x) for x in (row.tolist() if hasattr(row, "tolist") else row)]


def _count_diff(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def check_collated(
    encoded: Sequence[dict[str, Any]],
    labels_rows: Sequence[Any],
    pad_id: int | None,
    eos_id: int | None,
) -> list[Problem]:
    """Problems where a collator changed the loss positions of encoded examples.

    `labels_rows[i]` is the labels row the collator produced for `encoded[i]` (padded on either
    side, or the example's slice of a packed row). A collator that masks by value (`labels[input
    == pad_id] = -100`) removes the EOS loss when pad == EOS; this names it.
    """
    problems = []
    for ex, row in zip(encoded, labels_rows, strict=True):
        want = list(ex["labels"])
        got = _as_list(row)
        n = len(want)
        if n:  # position 0 never carries loss (nothing before it): a collator may drop it
            want[0] = IGNORE_INDEX
        if len(got) < n:
            problems.append(
                _problem(
                    ex["id"], "loss_span_mismatch", f"collated row has {len(got)} < {n} tokens"
                )
            )
            continue
        # Right padding first, then left padding: keep the alignment with fewer differences.
        right, left = got[:n], got[len(got) - n :]
        for g in (right, left):
            if g:
                g[0] = IGNORE_INDEX
        best = min((right, left), key=lambda g: _count_diff(g, want))
        if best == want:
            continue
        lost = [
            i
            for i, (a, b) in enumerate(zip(best, want, strict=True))
            if b != IGNORE_INDEX and a != b
        ]
        lost_eos = [i for i in lost if want[i] == eos_id]
        if lost_eos and pad_id is not None and pad_id == eos_id:
            problems.append(
                _problem(
                    ex["id"],
                    "eos_masked_by_pad",
                    f"EOS (id {eos_id}) lost its loss at position {lost_eos[0]} after collation",
                )
            )
        else:
            problems.append(
                _problem(
                    ex["id"],
                    "loss_span_mismatch",
                    f"collation changed {_count_diff(best, want)} label(s)",
                )
            )
    return problems


def example_problems(pre: Any, ex: dict[str, Any]) -> list[Problem]:
    """What is wrong with one example `pre` (a `Preprocessor`) encoded, in the order a fix
    would take them; empty when it is sound."""
    if pre.architecture == "encoder":
        return _encoder_problems(pre, ex)
    ids, labels = list(ex["input_ids"]), list(ex["labels"])
    eid = ex.get("id")
    if len(ids) != len(labels):
        return [
            _problem(eid, "loss_span_mismatch", f"{len(ids)} input ids but {len(labels)} labels")
        ]
    out: list[Problem] = []
    if len(ids) > pre.cfg.max_seq_len:
        out.append(_problem(eid, "too_long", f"{len(ids)} > {pre.cfg.max_seq_len} tokens"))
    if ex.get("target_truncated") and not pre.cfg.allow_target_truncation:
        # the cut explains the missing EOS and the shorter loss span
        return out + [_target_cut(pre, ex, len(ids))]
    positions = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    if not positions:
        return out + [_problem(eid, "no_loss_positions", "no position carries loss")]
    if ex.get("target_truncated"):
        return out
    found = _loss_span_problem(pre, ex, ids, labels, positions)
    return out + ([found] if found else [])


def _encoder_problems(pre: Any, ex: dict[str, Any]) -> list[Problem]:
    eid = ex.get("id")
    n = len(getattr(pre.task, "labels", None) or [])
    label = ex.get("label")
    if not isinstance(label, int) or not 0 <= label < n:
        return [_problem(eid, "no_label", f"label index {label!r} not in [0, {n})")]
    if len(ex["input_ids"]) > pre.cfg.max_seq_len:
        return [_problem(eid, "too_long", f"{len(ex['input_ids'])} tokens")]
    return []


def _target_cut(pre: Any, ex: dict[str, Any], num_ids: int) -> Problem:
    kept = num_ids - ex.get("prompt_len", 0)
    return _problem(
        ex.get("id"),
        "target_truncated",
        f"truncation cut the target to {max(kept, 0)} of {ex.get('target_len')} "
        f"tokens (max_seq_len {pre.cfg.max_seq_len})",
        needed=ex.get("min_seq_len_needed", "?"),
    )


def _loss_span_problem(
    pre: Any, ex: dict[str, Any], ids: list[int], labels: list[int], positions: list[int]
) -> Problem | None:
    """The first of: labels shifted, EOS without loss or missing, a loss span that is not the
    target (by position, then by its decoded text)."""
    eid = ex.get("id")
    if any(labels[i] != ids[i] for i in positions):
        return _problem(
            eid,
            "loss_span_mismatch",
            "labels differ from input_ids at loss positions (labels must not be shifted; "
            "the model shifts them)",
        )
    last = positions[-1]
    if ids[-1] == pre.eos_id and labels[-1] == IGNORE_INDEX:
        if pre.pad_id is not None and pre.pad_id == pre.eos_id:
            return _problem(eid, "eos_masked_by_pad", "the final EOS (== pad token) has no loss")
        return _problem(eid, "eos_missing", "the final EOS has no loss")
    if ids[last] != pre.eos_id or last != len(ids) - 1:
        shown = pre.tokenizer.decode([ids[last]], skip_special_tokens=False)
        return _problem(
            eid, "eos_missing", f"the last loss token is {shown!r}, not EOS {pre.eos_token!r}"
        )
    prompt_len = ex.get("prompt_len")
    if pre.cfg.train_on_prompt:
        start = prompt_len or 0
    else:
        start = positions[0]
        if positions != list(range(start, len(ids))) or (
            prompt_len is not None and start != prompt_len
        ):
            return _problem(
                eid,
                "loss_span_mismatch",
                f"loss covers positions {positions[0]}..{last}, the target is "
                f"{prompt_len}..{len(ids) - 1}",
            )
    decoded = pre.tokenizer.decode(ids[start:last], skip_special_tokens=False)
    expected = ex.get("target_text")
    if expected is not None and decoded != expected:
        return _problem(
            eid,
            "loss_span_mismatch",
            f"loss span decodes to {decoded[:60]!r}, expected {expected[:60]!r}",
        )
    return None
