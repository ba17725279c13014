"""The interface every task kind implements: render an example, parse an output, name metrics.

An example is a plain dict `{"id", "text", "label", "target"}` (see tunelab.stages.data). A task turns
it into the text the model reads (`input_text`) and the text it must produce (`target_text`),
and turns a raw model output back into a prediction (`parse`). Preprocessing (templates,
tokens, loss mask) lives in tunelab.lib.preprocess.text; metrics are computed by tunelab.stages.evaluate.stage from
the names in `metric_names`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from tunelab.core.errors import DataError


class Task(ABC):
    """One task kind. Subclasses set `kind` and `metric_names` and implement the methods."""

    kind: str = ""
    metric_names: tuple[str, ...] = ()

    def __init__(self, labels: list[str] | None, instruction: str):
        self.labels = labels
        self._instruction = instruction

    @property
    def instruction(self) -> str:
        """The instruction put before the input in causal-LM prompts."""
        return self._instruction

    def input_text(self, example: dict[str, Any]) -> str:
        text = example.get("text")
        if not isinstance(text, str):
            raise DataError(
                f"example {example.get('id')!r}: field 'text' is {type(text).__name__}, "
                "expected a string",
                hint="check data.fields.text in study.yaml and rebuild the snapshot "
                "with `tunelab data`",
            )
        return text

    @abstractmethod
    def target_text(self, example: dict[str, Any]) -> str:
        """The exact text the model must produce for this example (EOS not included)."""

    def render(self, example: dict[str, Any]) -> tuple[str, str]:
        """(input_text, target_text) of one example."""
        return self.input_text(example), self.target_text(example)

    @abstractmethod
    def parse(self, raw_output: str) -> dict[str, Any]:
        """A raw model output -> the prediction: `valid`, `failure` (None or a kind), `value`."""

    @abstractmethod
    def verdicts(self, parsed: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
        """Per-example verdicts of a parsed prediction against the example's gold answer."""

    def categories(self, rows: Sequence[dict[str, Any]]) -> list[str] | None:
        """Inspect's category of each row when the task defines one (None: inspect decides)."""
        return None

    def target_problems(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        """Targets the task can never judge right: {example_id, kind, message, fix} each."""
        return []

    def describe(self) -> dict[str, Any]:
        """What the task is, for records: kind, labels, instruction, metrics."""
        return {
            "kind": self.kind,
            "labels": self.labels,
            "instruction": self.instruction,
            "metric_names": list(self.metric_names),
        }


def failure(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    """A parse result for an output that failed (`kind` names how, `error` says why)."""
    return {"valid": False, "failure": kind, "error": message, "value": None, **extra}
