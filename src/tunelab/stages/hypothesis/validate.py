"""`tunelab validate`: everything that can be checked of a study before anything runs.

`validate_study(dir, overrides) -> StudyConfig` loads the config and gathers, into one
ConfigError that lists every problem, the checks each part of tunelab owns: the config's
contradictions (core.config), the task's (lib.tasks), the metrics' (lib.metrics), QLoRA's
(lib.models.quantize), the optimizer's (stages.train.loop), the hub cache's pins
(stages.hypothesis.pins), the image size the model takes (lib.preprocess.images) and the data source's columns without reading it
(stages.data.readers). It lives in a stage, not in core, because it gathers checks from the
layers above core.
"""

from __future__ import annotations

from pathlib import Path

from tunelab.core.config import (
    StudyConfig,
    contradictions,
    load_config,
    resolve_path,
    sourced_problems,
)
from tunelab.core.errors import ConfigError
from tunelab.lib.metrics import study_metric_problems


def validate_study(study_dir: Path, overrides: list[str] | None = None) -> StudyConfig:
    """`tunelab validate`: the config, its contradictions (`config.contradictions`), then what
    can be checked of the data it names without reading it (the source exists; each mapped
    field is a column of its first file). Raises one ConfigError listing every problem."""
    from tunelab.stages.data.readers import source_problems

    path = Path(study_dir) / "study.yaml"
    cfg = load_config(path, overrides)
    from tunelab.lib.models.quantize import qlora_problems
    from tunelab.lib.tasks import task_problems
    from tunelab.stages.hypothesis.pins import cache_problems
    from tunelab.stages.train.loop import optimizer_problems

    problems = (
        contradictions(cfg)
        + task_problems(cfg.task)
        + study_metric_problems(cfg)
        + qlora_problems(cfg)
        + optimizer_problems(cfg.training)
        + cache_problems(cfg)
    )
    from tunelab.lib.preprocess.images import study_input_size_problems

    problems += study_input_size_problems(cfg, Path(study_dir))
    if cfg.data.source.format != "hub":  # a hub data set is checked when register fetches it
        problems += source_problems(resolve_path(cfg.data.source.path, Path(study_dir)), cfg.data)
    if problems:
        where, lines, what = sourced_problems(problems, str(path), overrides or [])
        raise ConfigError(
            f"{where}: {len(problems)} problem(s):\n" + "\n".join(lines),
            hint=f"change {what}, then run `tunelab validate` again",
        )
    return cfg
