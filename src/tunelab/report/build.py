"""`tunelab report`: the dossier, built only from the study's records.

report/dossier.md and report/dossier.html (self-contained: images inlined, every string escaped)
plus the plot PNGs. Sections: decision, hypothesis and its versions, data, inspection, baseline,
sizing, runs (failed ones included), loss curves, per-category / per-field results, comparisons
and guardrails, flipped examples, environments, plan vs actual, exports, limitations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.ledger import utc_now
from tunelab.plan.review import RESOLUTION_S, far_off_remark, repeat_verdict, review_plan
from tunelab.records import write_bytes_atomic
from tunelab.report.collect import collect
from tunelab.report.decision import decide, final_test, format_ci
from tunelab.report.document import Section, render_html, render_markdown
from tunelab.report.paths import path_section
from tunelab.report.plots import plot_grouped_bars, plot_loss_curves
from tunelab.study import Study


def _short(s: Any, n: int = 12) -> str:
    return str(s)[:n] if s else "-"


def _evaluation(run: dict[str, Any], split: str = "validation") -> dict[str, Any] | None:
    return run["evaluations"].get(split)


def _evaluated_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """run id -> its validation evaluation record; eval runs are attributed to their parent.
    Smoke runs are left out: they evaluate a handful of examples to test the pipeline."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        ev = _evaluation(r)
        if ev is None or r["row"]["kind"] == "smoke":
            continue
        target = (
            r["row"]["parent"]
            if r["row"]["kind"] == "eval" and r["row"]["parent"]
            else r["row"]["id"]
        )
        out[target] = ev
    return out


def _label(runs_by_id: dict[str, dict[str, Any]], run_id: str) -> str:
    r = runs_by_id.get(run_id)
    if r is None:
        return run_id
    return r["row"]["name"] or r["row"]["id"]


def _decision(data: dict[str, Any]) -> list[str]:
    if not data["compares"]:
        return ["No comparison has been recorded yet: no decision. Run `tunelab compare`."]
    latest = data["compares"][-1]
    lines = [
        decide(latest),
        f"From comparison {latest.get('id')} on the {latest.get('split')} split "
        f"(hypothesis v{latest.get('hypothesis_version')}).",
    ]
    test = final_test(latest, data["runs"], data["test_openings"])
    return lines + ([test] if test else [])


def _plan_row(ph: dict[str, Any], review: dict[str, dict[str, Any]]) -> list[Any]:
    """A plan phase against the review row of the same phase (planned, margin, actual)."""
    r = review.get(ph.get("phase"), {})
    within = ""
    if r.get("within_margin") is not None:
        within = ("yes" if r["within_margin"] else "no") + (
            f" (under {RESOLUTION_S:g} s)" if r.get("below_resolution") else ""
        )
        if r.get("far_off"):
            within += ", but far off"

    def seconds(x: float | None) -> str | None:
        return None if x is None else f"{x:.1f}"

    def pct(x: float | None) -> str | None:
        return None if x is None else f"{x:+.1f}"

    return [
        ph.get("phase") or ph.get("name"),
        seconds(r.get("planned_s", ph.get("total_s"))),
        ph.get("margin_pct"),
        seconds(r.get("actual_s")),
        pct(r.get("error_pct")),
        pct(r.get("error_at_run_speed_pct")),
        within,
    ]


def build_sections(study: Study, data: dict[str, Any], plot_dir: Path) -> list[Section]:
    sections: list[Section] = []
    runs = data["runs"]
    runs_by_id = {r["row"]["id"]: r for r in runs}

    # ---- decision
    sec = Section("Decision")
    for line in _decision(data):
        sec.text(line)
    sections.append(sec)

    # ---- hypothesis
    sec = Section("Hypothesis and guardrails")
    if not data["hypotheses"]:
        sec.text("No hypothesis registered.")
    for h in data["hypotheses"]:
        c = h["content"]
        sec.text(
            f"Version {h['version']} registered {h['registered_at']} (sha256 {_short(h['sha256'])})."
        )
        hyp = c["hypothesis"]
        sec.table(["field", "value"], [[k, v] for k, v in hyp.items()])
        sec.table(
            ["metric", "scope", "op", "value", "relative to"],
            [
                [g["metric"], g["scope"], g["op"], g["value"], g.get("relative_to") or "absolute"]
                for g in c["guardrails"]
            ],
            caption="guardrails",
        )
        if h.get("diff"):
            sec.table(
                ["field", "was", "now"],
                [[d["path"], d["old"], d["new"]] for d in h["diff"]],
                caption=f"amendment of version {h['version'] - 1}",
            )
    sections.append(sec)

    # ---- data
    sec = Section("Data")
    if not data["data"]:
        sec.text("No data snapshot recorded.")
    for m in data["data"][-1:]:
        sec.text(f"Snapshot {m.get('snapshot_id')} created {m.get('created_at')}.")
        counts = m.get("counts") or {}
        per = counts.get("per_category") or {}
        if per:
            cats = sorted({c for split in per.values() for c in split})
            sec.table(
                ["split", *cats, "total"],
                [[s, *[per[s].get(c, 0) for c in cats], sum(per[s].values())] for s in per],
                caption="examples per split and category",
            )
        dup = m.get("duplicates") or {}
        sec.text(
            f"{counts.get('rows_read')} rows read, {counts.get('dropped_by_cleaning')} dropped by cleaning, "
            f"{counts.get('sampled_out', 0)} sampled out, {counts.get('removed_as_duplicates')} removed as "
            f"duplicates (policy {(m.get('dedup') or {}).get('policy')})."
        )
        if dup:
            sec.table(
                ["what", "value"],
                [[k, v] for k, v in dup.items() if not isinstance(v, list | dict)],
                caption="duplicates",
            )
    sections.append(sec)

    # ---- inspection
    sec = Section("Inspection of preprocessing")
    if not data["inspections"]:
        sec.text("No inspection recorded.")
    for ins in data["inspections"][-1:]:
        sec.text(
            f"Inspection {ins.get('inspect_id')} of the {ins.get('split')} split ({ins.get('n')} examples, "
            f"template sha256 {_short(ins.get('template_sha256'))}): "
            + (
                "every check passed."
                if ins.get("ok")
                else f"{len(ins.get('problems') or [])} problem(s) found."
            )
        )
        cats = {"all": ins.get("stats") or {}, **(ins.get("category_stats") or {})}
        sec.table(
            ["category", "n", "p50 tokens", "p95", "max", "truncated share", "target truncated"],
            [
                [
                    c,
                    st.get("n"),
                    st.get("p50"),
                    st.get("p95"),
                    st.get("max"),
                    st.get("share_truncated"),
                    st.get("target_truncated"),
                ]
                for c, st in cats.items()
            ],
        )
    sections.append(sec)

    # ---- baseline and results
    evaluated = _evaluated_runs(runs)
    baselines = [r for r in runs if r["row"]["kind"] == "baseline" and r["row"]["id"] in evaluated]
    sec = Section("Baseline and variants on the validation split")
    metric_names: list[str] = []
    for ev in evaluated.values():
        for k, v in (ev.get("metrics") or {}).items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and k not in metric_names
                and k != "n"
            ):
                metric_names.append(k)
    if evaluated:
        order = [r["row"]["id"] for r in baselines] + [
            i for i in evaluated if i not in {b["row"]["id"] for b in baselines}
        ]
        sec.table(
            ["run", "kind", "n", *metric_names],
            [
                [
                    _label(runs_by_id, i),
                    runs_by_id.get(i, {"row": {"kind": "?"}})["row"]["kind"],
                    evaluated[i].get("n"),
                    *[(evaluated[i].get("metrics") or {}).get(k) for k in metric_names],
                ]
                for i in order
            ],
        )
        for key, title in (("per_category", "F1 per category"), ("per_field", "per field")):
            groups: list[str] = []
            for i in order:
                for g in (evaluated[i].get("metrics") or {}).get(key) or {}:
                    if g not in groups:
                        groups.append(g)
            if not groups:
                continue
            stat = "f1" if key == "per_category" else None
            series: dict[str, list[float | None]] = {}
            rows = []
            for i in order:
                per = (evaluated[i].get("metrics") or {}).get(key) or {}
                if stat is None:
                    first = next(iter(per.values()), {})
                    stat = next(
                        (
                            s
                            for s in ("exact_match", "normalized_match", "presence_rate")
                            if s in first
                        ),
                        None,
                    )
                values = [(per.get(g) or {}).get(stat) if stat else None for g in groups]
                series[_label(runs_by_id, i)] = values
                rows.append([_label(runs_by_id, i), *values])
            sec.table(["run", *groups], rows, caption=f"{stat} {title}")
            img = plot_grouped_bars(
                groups, series, f"{stat} {title}", stat or "", plot_dir / f"{key}.png"
            )
            sec.image(img, f"{stat} {title}")
    else:
        sec.text("No evaluation recorded yet (`tunelab baseline`, `tunelab eval RUN`).")
    sections.append(sec)
    if evaluated:
        by_path = path_section([(_label(runs_by_id, i), evaluated[i]) for i in order], plot_dir)
        sections += [by_path] if by_path else []

    # ---- sizing
    sec = Section("Sizing of a training step")
    if not data["sizing"]:
        sec.text("No sizing recorded.")
    for s in data["sizing"][-1:]:
        rows = []
        for c in s.get("configurations", s.get("rows", [])):
            rows.append(
                [
                    c.get("label") or c.get("name") or c.get("options"),
                    c.get("seq_len"),
                    c.get("micro_batch"),
                    c.get("predicted_mb") or (c.get("predicted") or {}).get("total_mb"),
                    c.get("measured_mb") or (c.get("measured") or {}).get("peak_mb"),
                    c.get("error_pct"),
                    c.get("step_s") or (c.get("measured") or {}).get("step_s"),
                    c.get("status", ""),
                ]
            )
        sec.table(
            [
                "configuration",
                "seq len",
                "micro-batch",
                "predicted MB",
                "measured MB",
                "error %",
                "step s",
                "status",
            ],
            rows,
        )
        rec = s.get("recommendation")
        if rec:
            sec.table(
                ["recommendation", "value"],
                [[k, v] for k, v in rec.items() if not isinstance(v, dict | list)],
            )
    sections.append(sec)

    # ---- runs
    sec = Section("Every run, failed ones included")
    sec.table(
        [
            "id",
            "kind",
            "name",
            "parent",
            "status",
            "reason",
            "why",
            "config sha",
            "created",
            "finished",
        ],
        [
            [
                r["row"]["id"],
                r["row"]["kind"],
                r["row"]["name"],
                r["row"]["parent"],
                r["row"]["status"],
                r["row"]["reason"],
                r["row"]["why"],
                _short(r["row"]["config_sha"]),
                r["row"]["created_at"],
                r["row"]["finished_at"],
            ]
            for r in runs
        ],
    )
    train_runs = [r for r in runs if r["row"]["kind"] == "train"]
    sec.image(plot_loss_curves(train_runs, plot_dir / "loss_curves.png"), "loss curves")
    sections.append(sec)

    # ---- comparisons
    sec = Section("Comparisons and guardrails")
    if not data["compares"]:
        sec.text("No comparison recorded.")
    for cmp in data["compares"][-1:]:
        base = cmp.get("baseline") or {}
        sec.text(
            f"Baseline {base.get('run_id')} ({base.get('n')} examples); paired bootstrap "
            f"{(cmp.get('bootstrap') or {}).get('samples')} samples, 95 % intervals."
        )
        for w in cmp.get("warnings") or []:
            sec.text(f"warning: {w}")
        for v in cmp.get("runs", []):
            name = v.get("name") or v.get("run_id")
            if not v.get("compared"):
                sec.text(
                    f"{name} ({v.get('run_id')}): not compared - {v.get('not_compared_reason') or v.get('reason') or v.get('status')}"
                )
                continue
            rows = [
                [k, d.get("baseline"), d.get("variant"), d.get("delta"), format_ci(d)]
                for k, d in (v.get("metrics") or {}).items()
                if isinstance(d, dict)
            ]
            sec.table(
                ["metric", "baseline", "variant", "delta", "95% CI"],
                rows,
                caption=f"{name} ({v.get('run_id')}) against the baseline",
            )
            for key, label in (("per_category", "category"), ("per_field", "field")):
                per = v.get(key) or {}
                if per:
                    stat = "f1" if key == "per_category" else "exact_match"
                    sec.table(
                        [label, f"baseline {stat}", f"variant {stat}", "delta", "95% CI"],
                        [
                            [
                                item,
                                (m.get(stat) or {}).get("baseline"),
                                (m.get(stat) or {}).get("variant"),
                                (m.get(stat) or {}).get("delta"),
                                format_ci(m.get(stat) or {}),
                            ]
                            for item, m in per.items()
                        ],
                        caption=f"{name}: {stat} per {label}",
                    )
            mc = v.get("mcnemar") or {}
            if mc:
                sec.text(
                    f"{name}: McNemar ({mc.get('method', '')}) p = {mc.get('p_value')}, "
                    f"{mc.get('b', mc.get('improved', '-'))}/{mc.get('c', mc.get('regressed', '-'))} discordant."
                )
            guards = v.get("guardrails") or []
            if guards:
                sec.table(
                    ["rule", "item", "value", "bound", "verdict"],
                    [
                        [
                            g.get("rule"),
                            g.get("item") or "overall",
                            g.get("value"),
                            g.get("bound"),
                            "pass" if g.get("pass") else "fail",
                        ]
                        for g in guards
                    ],
                    caption=f"{name} guardrails",
                )
            fl = v.get("flips") or {}
            if fl:
                sec.table(
                    ["direction", "count", "example ids (first 10)"],
                    [
                        [k, len(fl.get(k) or []), ", ".join(map(str, (fl.get(k) or [])[:10]))]
                        for k in ("improved", "regressed")
                    ],
                    caption=f"{name} flipped examples",
                )
            diff = (v.get("config_diff") or {}).get("changes") or []
            if diff:
                sec.table(
                    ["group", "field", "parent", "variant"],
                    [[c.get("group"), c.get("path"), c.get("old"), c.get("new")] for c in diff],
                    caption=f"{name}: config against {(v.get('config_diff') or {}).get('against')}",
                )
            for flag in v.get("flags") or []:
                sec.text(f"warning ({name}): {flag}")
    sections.append(sec)

    # ---- environments
    sec = Section("Environments")
    envs = {}
    for r in runs:
        e = r.get("env")
        if e:
            key = (
                e.get("torch"),
                e.get("backend"),
                e.get("cuda"),
                e.get("rocm"),
                ", ".join(g.get("name", "") for g in e.get("gpus", []))
                or (e.get("cpu") or {}).get("name"),
            )
            envs.setdefault(key, []).append(r["row"]["id"])
    sec.table(
        ["torch", "backend", "cuda", "rocm", "device", "runs"],
        [[*k, len(v)] for k, v in envs.items()],
    )
    sections.append(sec)

    # ---- plan
    sec = Section("Rental plan and actual durations")
    if not data["plans"]:
        sec.text("No plan recorded.")
    for p in data["plans"][-1:]:
        cost = p.get("cost") or {}
        sec.text(
            f"{p.get('days')} days on {p.get('device') or p.get('gpu')} at "
            f"{p.get('gpu_hour_price')}/h: "
            f"{p.get('variants_that_fit')} variants would fit, the study registers "
            f"{p.get('num_variants')}; busy "
            f"{cost.get('busy_hours', 0):.2f} h (cost {cost.get('busy_cost', 0):.2f}), rental "
            f"{cost.get('rental_cost', 0):.2f}."
        )
        # against the ledger as it is now: a plan made after the initial check has no actual
        # experiments in the review it stored
        review = {r.get("phase"): r for r in review_plan(study, p)["rows"]}
        sec.table(
            [
                "phase",
                "planned s",
                "margin %",
                "actual s",
                "error %",
                "error % at the runs' speed",
                "within margin",
            ],
            [_plan_row(ph, review) for ph in p.get("phases") or [] if isinstance(ph, dict)],
        )
        for r in review.values():
            if (verdict := repeat_verdict(r)) is not None:
                sec.text(verdict[0].upper() + verdict[1:] + ".")
            if (remark := far_off_remark(r)) is not None:
                sec.text("Far off: " + remark + ".")
        if p.get("gantt_png"):
            sec.image(Path(p["gantt_png"]), "rental plan")
        for w in p.get("warnings") or []:
            sec.text(f"warning: {w}")
    sections.append(sec)

    # ---- exports
    sec = Section("Exports")
    if not data["exports"]:
        sec.text("No export recorded.")
    for ex in data["exports"]:
        base = ex.get("base") or {}
        sec.text(
            f"{ex.get('_path')}: run {ex.get('run_id')}, base {base.get('name')} "
            f"(identity sha256 {_short(base.get('sha256'))})."
        )
    sections.append(sec)

    # ---- limitations
    sec = Section("Limitations")
    openings = data["test_openings"]
    sec.text(
        f"The sealed test split was opened {len(openings)} time(s)."
        + (
            " More than once: test results are no longer an untouched control."
            if len(openings) > 1
            else ""
        )
    )
    if openings:
        sec.table(
            ["at", "who", "why", "run"],
            [[o["at"], o["who"], o["why"], o["run_id"]] for o in openings],
        )
    # answers the generation budget cuts: every model is scored wrong on them
    over: dict[str, tuple[int, int, Any]] = {}
    for r in runs:
        for split, ev in r["evaluations"].items():
            count = (ev.get("generation") or {}).get("answers_over_budget")
            if count:
                over[split] = (count, ev["n"], (ev.get("evaluation") or {}).get("max_new_tokens"))
    for split, (count, n, budget) in sorted(over.items()):
        # the test split is sealed: inspect does not open it
        names = f" (`tunelab inspect --split {split}` names them)" if split != "test" else ""
        sec.text(
            f"{count} of the {n} evaluated {split} answers are longer than "
            f"evaluation.max_new_tokens ({budget}): generation stops before their end, so no "
            f"model can be judged right on them{names}."
        )
    failed = [r for r in runs if r["row"]["status"] in ("failed", "invalid", "interrupted")]
    if failed:
        sec.text(
            f"{len(failed)} run(s) did not complete; they are listed above with their reasons."
        )
    for ex in data["exports"]:
        for lim in ex.get("limitations") or []:
            sec.text(str(lim))
    sections.append(sec)
    return sections


def build_report(study: Study) -> dict[str, Path]:
    """Write report/dossier.md, report/dossier.html and the plots; returns their paths."""
    data = collect(study)
    out_dir = study.root / "report"
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    sections = build_sections(study, data, plot_dir)
    title = f"tunelab dossier: {data['study']}"
    stamp = f"Built {utc_now()} from the records in {study.records}."
    sections[0].blocks.insert(0, stamp)
    md = render_markdown(title, sections, out_dir)
    page = render_html(title, sections)
    md_path = write_bytes_atomic(out_dir / "dossier.md", md.encode("utf-8"), overwrite=True)
    html_path = write_bytes_atomic(out_dir / "dossier.html", page.encode("utf-8"), overwrite=True)
    return {"markdown": md_path, "html": html_path, "plots": plot_dir}
