"""The rental plan: figures from records, the pure estimate, GPU catalog and projection, the
review against the ledger and the Gantt chart (the probes the stages run for it live in
`tunelab.lib.probes`).

- `figures`: the measured inputs, typed, each with its source (`gather_figures`)
- `estimate`: `build_plan(figures, cfg, days=...) -> Plan`, pure
- `review`: `review_plan(study, plan)`, planned against actual from the ledger
- `chart`: `draw_gantt(plan, path)`
- `stage`: `make_plan(study, ...)`, what `tunelab plan` runs; `stored`: `plans_in_order` (the latest: `core.evidence.latest(study, "plan")`)

Names load on first use (PEP 562), so importing the package stays cheap.
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
    "draw_gantt": "chart",
    "make_plan": "stage",
    "plans_in_order": "stored",
    "plans_dir": "stored",
}

__getattr__ = lazy_names(__name__, globals(), _HOMES)


__all__ = sorted(_HOMES)
