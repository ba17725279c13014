"""The limitations of an exported model, as data (`limitations_detail`) and as sentences.

Pure: values in, values out. The export gathers the detail from the records; the model card
and the dossier print the sentences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tunelab.lib.metrics import failure_kind


def regressions(comparison: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Categories and fields whose metrics went down against the baseline (delta < 0)."""
    if not comparison:
        return []
    out = []
    for table, keys in (("per_category", ("f1",)), ("per_field", ("f1", "normalized_match"))):
        for item, row in (comparison.get(table) or {}).items():
            for key in keys:
                entry = (row or {}).get(key) or {}
                delta = entry.get("delta")
                if delta is not None and delta < 0:
                    out.append(
                        {
                            "scope": table.removeprefix("per_"),
                            "item": item,
                            "metric": key,
                            "baseline": entry.get("baseline"),
                            "variant": entry.get("variant"),
                            "delta": delta,
                        }
                    )
    return out


def failure_kinds(predictions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How predictions failed: parse/format failure kinds (generation tasks) and the most
    frequent confusions (classification)."""
    kinds: Counter[str] = Counter()
    confusions: Counter[str] = Counter()
    for p in predictions:
        verdicts = p.get("verdicts") or {}
        failure = verdicts.get("failure")
        if isinstance(failure, Mapping):
            failure = failure.get("kind") or failure.get("failure")
        else:  # the kinds the evaluation's failures table counts
            failure = failure_kind(verdicts)
        if failure:
            kinds[str(failure)] += 1
        elif p.get("correct") is False and isinstance(p.get("prediction"), str):
            confusions[f"{p.get('gold')} -> {p.get('prediction')}"] += 1
    return {
        "n": len(predictions),
        "failures": dict(kinds.most_common()),
        "top_confusions": dict(confusions.most_common(5)),
    }


def limitation_lines(detail: Mapping[str, Any]) -> list[str]:
    """The limitations as sentences (the model card and the dossier print them)."""
    lines = []
    if detail.get("not_compared"):
        lines.append(f"Not compared with the baseline: {detail['not_compared']}")
    for r in detail.get("regressed") or []:
        lines.append(
            f"{r['scope']} {r['item']!r}: {r['metric']} went down against the baseline "
            f"({number_text(r['baseline'])} -> {number_text(r['variant'])}, {r['delta']:+.4f})"
        )
    for g in detail.get("guardrails_failed") or []:
        where = f" for {g['item']!r}" if g.get("item") is not None else ""
        lines.append(
            f"guardrail failed{where}: {g['rule']} (value {number_text(g.get('value'))}, bound "
            f"{number_text(g.get('bound'))}){'; ' + g['note'] if g.get('note') else ''}"
        )
    fk = detail.get("failure_kinds") or {}
    if fk.get("failures"):
        shown = ", ".join(f"{k}: {v}" for k, v in fk["failures"].items())
        lines.append(f"failure kinds in {fk['n']} validation predictions: {shown}")
    if fk.get("top_confusions"):
        shown = ", ".join(f"{k} ({v})" for k, v in fk["top_confusions"].items())
        lines.append(f"most frequent confusions on validation: {shown}")
    for split, t in (detail.get("truncation") or {}).items():
        if t.get("truncated"):
            lines.append(
                f"{t['truncated']} of {t['n']} {split} examples ({t['share']:.1%}) were truncated "
                f"to preprocess.max_seq_len"
            )
    openings = detail.get("test_openings")
    if openings is not None:
        if openings == 0:
            lines.append("the sealed test split was never opened: no test-set result exists")
        elif openings > 1:
            lines.append(
                f"the sealed test split was opened {openings} times: test results are biased "
                "by the choices made between openings"
            )
        else:
            lines.append("the sealed test split was opened once")
    if detail.get("verify") is None:
        lines.append("the checkpoint was not verified in a fresh process (`tunelab verify`)")
    elif not detail["verify"].get("passed"):
        lines.append(f"the latest `tunelab verify` failed: {detail['verify'].get('reason')}")
    lines += _quantization_lines(detail.get("quantization"), detail.get("merge"))
    processor = detail.get("processor")
    if processor and not processor.get("matches"):
        why = processor.get("error") or f"max |diff| {processor.get('max_abs_diff'):.2e}"
        lines.append(
            f"the exported image processor does not give the training transforms' pixel values "
            f"({why}): preprocess as the manifest's config.preprocess.image and the steps in "
            "the card say"
        )
    for note in detail.get("notes") or []:
        lines.append(f"note: {note}")
    return lines


def _quantization_lines(q: Mapping[str, Any] | None, merge: Mapping[str, Any] | None) -> list[str]:
    """What a 4-bit base and a merge change about how the model may be used."""
    lines = []
    if q and not merge:
        lines.append(
            f"the adapter was trained on the base loaded in 4 bits ({q.get('quant_type')}, "
            f"double_quant {q.get('double_quant')}, compute_dtype {q.get('compute_dtype')}, "
            f"bitsandbytes {q.get('bitsandbytes')}): load the base with that BitsAndBytesConfig; "
            "on the base in full precision its outputs differ"
        )
    if merge:
        source = "dequantized 4-bit base" if merge.get("dequantized_from") else "base"
        lines.append(
            f"merged into the {source} in {merge['dtype']}: not exact; on "
            f"{merge['examples']} validation examples the largest logit difference from the "
            f"adapted model is {merge['logits_max_abs_diff']:.4g} (tolerance "
            f"{merge['tolerance']['logits_max_abs_diff']:g}), greedy agreement "
            f"{merge['greedy_agreement']:.2%}, prediction agreement "
            f"{merge['prediction_agreement']:.2%}"
        )
    return lines


def number_text(x: Any) -> str:
    """A value as the model card and the limitations print it (4 decimals, "-" for None)."""
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))
