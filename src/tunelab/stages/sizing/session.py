"""A configuration's model and training loop in the measuring child, built as training builds
them (`tunelab.stages.sizing.child_model.build_for`, `tunelab.stages.train.build.build_loop`)
over synthetic examples of exactly the asked length: what both the memory and the timed steps
run on (`tunelab.stages.sizing.measure`, `tunelab.stages.sizing.step_time`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.run_parts import TrainStep
from tunelab.stages.sizing.child_model import build_for, image_side, spec_of, synthetic_examples

# the measured steps' metrics rows are checked as lines of a run's metrics.jsonl
STEPS = Path("the measured steps' metrics")


@dataclass
class Steps:
    """The loop of the measurement and every step's metrics row so far (each read as a line
    of a run's metrics.jsonl)."""

    loop: Any
    device: Any
    state: Any = None
    metrics: list[TrainStep] = field(default_factory=list)

    def run_to(self, total_steps: int) -> None:
        from tunelab.stages.train.loop import TrainState, train_loop

        self.loop.total_steps = total_steps
        state = self.state or TrainState()
        self.state = train_loop(self.loop, state, [self._keep])

    def _keep(self, _state: Any, row: dict[str, Any]) -> None:
        self.metrics.append(TrainStep.of(STEPS, row, f"step {len(self.metrics) + 1}"))


def marker(phases: dict[str, float]) -> Callable[[str], None]:
    """`mark(name)`: the seconds since the previous mark (or the call) stored as `phases[name]`."""
    last = [time.perf_counter()]

    def mark(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(now - last[0], 3)
        last[0] = now

    return mark


@dataclass
class Session:
    """A configuration's model and training loop, built as training builds them."""

    model: Any
    loop: Any
    steps: Steps
    facts: Any
    arch: str
    training: Any
    load_s: float


def build_session(spec: dict[str, Any], device: Any) -> Session:
    from tunelab.stages.train.build import build_loop

    started = time.perf_counter()
    typed = spec_of(spec)
    cfg, base, model, facts = build_for(spec, device)
    t, arch = cfg.training, base.architecture
    per_step = t.micro_batch_size * t.grad_accum_steps

    def examples(count: int, length: int, seed: int) -> list[dict[str, Any]]:
        return synthetic_examples(
            count,
            length,
            arch,
            vocab=facts.vocab,
            num_labels=max(2, facts.num_labels),
            loss_fraction=float(1.0 if typed.loss_fraction is None else typed.loss_fraction),
            seed=seed,
            image_size=image_side(spec, base, facts) if arch == "image" else None,
        )

    if typed.lengths:  # the worst batch: one example of each length, one micro-batch
        encoded = [examples(1, int(n), t.seed + j)[0] for j, n in enumerate(typed.lengths)]
    else:
        encoded = examples(per_step, typed.seq_len, t.seed)
    # the schedule leaves room for every step the measurement may take
    warmup, measured, timed = typed.steps()
    total = warmup + measured + 1 + timed
    loop = build_loop(model, t, encoded, architecture=arch, pad_id=0, total_steps=total)
    load_s = time.perf_counter() - started
    return Session(model, loop, Steps(loop, device), facts, arch, t, load_s)
