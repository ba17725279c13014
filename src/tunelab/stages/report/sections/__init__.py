"""The dossier's sections, one builder each, in the order the dossier shows them.

Each builder takes the `Dossier` (the study's collected records) and returns its section, or None
when the section does not apply to the study.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tunelab.core.study import Study
from tunelab.stages.report.collect import Collected
from tunelab.stages.report.document import Section
from tunelab.stages.report.sections.comparisons import comparisons_section
from tunelab.stages.report.sections.context import Dossier
from tunelab.stages.report.sections.data import data_section
from tunelab.stages.report.sections.decision import decision_section
from tunelab.stages.report.sections.environments import environments_section
from tunelab.stages.report.sections.exports import exports_section
from tunelab.stages.report.sections.hypothesis import hypothesis_section
from tunelab.stages.report.sections.inspection import inspection_section
from tunelab.stages.report.sections.limitations import limitations_section
from tunelab.stages.report.sections.paths import path_section
from tunelab.stages.report.sections.plan import plan_section
from tunelab.stages.report.sections.platforms import platforms_section
from tunelab.stages.report.sections.results import results_section
from tunelab.stages.report.sections.runs import runs_section
from tunelab.stages.report.sections.sizing import sizing_section


def _paths(d: Dossier) -> Section | None:
    if not d.evaluated:
        return None
    return path_section([(d.label(i), d.evaluated[i]) for i in d.order], d.plot_dir)


BUILDERS: tuple[Callable[[Dossier], Section | None], ...] = (
    decision_section,
    hypothesis_section,
    data_section,
    inspection_section,
    results_section,
    _paths,
    sizing_section,
    runs_section,
    comparisons_section,
    environments_section,
    platforms_section,
    plan_section,
    exports_section,
    limitations_section,
)


def build_sections(study: Study, data: Collected, plot_dir: Path) -> list[Section]:
    """Every section of the dossier from the collected records (`report.collect.collect`)."""
    d = Dossier(study, data, plot_dir)
    return [sec for build in BUILDERS if (sec := build(d)) is not None]
