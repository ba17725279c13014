"""Hand-offs to the engines renters launch with: a SkyPilot task file and a Slurm batch script,
built from the study and its plan, each running one idempotent command on every node.

- `spec`: `hand_off(study, engine, options) -> HandOff` (GPUs, nodes, time limit, torch build)
- `command`: `train_line`, the `tunelab train --name NAME --resume-if-exists` every node runs
- `skypilot`: `render(h)`, the task YAML; `slurm`: `render(h)`, the sbatch script
- `stage`: `run(study, engine, options, out)`, what `tunelab launch` calls
"""

from __future__ import annotations

from tunelab.core.lazy import lazy_names

_HOMES = {
    "HandOff": "spec",
    "LaunchOptions": "spec",
    "hand_off": "spec",
    "Written": "stage",
    "run": "stage",
}

__getattr__ = lazy_names(__name__, globals(), _HOMES)


__all__ = sorted(_HOMES)
