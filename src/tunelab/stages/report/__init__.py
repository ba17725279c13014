"""The dossier: built only from the study's records."""

from tunelab.stages.report.build import build_report

__all__ = ["build_report"]
