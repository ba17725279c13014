"""`tunelab validate`: everything that can be checked of a study before anything runs.

`validate_study(dir, overrides) -> StudyConfig` loads the config and gathers, into one
ConfigError that lists every problem, the checks each part of tunelab owns: the config's
contradictions (core.config), the task's (lib.tasks), the metrics' (lib.metrics), QLoRA's
(lib.models.quantize), the optimizer's (stages.train.loop), the hub cache's pins
(stages.hypothesis.pins), the image size the model takes (lib.preprocess.images) and the data source's columns without reading it
(stages.data.readers). It lives in a stage, not in core, because it gathers checks from the
layers above core.

`check_layout_load` refuses a `--nproc` / `--strategy` layout whose load cannot fit a GPU
(`validate --gpu ID` or `--memory-budget`; `train` on CUDA checks its own GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def check_layout_load(
    study_dir: Path,
    cfg: StudyConfig,
    *,
    strategy: str,
    nproc: int,
    nnodes: int = 1,
    gpu: str | None = None,
    device_bytes: int | None = None,
    where: str | None = None,
    evaluation: bool = True,
) -> None:
    """`validate --nproc N --strategy S` with `--gpu ID` (a catalog GPU) or `--memory-budget`
    (`device_bytes`), and `train` on CUDA: raise ConfigError when that layout cannot load the
    base (tunelab.stages.sizing.load), naming the load; with `evaluation` (validate), also when
    the study's evaluation cannot fit one of those GPUs."""
    from tunelab.stages.plan.catalog import find_gpu
    from tunelab.stages.plan.project import CUDA_CONTEXT_BYTES
    from tunelab.stages.plan.rental import layout_load_problem

    if gpu is not None:
        device_bytes = find_gpu(gpu).memory_bytes - CUDA_CONTEXT_BYTES
    if device_bytes is None:
        return
    if where is None:
        budget = f"GPUs of {device_bytes / 1e9:.1f} GB (--memory-budget)"
        where = f"--gpu {gpu}" if gpu else budget
    problem = layout_load_problem(
        cfg, Path(study_dir), strategy=strategy, nproc=nproc, nnodes=nnodes,
        device_bytes=device_bytes, evaluation=evaluation,
    )  # fmt: skip
    if problem is not None:
        hint = (
            "`tunelab plan --compare-gpus` lists the GPUs whose memory holds the evaluation"
            if problem.startswith("the evaluation")
            else "use more GPUs or --strategy fsdp (sharded loading), a GPU with more memory "
            "(`tunelab plan --compare-gpus` lists the layouts that load), or a smaller base"
        )
        raise ConfigError(f"--nproc {nproc} --strategy {strategy} on {where}: {problem}", hint=hint)


def check_train_load(study_dir: Path, cfg: StudyConfig, launch: Any) -> None:
    """`tunelab train` on CUDA (`launch`: its --nproc, --nnodes, --strategy): refuse before
    starting a layout that cannot load the base on this machine's GPU (ConfigError). Without
    CUDA, or for a base whose config.json the planner cannot read (a GGUF file, a family it
    does not model), nothing is checked: the load itself is the test."""
    import torch

    from tunelab.core.errors import StudyError

    if not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(0)
    device_bytes = props.total_memory - (1 << 30)  # the CUDA context
    try:
        check_layout_load(
            study_dir, cfg, strategy=launch.strategy, nproc=launch.nproc, nnodes=launch.nnodes,
            device_bytes=device_bytes, where=f"this machine's {props.name}", evaluation=False,
        )  # fmt: skip
    except StudyError:
        return
