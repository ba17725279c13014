"""`tunelab export RUN --merge`: a LoRA or QLoRA adapter merged into its base, checked against
the adapted model it came from.

A QLoRA adapter was trained on 4-bit weights computing in `compute_dtype`; the merged model holds
those weights dequantized into `dtype` (bf16 or fp32) with the adapter added: its outputs are
close to the adapted model's, not equal. So both run the first validation examples (prompt and
gold answer) and the export records, and bounds by `MergeTolerance`: the largest absolute logit
difference, the share of positions whose greedy (argmax) token or label agrees, and the share of
examples whose prediction (the study's evaluation procedure) agrees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import ExportError
from tunelab.core.record_export import ExportBase, MergeCheck

if TYPE_CHECKING:
    from pathlib import Path

    from tunelab.core.study import Run, Study

MERGE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
NUM_MERGE_EXAMPLES = 8


@dataclass(frozen=True)
class MergeTolerance:
    """How far the merged model may be from the adapted one on the compared examples."""

    logits_max_abs_diff: float = 0.25
    greedy_agreement_min: float = 0.98
    prediction_agreement_min: float = 1.0

    def problems(self, figures: MergeCheck) -> list[str]:
        """The figures outside the tolerance, as sentences (empty: within)."""
        out = []
        if figures.logits_max_abs_diff > self.logits_max_abs_diff:
            out.append(
                f"largest logit difference {figures.logits_max_abs_diff:.4g} > "
                f"{self.logits_max_abs_diff:g}"
            )
        if figures.greedy_agreement < self.greedy_agreement_min:
            out.append(
                f"greedy agreement {figures.greedy_agreement:.4f} < {self.greedy_agreement_min:g}"
            )
        if figures.prediction_agreement < self.prediction_agreement_min:
            out.append(
                f"prediction agreement {figures.prediction_agreement:.4f} < "
                f"{self.prediction_agreement_min:g}"
            )
        return out


def merged_model(study: Study, run: Run, dtype: str):
    """The run's base with its adapter merged in, in `dtype` ("bf16" | "fp32"), on the CPU."""
    import torch

    from tunelab.lib.models import load_model, resolve_recorded
    from tunelab.stages.train.layout import final_checkpoint

    record, cfg = run.record, run.config
    base = resolve_recorded(cfg.model, study.root, record.base_model)
    torch.manual_seed(cfg.training.seed)
    model = load_model(base, cfg, record.labels)
    ckpt = final_checkpoint(run.dir / "checkpoints")
    return merge_adapter(model, ckpt / "adapter", dtype)


def merge_adapter(base: Any, adapter_dir: Path, dtype: str):
    """`base` (a freshly loaded model, 4-bit or not) with the peft adapter of `adapter_dir`
    merged in, in `dtype`: a 4-bit base is dequantized first (transformers' `dequantize`), so
    the adapter is added to the weights it was trained against, not quantized again."""
    import torch

    from tunelab.lib.models import load_trainable
    from tunelab.lib.models._quiet import quiet_transformers

    if getattr(base, "is_loaded_in_4bit", False):
        with quiet_transformers():
            base = base.dequantize()
    base = base.to(getattr(torch, MERGE_DTYPES[dtype]))
    model = load_trainable(base, adapter_dir, "lora")
    return model.merge_and_unload().eval()


def load_merged(folder: Path, architecture: str, dtype: str):
    """A merged model folder loaded with plain transformers, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tunelab.lib.models._quiet import quiet_transformers

    auto = AutoModelForSequenceClassification if architecture == "encoder" else AutoModelForCausalLM
    with quiet_transformers():
        model = auto.from_pretrained(folder, dtype=getattr(torch, MERGE_DTYPES[dtype]))
    return model.eval()


def logit_agreement(reference: Any, other: Any, ids: Any, mask: Any, *, causal: bool) -> dict:
    """Two models' logits on `ids` [batch, seq] compared over the tokens `mask` keeps (an
    encoder: its label logits): {examples, positions, logits_max_abs_diff, logits_max_abs,
    greedy_agreement}."""
    import torch

    with torch.inference_mode():
        ref = reference(input_ids=ids, attention_mask=mask).logits.float()
        got = other(input_ids=ids, attention_mask=mask).logits.float()
    if causal:  # [batch, seq, vocab] -> [tokens, vocab]
        ref, got = ref[mask.bool()], got[mask.bool()]
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    return {
        "examples": int(ids.shape[0]),
        "positions": int(agree.numel()),
        "logits_max_abs_diff": float((ref - got).abs().max()),
        "logits_max_abs": float(ref.abs().max()),
        "greedy_agreement": float(agree.mean()),
    }


def compare_models(
    reference: Any,
    merged: Any,
    tokenizer: Any,
    cfg: Any,
    labels: list[str] | None,
    architecture: str,
    rows: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, the merged model's prediction of `rows[0]` alone, as check-export runs it):
    logits of prompt + gold answer (an encoder: the label logits) compared position by position
    over the tokens, and the predictions of the study's evaluation procedure compared example
    by example."""
    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.stage import pad_id_for, pad_sequences

    pre = Preprocessor(tokenizer, cfg, get_task(cfg, labels), architecture)
    ids, mask = pad_sequences(
        [pre.encode(r)["input_ids"] for r in rows], pad_id_for(tokenizer), left=False
    )
    figures = logit_agreement(reference, merged, ids, mask, causal=architecture != "encoder")
    want = predict(reference, tokenizer, cfg, labels, architecture, rows)
    mine = predict(merged, tokenizer, cfg, labels, architecture, rows)
    same = [a["prediction"] == b["prediction"] for a, b in zip(want, mine, strict=True)]
    figures.update(
        prediction_agreement=sum(same) / len(same),
        predictions_differ=[a["id"] for a, ok in zip(rows, same, strict=True) if not ok],
    )
    # in bf16 a row's scores depend on the batch it is padded in: the example alone
    return figures, predict(merged, tokenizer, cfg, labels, architecture, rows[:1])[0]


def predict(
    model: Any,
    tokenizer: Any,
    cfg: Any,
    labels: list[str] | None,
    architecture: str,
    rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The study's evaluation procedure on `rows` (seeded as check-export runs it)."""
    import torch

    from tunelab.lib.preprocess.text import Preprocessor
    from tunelab.lib.tasks import get_task
    from tunelab.stages.evaluate.predict import predict_rows

    task = get_task(cfg, labels)
    pre = Preprocessor(tokenizer, cfg, task, architecture)
    torch.manual_seed(cfg.evaluation.seed)
    with torch.inference_mode():
        return predict_rows(model, tokenizer, pre, task, cfg, rows, architecture, lambda n: None)


def merge_into(
    study: Study,
    run: Run,
    method: str,
    rows: list[dict[str, Any]],
    dst: Path,
    *,
    dtype: str = "bf16",
    tolerance: MergeTolerance | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the merged model into `dst` (save_pretrained: config.json + model.safetensors),
    load it back and compare its outputs on `rows` with the adapted model's; returns (the
    manifest's `merge` record, the merged model's prediction of `rows[0]` alone).

    Raises ExportError (exit 2) naming the figures beyond `tolerance`; the caller then removes
    `dst` (the export's temporary folder): nothing is published.
    """
    from tunelab.lib.models._quiet import quiet_transformers
    from tunelab.stages.train import load_run_model

    if method not in ("lora", "qlora"):
        raise ExportError(
            f"--merge merges an adapter; run {run.id} trained with adaptation.method {method}",
            hint="export it without --merge: the folder already holds the whole model",
        )
    if dtype not in MERGE_DTYPES:
        raise ExportError(
            f"--merge-dtype {dtype!r}: not one of {', '.join(MERGE_DTYPES)}",
            hint="bf16 halves the size of the merged model; fp32 keeps the adapter's precision",
        )
    if not rows:
        raise ExportError(
            f"run {run.id}'s data snapshot has no validation example to check the merge on",
            hint="export without --merge, or rebuild the snapshot with a validation split",
        )
    tolerance = tolerance or MergeTolerance()
    record, cfg = run.record, run.config
    with quiet_transformers():
        merged_model(study, run, dtype).save_pretrained(dst, safe_serialization=True)
    reference, tokenizer, base = load_run_model(study, run, device="cpu")
    # the model as a user loads it: its buffers (RoPE frequencies) as from_pretrained makes them
    merged = load_merged(dst, base.architecture, dtype)
    figures, example = compare_models(
        reference, merged, tokenizer, cfg, record.labels, base.architecture, rows
    )
    from tunelab.stages.export.manifest import MANIFEST

    measured = MergeCheck.of(dst / MANIFEST, figures, "merge")  # as the manifest records them
    problems = tolerance.problems(measured)
    if problems:
        raise ExportError(
            f"the merged model ({dtype}) is not close enough to run {run.id}'s adapted model "
            f"on {measured.examples} validation examples: " + "; ".join(problems),
            hint=_refused_merge_hint(dtype, problems, measured),
        )
    quantization = ExportBase.of(record.path, record.base_model or {}, "base_model").quantization
    merge = {
        "dtype": dtype,
        "from": method,
        # the 4-bit settings the adapter was trained on
        "dequantized_from": quantization.raw if quantization is not None else None,
        "compared_on": "validation",
        "example_ids": [r["id"] for r in rows],
        **figures,
        "tolerance": asdict(tolerance),
        "within_tolerance": True,
    }
    return merge, example


def _refused_merge_hint(dtype: str, problems: list[str], figures: MergeCheck) -> str:
    """What is left to try once a merge in `dtype` was refused (fp32 is the closest merge)."""
    hint = "export the adapter without --merge (it loads onto the base as trained)"
    if dtype != "fp32":
        return hint + ", or try --merge-dtype fp32"
    if len(problems) == 1 and problems[0].startswith("largest logit difference"):
        return (
            hint + "; fp32 is the closest merge: --merge-atol "
            f"{figures.logits_max_abs_diff:.3g} would accept this difference"
        )
    return hint + "; fp32 is the closest merge"
