"""Predictions of one model on a list of examples, by architecture and task (what `evaluate_model`
records, and what verify and export run again).

- encoder classification: the head's logits, argmax (`predict_encoder`; `predict_images` for an
  image model), probabilities kept per example;
- causal-LM classification: each label scored by the summed log-likelihood of its target tokens
  given the prompt, argmax (`score_candidates`);
- causal-LM format and extraction: greedy generation, the new tokens decoded, then judged by the
  task (`judge_output`).

`predict_rows(model, tokenizer, pre, task, rows, ...)` dispatches on them;
`rescore_predictions(task, predictions)` judges recorded rows again from their gold and raw
output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.errors import EvaluationError
from tunelab.core.progress import Progress
from tunelab.lib.inference.decoding import left_padded_positions
from tunelab.lib.inference.eval_copy import as_models, close_scores
from tunelab.lib.inference.generation import batches_of, generate_outputs, pad_id_for, pad_sequences
from tunelab.lib.probes import generation_timing

# ---------------------------------------------------------------- batching helpers


def model_device(model: Any):
    return next(model.parameters()).device


def _tensor_rows(compare: Any) -> Any:
    """A comparison of score lists applied to [batch, labels] tensors."""
    return lambda a, b: compare(a.tolist(), b.tolist())


class Ticker:
    """Counts the examples done and tells the caller's progress callback (if any)."""

    def __init__(self, progress: Progress | None, total: int, what: str):
        self.progress, self.total, self.what = progress, total, what
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.what, self.done, self.total)


# ---------------------------------------------------------------- inference


def predict_encoder(
    model: Any,
    encoded: Sequence[dict[str, Any]],
    labels: Sequence[str],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Any]]:
    """Label and per-label probabilities of each encoded example ([CLS] head logits)."""
    import torch

    out: list[dict[str, Any] | None] = [None] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]["input_ids"]), i))
    models = as_models(model)
    device = models.device
    for batch in batches_of(order, batch_size):
        ids, mask = pad_sequences([encoded[i]["input_ids"] for i in batch], pad_id, left=False)

        def forward(m: Any, ids: Any = ids, mask: Any = mask) -> Any:
            logits = m(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            return torch.softmax(logits.float(), dim=-1).cpu()  # [batch, num_labels]

        probs = models.run(forward, _tensor_rows(close_scores(models.atol)))
        for row, i in enumerate(batch):
            p = probs[row].tolist()
            best = max(range(len(p)), key=lambda j: p[j])
            out[i] = {
                "label": labels[best],
                "scores": {label: round(p[j], 6) for j, label in enumerate(labels)},
            }
        tick(len(batch))
    return out  # type: ignore[return-value]


def predict_images(
    model: Any,
    pre: Any,
    rows: Sequence[dict[str, Any]],
    labels: Sequence[str],
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Any]]:
    """Label and per-label probabilities of each image (the deterministic chain, in order)."""
    import torch

    from tunelab.lib.models.vision import pixels_for

    out = []
    models = as_models(model)
    for start in range(0, len(rows), batch_size):
        chunk = [pre.encode(r) for r in rows[start : start + batch_size]]
        stacked = torch.stack([e["pixel_values"] for e in chunk])  # [b, 3, H, W]

        def forward(m: Any, stacked: Any = stacked) -> Any:
            logits = m(pixel_values=pixels_for(m, stacked)).logits
            return torch.softmax(logits.float(), dim=-1).cpu()  # [batch, num_labels]

        probs = models.run(forward, _tensor_rows(close_scores(models.atol)))
        for p in probs.tolist():
            best = max(range(len(p)), key=lambda j: p[j])
            out.append(
                {
                    "label": labels[best],
                    "scores": {label: round(p[j], 6) for j, label in enumerate(labels)},
                }
            )
        tick(len(chunk))
    return out


def score_candidates(
    model: Any,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None] = lambda n: None,
) -> list[float]:
    """Summed log-likelihood of the loss positions of each (input_ids, labels) sequence.

    `labels` is -100 except on the target tokens (as in training). Sequences are left-padded so
    the targets sit at the end of every row, and only the last positions' logits are computed
    (`logits_to_keep`): the vocabulary projection of the prompt is never materialized.
    """
    import torch

    scores: list[float] = [0.0] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i][0]), i))
    models = as_models(model)
    device = models.device
    for batch in batches_of(order, batch_size):
        ids, mask = pad_sequences([sequences[i][0] for i in batch], pad_id, left=True)
        width = ids.shape[1]
        # target positions (in padded coordinates) of each row
        targets = []
        for i in batch:
            seq, lab = sequences[i]
            offset = width - len(seq)
            targets.append([(offset + t, seq[t]) for t, v in enumerate(lab) if v != -100 and t > 0])
        first = min((t for row in targets for t, _ in row), default=width - 1)
        keep = width - (first - 1)  # logits of positions first-1 .. width-1
        position_ids = left_padded_positions(mask)
        start = width - keep

        def forward(
            m: Any,
            ids: Any = ids,
            mask: Any = mask,
            position_ids: Any = position_ids,
            keep: int = keep,
            start: int = start,
            targets: list = targets,
        ) -> list:
            logits = m(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=position_ids.to(device),
                logits_to_keep=keep,
                use_cache=False,
            ).logits  # [batch, keep, vocab]
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            return [
                [float(sum(logp[row, t - 1 - start, tok] for t, tok in targets[row]))]
                for row in range(len(targets))
            ]

        found = models.run(forward, close_scores(models.atol))
        for row, i in enumerate(batch):
            scores[i] = found[row][0]
        tick(len(batch))
    return scores


def predict_rows(
    model: Any,
    tokenizer: Any,
    pre: Any,
    task: Any,
    cfg: StudyConfig,
    rows: list[dict[str, Any]],
    architecture: str,
    tick: Callable[[int], None],
    timing: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Predict and judge `rows`: one prediction dict per row, in the order of `rows`.

    Classification scores the labels (an encoder head, or a causal LM's label likelihoods);
    other tasks generate with a causal LM and are judged by `judge_output`. `tick(n)` is called
    as rows finish; a generating task fills `timing` (`generation_timing`). Raises
    EvaluationError for a generative task on a non-causal model.
    """
    ev = cfg.evaluation
    pad_id = pad_id_for(tokenizer)
    if task.kind == "classification":
        labels = list(task.labels)
        if architecture == "encoder":
            encoded = [pre.encode(r) for r in rows]
            found = predict_encoder(model, encoded, labels, pad_id, ev.batch_size, tick)
        elif architecture == "image":
            found = predict_images(model, pre, rows, labels, ev.batch_size, tick)
        else:
            found = _score_labels(model, pre, rows, labels, pad_id, ev.batch_size, tick)
        out = []
        for r, f in zip(rows, found, strict=True):
            gold = task.label_of(r)
            out.append(
                {
                    "id": r["id"],
                    "gold": gold,
                    "raw_output": f["label"],
                    "prediction": f["label"],
                    "correct": f["label"] == gold,
                    "verdicts": {"correct": f["label"] == gold},
                    "scores": f["scores"],
                    # the stored image (`images/<sha256>.<ext>` in the snapshot): the dossier's
                    # thumbnails find it without opening the split files
                    **({"image": r["image"]} if architecture == "image" else {}),
                }
            )
        return out
    if architecture != "causal_lm":
        raise EvaluationError(
            f"a {task.kind} task needs a causal LM, the base model is an {architecture}",
            hint="set model.path to a causal LM (e.g. SmolLM2) in study.yaml",
        )
    # room for what generation may add, not for the gold answer (see Preprocessor.prompt_ids)
    prompts = [pre.prompt_ids(r, generate=ev.max_new_tokens) for r in rows]
    batches: list[dict[str, Any]] = []
    raw = generate_outputs(
        model,
        tokenizer,
        prompts,
        max_new_tokens=ev.max_new_tokens,
        batch_size=ev.batch_size,
        tick=tick,
        stats=batches,
        # the answer is the first JSON object: nothing after it is read
        stop_at_answer=task.kind == "extraction",
        draft_tokens=ev.draft_tokens,
    )
    if timing is not None:
        answers = [pre.target_len(r) for r in rows]
        timing.update(generation_timing(batches, answers, ev.max_new_tokens))
    return [judge_output(task, r, text) for r, text in zip(rows, raw, strict=True)]


def _score_labels(
    model: Any,
    pre: Any,
    rows: list[dict[str, Any]],
    labels: list[str],
    pad_id: int,
    batch_size: int,
    tick: Callable[[int], None],
) -> list[dict[str, Any]]:
    """Causal-LM classification: every (example, label) pair scored, argmax per example."""
    sequences = []
    for r in rows:
        candidates = pre.encode_candidates(r)  # one per label, in task.labels order
        sequences += [(enc["input_ids"], enc["labels"]) for enc in candidates]
    k = len(labels)
    done = [0]

    def per_pair(n: int) -> None:  # progress in examples, not pairs
        done[0] += n
        whole = done[0] // k
        if whole:
            tick(whole)
            done[0] -= whole * k

    scores = score_candidates(model, sequences, pad_id, max(1, batch_size), per_pair)
    out = []
    for e in range(len(rows)):
        s = scores[e * k : (e + 1) * k]
        best = max(range(k), key=lambda j: s[j])
        out.append(
            {"label": labels[best], "scores": {lab: round(s[j], 4) for j, lab in enumerate(labels)}}
        )
    return out


def judge_output(task: Any, row: dict[str, Any], raw_output: str) -> dict[str, Any]:
    """Parse one generated output and give its per-metric verdicts.

    Pure: the returned prediction row (id, gold, raw_output, prediction, verdicts, ...) depends
    only on the task, the gold row and the text.
    """
    parsed = task.parse(raw_output)
    value = parsed.get("value")
    if task.kind == "extraction":
        gold = task.gold(row)
        verdicts = task.verdicts(parsed, row)
        correct = verdicts["correct"]
    else:
        task_verdicts = task.verdicts(parsed, row)
        json_schema = getattr(task, "json_schema", None) is not None
        gold = task.target_text(row)
        correct = bool(parsed.get("valid"))
        verdicts = {
            "format_valid": correct,
            "json_valid": bool(parsed.get("json_valid")) if json_schema else None,
            "schema_valid": bool(parsed.get("valid")) if json_schema else None,
            "exact_match": bool(task_verdicts.get("exact_match")),
            "failure": parsed.get("failure"),
        }
    return {
        "id": row["id"],
        "gold": gold,
        "raw_output": raw_output,
        "prediction": value,
        "correct": correct,
        "verdicts": verdicts,
        "parse_error": parsed.get("error"),
    }


def rescore_predictions(task: Any, predictions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prediction rows judged again from their recorded gold and raw output by the current
    rules (`judge_output` is pure): how records scored by an earlier scorer are compared."""
    return [
        judge_output(task, {"id": p["id"], "target": p["gold"]}, p.get("raw_output") or "")
        for p in predictions
    ]
