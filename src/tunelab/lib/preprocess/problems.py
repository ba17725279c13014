"""The stop conditions of preprocessing: a broken example (`Problem`), the fix of each kind,
and the one error that names them all (`raise_problems`). Text (`tunelab.lib.preprocess.text`) and
images (`tunelab.lib.preprocess.images`) report through them; `tunelab.lib.preprocess.text` re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tunelab.core.errors import PreprocessError

__all__ = ["FIXES", "Problem", "raise_problems"]


@dataclass(frozen=True)
class Problem:
    """One broken example: what is wrong (`kind`, `message`) and how to fix it."""

    example_id: str
    kind: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# Problem kinds, each with its fix. The stop conditions of `tunelab inspect` and of training.
FIXES = {
    "no_loss_positions": "the example has no target tokens to learn from: give it a non-empty "
    "target, or raise preprocess.max_seq_len",
    "target_truncated": "raise preprocess.max_seq_len (to at least {needed}), or shorten the "
    "prompt template / instruction; set preprocess.allow_target_truncation: true only if a cut "
    "answer is acceptable",
    "eos_missing": "the last loss position must be the EOS token so the model learns to stop: "
    "encode with tunelab.lib.preprocess.text.Preprocessor (it appends EOS to the target)",
    "eos_masked_by_pad": "the pad token equals EOS and the labels were masked by token value, "
    "which removed the EOS loss: build labels from positions (Preprocessor.encode does), or "
    "give the tokenizer a pad token different from EOS",
    "loss_span_mismatch": "the tokens under the loss do not decode to the target: the mask is "
    "shifted or covers the prompt; build labels with Preprocessor.encode, and check the "
    "template separators in `tunelab inspect`",
    "no_label": "the example has no valid label index: check task.labels and the data's label "
    "column, then rebuild the snapshot with `tunelab data`",
    "too_long": "the sequence is longer than preprocess.max_seq_len: encode with "
    "Preprocessor.encode, which truncates the input",
}


def _problem(example_id: Any, kind: str, message: str, **fmt: Any) -> Problem:
    return Problem(str(example_id), kind, message, FIXES[kind].format(**fmt))


def raise_problems(problems: Sequence[Problem], what: str = "preprocessing check") -> None:
    """Raise one PreprocessError naming every broken example (the first 10) and the fixes."""
    if not problems:
        return
    # no square brackets: the CLI prints messages with rich markup
    shown = [f"  - example {p.example_id!r} ({p.kind}): {p.message}" for p in problems[:10]]
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    fixes = []
    for p in problems:
        if p.fix not in fixes:
            fixes.append(p.fix)
    raise PreprocessError(
        f"{len(problems)} example(s) fail the {what}:\n" + "\n".join(shown) + more,
        hint="; ".join(fixes[:3]) + " (see `tunelab inspect`)",
    )
