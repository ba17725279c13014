"""The limitations of an exported model, as data (`limitations_detail`) and as sentences.

Pure: values in, values out. The export gathers the detail from the records; the model card
and the dossier print the sentences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tunelab.core.record_export import LimitationsDetail, MergeCheck, Quantization
from tunelab.core.record_parts import CompareEntry
from tunelab.core.run_parts import Prediction
from tunelab.lib.metrics import failure_kind
from tunelab.stages.export.manifest import MANIFEST


def _present(piece: Any) -> bool:
    """A piece the record holds with something in it (an empty object says nothing)."""
    return piece is not None and bool(piece.raw)


def regressions(comparison: CompareEntry | Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Categories and fields whose metrics went down against the baseline (delta < 0)."""
    if not comparison:
        return []
    if not isinstance(comparison, CompareEntry):
        # a row built in memory may lack a run id: only its tables are read, each one checked
        comparison = CompareEntry(Path(MANIFEST), dict(comparison), where="results")
    out = []
    for table, keys in (("per_category", ("f1",)), ("per_field", ("f1", "normalized_match"))):
        rows = comparison.per_category if table == "per_category" else comparison.per_field
        for item, row in rows.items():
            for key in keys:
                entry = row.get(key)
                delta = entry.delta if entry is not None else None
                if delta is not None and delta < 0:
                    out.append(
                        {
                            "scope": table.removeprefix("per_"),
                            "item": item,
                            "metric": key,
                            "baseline": entry.baseline,
                            "variant": entry.variant,
                            "delta": delta,
                        }
                    )
    return out


def failure_kinds(predictions: Sequence[Prediction | Mapping[str, Any]]) -> dict[str, Any]:
    """How predictions failed: parse/format failure kinds (generation tasks) and the most
    frequent confusions (classification). Rows built in memory are read as written."""
    kinds: Counter[str] = Counter()
    confusions: Counter[str] = Counter()
    for row in predictions:
        p = row if isinstance(row, Prediction) else Prediction(Path("predictions"), dict(row))
        verdicts = p.verdicts or {}
        failure = verdicts.get("failure")
        if isinstance(failure, Mapping):
            failure = failure.get("kind") or failure.get("failure")
        else:  # the kinds the evaluation's failures table counts
            failure = failure_kind(verdicts)
        if failure:
            kinds[str(failure)] += 1
        elif p.correct is False and isinstance(p.prediction, str):
            confusions[f"{p.gold} -> {p.prediction}"] += 1
    return {
        "n": len(predictions),
        "failures": dict(kinds.most_common()),
        "top_confusions": dict(confusions.most_common(5)),
    }


def limitation_lines(detail: LimitationsDetail | Mapping[str, Any]) -> list[str]:
    """The limitations as sentences (the model card and the dossier print them)."""
    d = detail
    if not isinstance(d, LimitationsDetail):
        d = LimitationsDetail.of(MANIFEST, detail, "limitations_detail")
    lines = []
    if d.not_compared:
        lines.append(f"Not compared with the baseline: {d.not_compared}")
    for r in d.regressed:
        lines.append(
            f"{r.scope} {r.item!r}: {r.metric} went down against the baseline "
            f"({number_text(r.baseline)} -> {number_text(r.variant)}, {r.delta:+.4f})"
        )
    for g in d.guardrails_failed:
        where = f" for {g.item!r}" if g.item is not None else ""
        lines.append(
            f"guardrail failed{where}: {g.rule} (value {number_text(g.value)}, bound "
            f"{number_text(g.bound)}){'; ' + g.note if g.note else ''}"
        )
    fk = d.failure_kinds
    if fk is not None and fk.failures:
        shown = ", ".join(f"{k}: {v}" for k, v in fk.failures.items())
        lines.append(f"failure kinds in {fk.n} validation predictions: {shown}")
    if fk is not None and fk.top_confusions:
        shown = ", ".join(f"{k} ({v})" for k, v in fk.top_confusions.items())
        lines.append(f"most frequent confusions on validation: {shown}")
    for split, t in d.truncation.items():
        if t.truncated:
            lines.append(
                f"{t.truncated} of {t.n} {split} examples ({t.share:.1%}) were truncated "
                f"to preprocess.max_seq_len"
            )
    lines += _opening_lines(d.test_openings)
    if d.verify is None:
        lines.append("the checkpoint was not verified in a fresh process (`tunelab verify`)")
    elif not d.verify.passed:
        lines.append(f"the latest `tunelab verify` failed: {d.verify.reason}")
    lines += _quantization_lines(d.quantization, d.merge)
    processor = d.processor
    if _present(processor) and not processor.matches:
        why = processor.error or f"max |diff| {processor.max_abs_diff:.2e}"
        lines.append(
            f"the exported image processor does not give the training transforms' pixel values "
            f"({why}): preprocess as the manifest's config.preprocess.image and the steps in "
            "the card say"
        )
    for note in d.notes or []:
        lines.append(f"note: {note}")
    return lines


def _opening_lines(openings: int | None) -> list[str]:
    """What the sealed test split's openings make of any test result."""
    if openings is None:
        return []
    if openings == 0:
        return ["the sealed test split was never opened: no test-set result exists"]
    if openings > 1:
        return [
            f"the sealed test split was opened {openings} times: test results are biased "
            "by the choices made between openings"
        ]
    return ["the sealed test split was opened once"]


def _quantization_lines(q: Quantization | None, merge: MergeCheck | None) -> list[str]:
    """What a 4-bit base and a merge change about how the model may be used."""
    lines = []
    if _present(q) and not _present(merge):
        lines.append(
            f"the adapter was trained on the base loaded in 4 bits ({q.quant_type}, "
            f"double_quant {q.double_quant}, compute_dtype {q.compute_dtype}, "
            f"bitsandbytes {q.bitsandbytes}): load the base with that BitsAndBytesConfig; "
            "on the base in full precision its outputs differ"
        )
    if _present(merge):
        source = "dequantized 4-bit base" if merge.dequantized_from else "base"
        lines.append(
            f"merged into the {source} in {merge.dtype}: not exact; on "
            f"{merge.examples} validation examples the largest logit difference from the "
            f"adapted model is {merge.logits_max_abs_diff:.4g} (tolerance "
            f"{merge.logits_bound:g}), greedy agreement "
            f"{merge.greedy_agreement:.2%}, prediction agreement "
            f"{merge.prediction_agreement:.2%}"
        )
    return lines


def number_text(x: Any) -> str:
    """A value as the model card and the limitations print it (4 decimals, "-" for None)."""
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))
