"""The `tracking` extra (mlflow, tensorboard): imported only when a mirror is used.

Without the extra, `TrackingError` (a TunelabError, exit 2) with the hint
`pip install 'tunelab[tracking]'`; `TrackingWarning` (RuntimeWarning) for a live backend that
stopped.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from tunelab.core.errors import TunelabError

INSTALL_HINT = "install the tracking extra: pip install 'tunelab[tracking]'"


class TrackingError(TunelabError):
    """A tracker cannot be reached or used as asked (no URI, server down, extra missing)."""


class TrackingWarning(RuntimeWarning):
    """A live tracking backend stopped; training goes on without it."""


def import_optional(module: str, what: str) -> ModuleType:
    """Import `module` of the tracking extra; raises TrackingError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackingError(
            f"{what} needs {module.split('.')[0]}, which is not installed ({exc})",
            hint=INSTALL_HINT,
        ) from None


def mlflow_client_class() -> Any:
    return import_optional("mlflow.tracking", "mirroring to MLflow").MlflowClient


def summary_writer_class() -> Any:
    import_optional("tensorboard", "writing TensorBoard event files")
    return import_optional(
        "torch.utils.tensorboard", "writing TensorBoard event files"
    ).SummaryWriter
