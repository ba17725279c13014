"""The planner's probes: what the stages time so that a plan can price the work they repeat.

- `StepClock` and `generation_timing`: an evaluation's generation, batch by batch, prefill apart
  from the decoding steps, beside what a model emitting the gold answers would generate
  (evaluation records it; the plan prices a variant at its answers' length);
- `adapter_time_ratio`: how many times as long an evaluation takes with an unmerged adapter as
  without it (the smoke records it; the plan multiplies a variant's evaluation by it);
- `hash_rate`: how fast this machine hashes (the export checks the base model's files).

No stage is imported here: the stages hand their own evaluation and generation to the probes.

`StepClock`, `generation_timing` -> `{batches: [{n, prompt_tokens, steps, prefill_s, decode_s,
answer_steps}], steps, answer_steps, answers_over_budget, prefill_s, decode_s, s_per_step}`
(`steps`: tokens generated; `answer_steps`: what the gold answers with their EOS would take,
capped at `max_new_tokens`); `AdapterPass` + `adapter_time_ratio(model, timed_pass)`;
`hash_rate()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# decoding steps a generating task's adapter timing takes per pass: enough for a steady step
# time after the prefill, few enough for several interleaved pairs within the smoke
RATIO_DECODE_STEPS = 16


class StepClock:
    """A generation streamer that only keeps time: `generate` hands it the prompt, then each
    step's new tokens, once they are on the host (so a GPU step has finished)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())

    def split(self) -> dict[str, Any]:
        # times: [prompt, token 1, ..., token k, end]; the prefill forward yields token 1
        t = self.times
        steps = max(0, len(t) - 2)
        return {
            "steps": steps,
            "prefill_s": round(t[1] - t[0], 4) if steps else 0.0,
            "decode_s": round(t[-2] - t[1], 4) if steps else 0.0,
        }


def generation_timing(
    batches: list[dict[str, Any]], answer_tokens: Sequence[int], max_new_tokens: int
) -> dict[str, Any]:
    """An evaluation's generation, batch by batch, beside what a model emitting the gold answers
    would generate.

    A batch decodes until its longest output ends, so its cost follows its longest answer. The
    base model often rambles to `max_new_tokens`, while a trained variant stops after the answer
    it learned: `answer_steps`, the gold answers' longest (tokens and EOS) per batch, is what the
    planner prices a variant's evaluation from."""
    out = []
    for b in batches:
        answer = min(max_new_tokens, max(answer_tokens[i] for i in b["rows"]))
        out.append(
            {
                **{k: v for k, v in b.items() if k != "rows"},
                "n": len(b["rows"]),
                "answer_steps": answer,
            }
        )
    steps = sum(b["steps"] for b in out)
    decode_steps = sum(max(0, b["steps"] - 1) for b in out)
    decode_s = sum(b["decode_s"] for b in out)
    return {
        "batches": out,
        "steps": steps,
        "answer_steps": sum(b["answer_steps"] for b in out),
        "answers_over_budget": sum(1 for a in answer_tokens if a > max_new_tokens),
        "prefill_s": round(sum(b["prefill_s"] for b in out), 4),
        "decode_s": round(decode_s, 4),
        "s_per_step": round(decode_s / decode_steps, 5) if decode_steps else None,
    }


@dataclass
class AdapterPass:
    """One timed pass of a few examples through the model as it stands (adapter on or off).

    A generating task hands `decode(budget)`: the generation of one batch of its evaluation's
    prompts up to `budget` new tokens, returning `generate_outputs`' per-batch stats; the pass is
    timed per decoding step (`unit` "decoding step"). Any other task hands `evaluation_s()`:
    one evaluation of the examples, its seconds (`unit` "evaluation")."""

    model: Any
    evaluation_s: Callable[[], float] | None = None
    decode: Callable[[int], list[dict[str, Any]]] | None = None
    max_new_tokens: int = RATIO_DECODE_STEPS
    decode_steps: int | None = None  # the most decoding steps a pass took

    @property
    def unit(self) -> str:
        return "decoding step" if self.decode is not None else "evaluation"

    def __call__(self) -> float:
        if self.decode is None:
            assert self.evaluation_s is not None
            return self.evaluation_s()
        was_training = self.model.training
        self.model.eval()
        try:
            stats = self.decode(min(self.max_new_tokens, RATIO_DECODE_STEPS))
        finally:
            self.model.train(was_training)
        steps = sum(max(0, b["steps"] - 1) for b in stats)
        self.decode_steps = max(self.decode_steps or 0, steps)
        # outputs that all ended at their first token had no decoding step: time the prefill
        return sum(b["decode_s"] for b in stats) / steps if steps else stats[0]["prefill_s"]


def adapter_time_ratio(
    model: Any, timed: AdapterPass
) -> tuple[float | None, dict[str, Any] | None]:
    """How many times as long a pass takes with the unmerged adapter as without it: peft's
    adapter disabled, then enabled, in interleaved pairs (the model warm from its own
    evaluation). Returns (ratio, how it was timed); (None, None) for a model without an adapter
    (full, freeze).

    Not the adapter's share of the parameters: at a decoding step every adapted linear layer
    adds two small matmuls and their calls, and a merged adapter runs as fast as the base. A
    generating task is timed per decoding step, the figure the planner multiplies, which does
    not depend on how long either pass chose to generate; the fastest of several short passes
    on each side is the least disturbed by other work on the machine."""
    if not hasattr(model, "disable_adapter"):
        return None, None
    # pairs, off then on: at least 3, then until 2 s are spent (a classifier's few examples
    # take a tenth of a second: three pairs would be noise), at most 5
    offs: list[float] = []
    ons: list[float] = []
    started = time.perf_counter()
    while len(ons) < 3 or (len(ons) < 5 and time.perf_counter() - started < 2.0):
        with model.disable_adapter():
            offs.append(timed())
        ons.append(timed())
    ratio = round(min(ons) / min(offs), 3) if min(offs) > 0 else None
    how = {
        "unit": timed.unit,
        "pairs": len(ons),
        "off_s": round(min(offs), 7),
        "on_s": round(min(ons), 7),
        "decode_steps": timed.decode_steps,
    }
    return ratio, how


def hash_rate() -> float:
    """Bytes per second sha256 hashes on this machine now (16 MiB timed)."""
    from tunelab.core.hashing import sha256_bytes

    block = bytes(16 * 2**20)
    started = time.perf_counter()
    sha256_bytes(block)
    return len(block) / max(1e-9, time.perf_counter() - started)
