"""The rental plan: figures from records, the pure estimate, GPU catalog and projection, the
review against the ledger and the Gantt chart (the probes the stages run for it live in
`tunelab.lib.probes`).

- `figures`: the measured inputs, typed, each with its source (`gather_figures`)
- `estimate`: `build_plan(figures, cfg, days=...) -> Plan`, pure
- `review`: `review_plan(study, plan)`, planned against actual from the ledger (`plan_review`:
  the same as `core.record_plan.PlanReview`)
- `chart`: `draw_gantt(plan, path)`
- `stage`: `run(study, ...)`, what `tunelab plan` runs; `stored`: `plans_in_order` (the latest: `core.evidence.latest(study, "plan")`)

Names load on first use (PEP 562), so importing the package stays cheap.

`records/plans/<plan-id>.json` + `.png`: `created_ns` (nanoseconds since the epoch; "latest" is
the largest), `phases: [{phase, name, start_s, planned_s, margin_s, margin_pct, total_s,
planned_h, actual_h}]`, `variant`, `num_variants`, `variants_that_fit`, `fits`, `cost
{busy_hours, busy_cost, rental_hours, rental_cost}`, `device` (what the durations are for, as
the title names it), `warnings`, `figures {name: {value, source}}`, `chart`, `gantt_png`,
`review {rows, max_error_pct}` (the ledger's actual durations at planning time), and for a GPU
plan `projection {gpu, gpu_name, gpus, strategy, precision, fit {fits, micro_batch, grad_accum,
checkpointing, peak_bytes, budget_bytes, reason}, step {value, low, high, bound, flops, tokens,
optimizer_s, communication_s}, utilization {low, value, high, source}, utilization_measured,
eval_s_per_example, forward_s, inputs [{name, value, source, kind}], notes,
price_per_gpu_hour, price_source}`. Read back typed: `core.record_plan.PlanSchedule` and its
pieces (`PlanProjection`, `ProjectionFit`, ...).
"""

from __future__ import annotations

from tunelab.core.lazy import lazy_names

_HOMES = {
    "Figure": "figures",
    "Figures": "figures",
    "gather_figures": "figures",
    "run_seconds": "figures",
    "expected_max": "figures",
    "Plan": "estimate",
    "build_plan": "estimate",
    "MARGINS": "estimate",
    "PHASES": "estimate",
    "RESOLUTION_S": "review",
    "repeat_spread": "review",
    "repeat_verdict": "review",
    "review_plan": "review",
    "plan_review": "review",
    "draw_gantt": "chart",
    "plans_in_order": "stored",
    "plans_dir": "stored",
}

__getattr__ = lazy_names(__name__, globals(), _HOMES)


__all__ = sorted(_HOMES)
