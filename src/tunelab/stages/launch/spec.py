"""What a hand-off starts, read from the study and its latest plan: `HandOff`, pure of engines.

`hand_off(study, engine, options) -> HandOff` takes the GPU, GPUs a node and strategy from the
plan's projection (`tunelab plan --gpu ID --gpus N`), the time limit from its rental (days x
hours a day), the torch build from the study's records (the newest env.json that names a CUDA
or ROCm build, else the newest torch), and lets `LaunchOptions` override each of them.

Raises ConfigError (exit 2) naming the fix: no plan record, a plan without a GPU and none
given, a GPU the catalog or the engine does not know, fewer than one node, a strategy the
layout cannot run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tunelab.core.errors import ConfigError
from tunelab.core.evidence import latest
from tunelab.core.record_plan import PlanProjection
from tunelab.core.record_types import Plan
from tunelab.core.run_parts import RunEnv
from tunelab.core.study import Study

ENGINES = ("skypilot", "slurm")
SINGLE, STRATEGIES = "single", ("ddp", "fsdp")
DEFAULT_PORT = 29500
# SkyPilot's accelerator names (`sky show-gpus`) for the catalog's GPU ids
SKYPILOT_NAMES = {
    "B200": "B200",
    "H200": "H200",
    "H100-SXM": "H100",
    "H100-PCIe": "H100",
    "H100-NVL": "H100-NVL",
    "A100-80GB": "A100-80GB",
    "A100-40GB": "A100",
    "L40S": "L40S",
    "L4": "L4",
    "RTX-4090": "RTX4090",
    "MI300X": "MI300X",
    "MI325X": "MI325X",
    "A10": "A10",
}
PYTORCH_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class LaunchOptions:
    """What the command line sets; None keeps the plan's (or the study's) value."""

    name: str
    gpu: str | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    strategy: str | None = None
    cpu_ranks: int | None = None  # ranks a node on CPU (gloo) instead of GPUs
    time_limit_h: float | None = None
    port: int = DEFAULT_PORT
    disk_gb: int | None = None
    spot: bool = False
    bucket: str | None = None
    partition: str | None = None
    account: str | None = None
    install: str | None = None  # pip requirement for tunelab on the nodes
    why: str | None = None  # recorded when no smoke passed on the nodes' platform


@dataclass(frozen=True)
class TorchBuild:
    """The torch the study's runs used and how pip installs it on the nodes."""

    version: str  # without a local tag: "2.13.0"
    backend: str  # "cuda 12.8", "rocm 6.3" or "cpu"
    index_url: str | None  # None: PyPI's Linux wheel (built for CUDA)
    source: str  # the record it was read from

    def comment(self) -> str:
        if self.index_url:
            return f"# torch {self.version} ({self.backend}), as {self.source} records it"
        return (
            f"# torch {self.version} as {self.source} records it (a CPU build): PyPI's Linux "
            "wheel, built for CUDA"
        )

    def pip_line(self) -> str:
        line = f'pip install "torch=={self.version}"'
        return f"{line} --index-url {self.index_url}" if self.index_url else line


@dataclass(frozen=True)
class HandOff:
    """One job: what each engine's file asks for and the command every node runs."""

    engine: str
    name: str
    study_root: Path
    plan_id: str
    nodes: int
    nproc: int  # ranks a node
    gpus_per_node: int  # 0 on CPU
    gpu: str | None  # catalog id
    accelerator: str | None  # SkyPilot's name of it
    strategy: str
    time_limit_s: int
    disk_gb: int
    torch: TorchBuild
    install: str
    port: int = DEFAULT_PORT
    spot: bool = False
    bucket: str | None = None
    partition: str | None = None
    account: str | None = None
    why: str | None = None
    model_mount: Path | None = None  # a base folder outside the study, synced to the nodes
    warnings: list[str] = field(default_factory=list)

    @property
    def cpu(self) -> bool:
        return self.gpus_per_node == 0


def hand_off(study: Study, engine: str, options: LaunchOptions) -> HandOff:
    """The job `engine` runs for the study, from its latest plan and `options`."""
    if engine not in ENGINES:
        raise ConfigError(f"engine {engine!r}: unknown", hint=f"use one of: {', '.join(ENGINES)}")
    check_name(options.name)
    plan = latest_plan(study)
    projection = plan.part(PlanProjection, "projection") or PlanProjection(plan.path, {})
    nodes = options.nodes if options.nodes is not None else int(projection.nodes or 1)
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: a job needs at least one node", hint="--nodes 1")
    gpu, accelerator, gpus = _gpus(plan, projection, options)
    nproc = options.cpu_ranks if options.cpu_ranks is not None else gpus
    strategy = _strategy(options.strategy or projection.strategy, nodes * nproc)
    return HandOff(
        engine=engine,
        name=options.name,
        study_root=study.root,
        plan_id=plan.id,
        nodes=nodes,
        nproc=nproc,
        gpus_per_node=0 if options.cpu_ranks is not None else gpus,
        gpu=gpu,
        accelerator=accelerator,
        strategy=strategy,
        time_limit_s=_time_limit_s(plan, options.time_limit_h),
        disk_gb=options.disk_gb or disk_size_gb(study),
        torch=recorded_torch(study),
        install=options.install or _default_install(),
        port=options.port,
        spot=options.spot,
        bucket=options.bucket,
        partition=options.partition,
        account=options.account,
        why=options.why,
        model_mount=_model_outside(study),
        warnings=_warnings(engine, options),
    )


def check_name(name: str) -> None:
    # the name goes into job names, file names and shell lines unquoted
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name or ""):
        raise ConfigError(
            f"--name {name!r}: a run name for a job is 1-64 letters, digits, '.', '_' or '-'",
            hint="e.g. --name lora-r16; every start of the job finds its run by this name",
        )


def latest_plan(study: Study) -> Plan:
    found = latest(study, "plan")
    if found is None:
        raise ConfigError(
            f"{study.records / 'plans'}: no plan record: the job's GPUs, nodes and time limit "
            "come from the study's plan",
            hint=f"run `tunelab plan -s {study.root} --gpu H100-SXM --gpus 4` first",
        )
    return Plan.read(found.path)


def _gpus(
    plan: Plan, projection: PlanProjection, options: LaunchOptions
) -> tuple[str | None, str | None, int]:
    """(catalog id, SkyPilot name, GPUs a node); (None, None, 0) for CPU ranks."""
    from tunelab.stages.plan.catalog import find_gpu

    gpus = options.gpus_per_node or int(projection.gpus or 1)
    if gpus < 1:
        raise ConfigError(f"--gpus-per-node {gpus}: at least 1", hint="e.g. --gpus-per-node 4")
    if options.cpu_ranks is not None:
        if options.cpu_ranks < 1:
            raise ConfigError(f"--cpu-ranks {options.cpu_ranks}: at least 1", hint="--cpu-ranks 2")
        return None, None, 0
    wanted = options.gpu or projection.gpu
    if not wanted:
        raise ConfigError(
            f"{plan.path}: plan {plan.id} was made for this machine's device, not a GPU",
            hint=f"plan for the rental (`tunelab plan --gpu H100-SXM --gpus {gpus}`), or "
            "name it here: --gpu H100-SXM (or --cpu-ranks N for CPU nodes)",
        )
    gpu = find_gpu(wanted)
    accelerator = SKYPILOT_NAMES.get(gpu.id)
    if accelerator is None:
        raise ConfigError(
            f"GPU {gpu.id}: no SkyPilot accelerator name is known for it",
            hint=f"choose one of {', '.join(SKYPILOT_NAMES)}",
        )
    return gpu.id, accelerator, gpus


def _strategy(wanted: str | None, world_size: int) -> str:
    if world_size == 1:
        return SINGLE if wanted in (None, SINGLE) else wanted
    if wanted in (None, SINGLE):
        return "ddp"  # several ranks: a replica per rank unless the plan shards
    if wanted not in STRATEGIES:
        raise ConfigError(
            f"--strategy {wanted!r}: unknown", hint=f"use one of: {', '.join(STRATEGIES)}"
        )
    return wanted


def _time_limit_s(plan: Plan, hours: float | None) -> int:
    if hours is not None:
        if not (math.isfinite(hours) and hours > 0):
            raise ConfigError(f"--time-limit-h {hours:g}: a positive number", hint="e.g. 24")
        return max(60, int(round(hours * 3600)))
    days, per_day = plan.days, plan.hours_per_day
    if not days or not per_day:
        raise ConfigError(
            f"{plan.path}: the plan names no rental (days, hours_per_day)",
            hint="make a new plan with `tunelab plan`, or give --time-limit-h",
        )
    return int(round(float(days) * float(per_day) * 3600))


def recorded_torch(study: Study) -> TorchBuild:
    """The torch of the newest env.json under records/runs that names a GPU build, else of the
    newest one, else this process's."""
    envs = sorted(study.runs_dir.glob("*/env.json"), key=lambda p: p.stat().st_mtime_ns)
    found: tuple[RunEnv, str] | None = None
    for path in reversed(envs):
        env = RunEnv.read(path)
        if env.cuda or env.rocm:
            found = (env, str(path))
            break
        found = found or (env, str(path))
    if found is None:
        import torch

        here = {"torch": torch.__version__, "cuda": torch.version.cuda}
        found = (RunEnv.of("this environment", here), "this environment")
    env, source = found
    version = str(env.torch or "").split("+")[0]
    if env.cuda:
        tag = "cu" + str(env.cuda).replace(".", "")
        return TorchBuild(version, f"cuda {env.cuda}", f"{PYTORCH_INDEX}/{tag}", source)
    if env.rocm:
        tag = "rocm" + ".".join(str(env.rocm).split(".")[:2])
        return TorchBuild(version, f"rocm {env.rocm}", f"{PYTORCH_INDEX}/{tag}", source)
    return TorchBuild(version, "cpu", None, source)


def _default_install() -> str:
    import importlib.metadata

    try:
        return f"tunelab=={importlib.metadata.version('tunelab')}"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "tunelab"


def _model_outside(study: Study) -> Path | None:
    """The base model's local folder when it lies outside the study (the nodes need it too)."""
    path = study.config.model.path
    if not path or path.startswith("asset:"):
        return None
    folder = study.resolve(path)
    return None if folder.is_relative_to(study.root) else folder


def disk_size_gb(study: Study) -> int:
    """Disk a node needs: three times the base's files (the base, a cache, checkpoints) plus
    64 GB for the system and packages, at least SkyPilot's default of 256 GB."""
    folder = _model_outside(study) or (
        study.resolve(study.config.model.path) if study.config.model.path else None
    )
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder else 0
    return max(256, math.ceil(3 * size / 1e9) + 64)


def _warnings(engine: str, options: LaunchOptions) -> list[str]:
    if engine == "skypilot" and options.spot and not options.bucket:
        return [
            "--spot without --bucket: a recovered job starts on a fresh node, without the "
            "checkpoints the preempted one wrote, so it trains the run again from step 0; "
            "mount a bucket (--bucket s3://...) to resume it"
        ]
    return []
