"""`tunelab inspect`: look at examples after the exact preprocessing of training, and stop on a
broken mask.

For N examples of every category (the label; an extraction target's kinds such as `list null`;
for other unlabelled rows the target when the split has few distinct ones, else "all") plus the
longest example of the split, the record holds the exact rendered text with special tokens visible, the
token count, which positions carry loss, where truncation cut, and whether the tokens under the
loss decode to the expected target. Length statistics and the stop conditions cover the whole
split. The record is `records/inspect/<id>.json` plus a small HTML page `<id>.html`.

`inspect_rows` is the pure part (values in, values out); `run` loads the snapshot and
the tokenizer, and writes the records.
"""

from __future__ import annotations

import html
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tunelab.core.evidence import latest_hypothesis
from tunelab.core.hashing import sha256_json
from tunelab.core.progress import Progress
from tunelab.core.record_inspect import (
    AnswerBudget,
    InspectExample,
    Inspection,
    LengthStats,
    TokenView,
)
from tunelab.core.records import write_bytes_atomic, write_json_atomic
from tunelab.lib.preprocess.mask_checks import IGNORE_INDEX, check_collated
from tunelab.lib.preprocess.text import Preprocessor, Problem, length_stats, nearest_rank
from tunelab.lib.tasks import Task, get_task

if TYPE_CHECKING:
    from tunelab.core.study import Study

NO_CATEGORY = "all"


# ---------------------------------------------------------------- pure logic


MAX_TARGET_CATEGORIES = 20


def categorize(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The category of each row: its label; for rows without labels, the target itself when
    the split has few distinct targets (e.g. a format task's verdicts); else "all"."""
    if any(r.get("label") is not None for r in rows):
        return [NO_CATEGORY if r.get("label") is None else str(r["label"]) for r in rows]
    targets = {str(r.get("target")) for r in rows if r.get("target") is not None}
    if 1 < len(targets) <= MAX_TARGET_CATEGORIES:
        return [NO_CATEGORY if r.get("target") is None else str(r["target"]) for r in rows]
    return [NO_CATEGORY] * len(rows)


def select_examples(categories: Sequence[str], per_category: int) -> list[int]:
    """Indices of the first `per_category` rows of each category, categories sorted."""
    chosen: dict[str, list[int]] = {}
    for i, category in enumerate(categories):
        picked = chosen.setdefault(category, [])
        if len(picked) < per_category:
            picked.append(i)
    return [i for category in sorted(chosen) for i in chosen[category]]


def token_view(pre: Preprocessor, enc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each token: its text (decoded alone), whether it is special, whether it carries loss."""
    tok = pre.tokenizer
    special_ids = set(getattr(tok, "all_special_ids", []) or [])
    decoder = getattr(tok, "added_tokens_decoder", {}) or {}
    special_ids |= {i for i, t in decoder.items() if getattr(t, "special", False)}
    labels = enc.get("labels")
    out = []
    ids = list(enc["input_ids"])
    previous = ""
    for i, token_id in enumerate(ids):
        # A token decoded alone loses the space before it (WordPiece "##" pieces, SentencePiece);
        # the growth of the decoded prefix keeps it, so the view reads like the text.
        prefix = tok.decode(ids[: i + 1], skip_special_tokens=False)
        if prefix.startswith(previous) and token_id not in special_ids:
            text = prefix[len(previous) :]
        else:
            text = tok.decode([token_id], skip_special_tokens=False)
        previous = prefix
        out.append(
            {
                "text": text,
                "id": int(token_id),
                "special": token_id in special_ids,
                "loss": labels is not None and labels[i] != IGNORE_INDEX,
            }
        )
    return out


def truncation_point(pre: Preprocessor, enc: dict[str, Any]) -> int | None:
    """Token position where input tokens were removed (None when nothing was cut)."""
    if not enc.get("input_tokens_cut"):
        return None
    if pre.architecture == "encoder":
        if pre.cfg.truncation_side == "left":
            return len(pre.lead_ids)
        return len(enc["input_ids"]) - len(pre.trail_ids)
    if pre.cfg.truncation_side == "left":
        return len(pre.prefix_ids)
    return enc["prompt_len"] - len(pre.suffix_ids)


def describe_example(
    pre: Preprocessor, enc: dict[str, Any], category: str, problems: list[Problem]
) -> dict[str, Any]:
    """What `inspect` shows of one encoded example."""
    tok = pre.tokenizer
    ids = enc["input_ids"]
    view = token_view(pre, enc)
    out: dict[str, Any] = {
        "id": enc["id"],
        "category": category,
        "num_tokens": len(ids),
        "rendered": tok.decode(ids, skip_special_tokens=False),
        "target_text": enc.get("target_text"),
        "truncated": bool(enc.get("truncated")),
        "input_tokens": enc.get("input_tokens"),
        "input_tokens_cut": enc.get("input_tokens_cut", 0),
        "truncation_at": truncation_point(pre, enc),
        "tokens": view,
    }
    if pre.architecture == "causal_lm":
        loss_ids = [t["id"] for t in view if t["loss"]]
        out.update(
            prompt_len=enc["prompt_len"],
            num_loss_tokens=len(loss_ids),
            target_truncated=bool(enc.get("target_truncated")),
            loss_decoded=tok.decode(loss_ids, skip_special_tokens=False),
            expected_loss_text=(enc.get("target_text") or "") + (pre.eos_token or ""),
        )
    else:
        out.update(label_index=enc.get("label"), num_loss_tokens=0, loss_decoded=None)
    out["problems"] = [p.to_dict() for p in problems]
    out["check"] = "ok" if not problems else ", ".join(sorted({p.kind for p in problems}))
    return out


def collator_problems(pre: Preprocessor, encoded: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Run training's collator (padded and packed) on `encoded` and check the loss positions."""
    if pre.architecture != "causal_lm" or not encoded:
        return {"checked": False, "why": "encoder: one label per example", "problems": []}
    try:
        from tunelab.stages.train.batches import collate
    except ImportError as exc:
        return {"checked": False, "why": f"training collator not available ({exc})", "problems": []}
    pad_id = pre.pad_id if pre.pad_id is not None else 0
    padded = collate(encoded, pad_id, "causal_lm", packing=False)["labels"]
    packed = collate(encoded, pad_id, "causal_lm", packing=True)["labels"][0].tolist()
    slices, start = [], 0
    for e in encoded:
        slices.append(packed[start : start + len(e["input_ids"])])
        start += len(e["input_ids"])
    problems = check_collated(encoded, list(padded), pad_id, pre.eos_id)
    problems += check_collated(encoded, slices, pad_id, pre.eos_id)
    return {"checked": True, "why": None, "problems": [p.to_dict() for p in problems]}


def answer_budget(
    encoded: Sequence[dict[str, Any]], task_kind: str, max_new_tokens: int
) -> dict[str, Any] | None:
    """How the split's answers (target tokens and EOS, as trained) compare with the evaluation's
    generation budget, `evaluation.max_new_tokens`: an answer longer than it is cut by every
    evaluation, so its JSON or format can never be judged right. None for a task that does not
    generate (classification) or an encoder."""
    answers = [(str(e["id"]), e["target_len"]) for e in encoded if e.get("target_len") is not None]
    if task_kind == "classification" or not answers:
        return None
    over = [i for i, n in answers if n > max_new_tokens]
    ranked = sorted(n for _, n in answers)
    return {
        "max_new_tokens": max_new_tokens,
        "n": len(answers),
        "over": len(over),
        "over_ids": over[:10],
        "longest": ranked[-1],
        "p95": nearest_rank(ranked, 0.95),
    }


def describe_answer_budget(budget: dict[str, Any] | None) -> str | None:
    """The warning `tunelab inspect` prints (and its page shows) when answers exceed the
    generation budget (`AnswerBudget.warning`); None when they all fit."""
    return AnswerBudget.of("answer_budget", budget).warning if budget else None


def inspect_rows(
    pre: Preprocessor,
    task: Task,
    rows: Sequence[dict[str, Any]],
    *,
    per_category: int = 2,
    progress: Progress | None = None,
    max_new_tokens: int | None = None,
    what: str = "encoding",
) -> dict[str, Any]:
    """Encode every row, check all of them, and describe `per_category` examples per category
    plus the longest one. Returns the inspect record (without ids and paths).

    `max_new_tokens` (`evaluation.max_new_tokens`) is the generation budget the answers are
    measured against (`answer_budget`); None skips that check. `progress(what, done, total)`
    (core.progress) after each row."""
    encoded = []
    for i, row in enumerate(rows):
        encoded.append(pre.encode(row))
        if progress:
            progress(what, i + 1, len(rows))
    problems = pre.find_problems(encoded)
    # targets the task's scorer can never match (extraction: not read as an object, off-schema)
    problems += [Problem(**p) for p in task.target_problems(rows)]
    by_id: dict[str, list[Problem]] = {}
    for p in problems:
        by_id.setdefault(p.example_id, []).append(p)
    cats = task.categories(rows) or categorize(rows)
    reasons = {i: "category" for i in select_examples(cats, per_category)}
    if encoded:
        # the longest input before any cut: where truncation bites hardest
        longest = max(
            range(len(encoded)),
            key=lambda i: (encoded[i].get("input_tokens", 0), len(encoded[i]["input_ids"]), -i),
        )
        reasons.setdefault(longest, "longest")
    # The first few broken examples are shown too, so the page shows what is wrong.
    broken = [i for i, e in enumerate(encoded) if str(e["id"]) in by_id and i not in reasons]
    for i in broken[:3]:
        reasons[i] = "broken"
    shown = list(reasons)
    examples = []
    for i in shown:
        found = by_id.get(str(encoded[i]["id"]), [])
        d = describe_example(pre, encoded[i], cats[i], found)
        d["why_shown"] = reasons[i]
        examples.append(d)
    collator = collator_problems(pre, [encoded[i] for i in shown])
    categories: dict[str, list[dict[str, Any]]] = {}
    for category, enc in zip(cats, encoded, strict=True):
        categories.setdefault(category, []).append(enc)
    all_problems = [p.to_dict() for p in problems] + collator["problems"]
    return {
        "task": task.describe(),
        "preprocess": pre.describe(),
        "template_sha256": pre.template_sha256,
        "n": len(rows),
        "stats": length_stats(encoded),
        "answer_budget": (
            None if max_new_tokens is None else answer_budget(encoded, task.kind, max_new_tokens)
        ),
        "category_stats": {c: length_stats(v) for c, v in sorted(categories.items())},
        "examples": examples,
        "collator": {k: v for k, v in collator.items() if k != "problems"},
        "problems": all_problems,
        "ok": not all_problems,
    }


# ---------------------------------------------------------------- HTML page

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.tokens{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.9;
  border:1px solid #ddd;padding:.6em;background:#fcfcfc}
.t{border-right:1px dotted #bbb;padding:0 1px}
.loss{background:#c8f0c8} .special{color:#8a2be2;font-weight:bold} .nl{color:#999}
.cut{background:#f66;color:#fff;padding:0 .3em;font-weight:bold}
.ok{color:#187018;font-weight:bold} .bad{color:#b00;font-weight:bold}
.problem{color:#b00} .meta{color:#555}
"""


def _token_html(t: TokenView) -> str:
    text = html.escape(t.text)
    text = text.replace("\n", '<span class="nl">\u21b5</span>\n').replace("\t", "\u2192")
    classes = ["t"] + (["loss"] if t.loss else []) + (["special"] if t.special else [])
    return f'<span class="{" ".join(classes)}" title="id {t.id}">{text}</span>'


def _example_html(ex: InspectExample) -> list[str]:
    """One shown example: its heading, its tokens with the loss marked, what the loss decodes to."""
    e = html.escape
    parts = []
    verdict = (
        "<span class='ok'>loss span = target</span>"
        if ex.check == "ok"
        else f"<span class='bad'>{e(str(ex.check))}</span>"
    )
    cut = (
        f", input cut by {ex.input_tokens_cut} of {ex.input_tokens} tokens" if ex.truncated else ""
    )
    parts.append(
        f"<h2>{e(str(ex.id))} <span class='meta'>[{e(ex.category)}, "
        f"{e(str(ex.why_shown))}]</span></h2><p class='meta'>{ex.num_tokens} tokens, "
        + ("the loss is on the label" if ex.classifier else f"{ex.num_loss_tokens} under the loss")
        + f"{e(cut)}; {verdict}</p>"
    )
    toks = []
    for i, t in enumerate(ex.tokens):
        if ex.truncation_at == i:
            toks.append("<span class='cut' title='truncation point'>\u2702</span>")
        toks.append(_token_html(t))
    parts.append(f"<div class='tokens'>{''.join(toks)}</div>")
    if ex.loss_decoded is not None:
        parts.append(
            f"<p class='meta'>loss decodes to <code>{e(ex.loss_decoded)}</code>, expected "
            f"<code>{e(str(ex.expected_loss_text))}</code></p>"
        )
    for p in [Problem(**p) for p in ex.problems or []]:
        parts.append(f"<p class='problem'>{e(p.message)} \u2014 fix: {e(p.fix)}</p>")
    return parts


def _lengths_rows(record: Inspection) -> list[str]:
    e = html.escape
    stats = record.stats or LengthStats(record.path, {}, where="stats")
    rows = []
    for name, s in [("all", stats), *record.category_stats.items()]:
        share = "-" if s.share_truncated is None else f"{100 * s.share_truncated:.1f} %"
        rows.append(
            f"<tr><td>{e(str(name))}</td><td>{s.n}</td><td>{s.p50}</td><td>{s.p95}</td>"
            f"<td>{s.max}</td><td>{share}</td></tr>"
        )
    return rows


def render_html(record: Inspection) -> str:
    """A self-contained page of the inspect record; every user string is escaped."""
    e = html.escape
    pre = record.preprocess
    problems = [Problem(**p) for p in record.problems or []]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>tunelab inspect {e(record.inspect_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>tunelab inspect: {e(str(record.study or ''))} / {e(record.split)}</h1>",
        f"<p class='meta'>snapshot {e(str(record.snapshot_id))}, task "
        f"{e(str(record.task_kind))}, template {e(str(pre.template))}, template sha256 "
        f"<code>{e(str(record.template_sha256)[:16])}</code>, max_seq_len {pre.max_seq_len}, "
        f"truncation side {e(str(pre.truncation_side))}</p>",
        "<p>"
        + (
            "<span class='ok'>all checks pass</span>"
            if record.ok
            else f"<span class='bad'>{len(problems)} problem(s): training will refuse "
            "this data</span>"
        )
        + "</p>",
        "<p class='meta'>Green: positions that carry loss. Purple: special tokens. "
        "\u21b5: newline. <span class='cut'>\u2702</span>: truncation point.</p>",
        "<h2>Lengths (tokens)</h2><table><tr><th>category</th><th>n</th><th>p50</th>"
        "<th>p95</th><th>max</th><th>truncated</th></tr>",
        *_lengths_rows(record),
        "</table>",
    ]
    if problems:
        parts.append("<h2>Stop conditions</h2><ul>")
        for p in problems:
            parts.append(
                f"<li class='problem'>example <b>{e(p.example_id)}</b> [{e(p.kind)}]: "
                f"{e(p.message)}<br><span class='meta'>fix: {e(p.fix)}</span></li>"
            )
        parts.append("</ul>")
    budget = record.answer_budget.warning if record.answer_budget else None
    if budget:
        parts.append(f"<h2>Generation budget</h2><p class='bad'>{e(budget)}</p>")
    if pre.notes:
        parts.append("<h2>Notes</h2><ul>")
        parts += [f"<li>{e(n)}</li>" for n in pre.notes]
        parts.append("</ul>")
    for ex in record.examples:
        parts += _example_html(ex)
    parts.append("</body></html>\n")
    return "\n".join(parts)


# ---------------------------------------------------------------- study edge


def load_base_tokenizer(study: Study) -> tuple[Any, str]:
    """(tokenizer, architecture) of the study's base model, as training loads them."""
    from tunelab.lib.models import load_tokenizer, resolve_base

    base = resolve_base(study)
    return load_tokenizer(base), base.architecture


def new_inspect_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"inspect-{stamp}-{secrets.token_hex(3)}"


def run(
    study: Study,
    *,
    split: str = "train",
    per_category: int = 2,
    snapshot_id: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Inspect a split of the study's data snapshot; writes `records/inspect/<id>.json` and
    `<id>.html` and returns the record (its `problems` are the stop conditions found)."""
    from tunelab.stages.data import load_snapshot

    snapshot = load_snapshot(study, snapshot_id)
    rows = snapshot.rows(split)
    tokenizer, architecture = load_base_tokenizer(study)
    task = get_task(study.config, snapshot.labels)
    pre = Preprocessor(tokenizer, study.config, task, architecture)
    if architecture == "image":
        from tunelab.lib.models import resolve_base
        from tunelab.stages.inspect.images import inspect_images, render_images_html

        body = inspect_images(
            pre,
            rows,
            split=split,
            per_category=per_category,
            progress=progress,
            model_dir=resolve_base(study).path,
        )
        render = render_images_html
    else:
        body = inspect_rows(
            pre,
            task,
            rows,
            per_category=per_category,
            progress=progress,
            max_new_tokens=study.config.evaluation.max_new_tokens,
            what=f"encoding {split}",
        )
        render = render_html
    inspect_id = new_inspect_id()
    out_dir = study.records / "inspect"
    hypothesis = latest_hypothesis(study.records)  # inspect may come before the registration
    record = {
        "inspect_id": inspect_id,
        "study": study.config.name,
        "split": split,
        "snapshot_id": snapshot.id,
        "config_sha256": study.config.sha256(),
        "hypothesis_version": hypothesis and hypothesis.version,
        "hypothesis_sha256": hypothesis and hypothesis.sha256,
        "per_category": per_category,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        **body,
    }
    record["sha256"] = sha256_json(record)
    json_path = write_json_atomic(out_dir / f"{inspect_id}.json", record)
    page = render(Inspection.of(json_path, record))
    html_path = write_bytes_atomic(out_dir / f"{inspect_id}.html", page.encode("utf-8"))
    study.ledger.add_event(
        None,
        "inspect",
        {"id": inspect_id, "split": split, "ok": record["ok"], "problems": len(record["problems"])},
    )
    return {**record, "json_path": str(json_path), "html_path": str(html_path)}
