"""The dossier's section on the environments the runs ran in (one row per distinct one)."""

from __future__ import annotations

from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.context import Dossier


def environments_section(d: Dossier) -> Section:
    sec = Section("Environments")
    envs: dict[tuple, list[str]] = {}
    for r in d.runs:
        if (e := r.env) is not None and e.raw:
            key = (e.torch, e.backend, e.cuda, e.rocm, e.device_text)
            envs.setdefault(key, []).append(r.row.id)
    return sec.table(
        ["torch", "backend", "cuda", "rocm", "device", "runs"],
        [[*k, len(v)] for k, v in envs.items()],
    )
