"""An inspection of preprocessing read back typed: `Inspection` and the pieces nested in it.

records/inspect/<id>.json is written by `stages.inspect.stage.run` (its body by `inspect_rows`
for text, `stages.inspect.images.inspect_images` for images, `kind` "image"). Every piece is a
`Record` read at its place in the file (`where`, e.g. `examples[2].tokens[5]`), so a damaged
one raises the located `StudyError` (core/record_base).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunelab.core.record_base import Record

__all__ = [
    "AnswerBudget",
    "ChainStep",
    "ImageExample",
    "ImageOriginal",
    "ImageSpread",
    "InspectExample",
    "InspectPreprocess",
    "InspectProblem",
    "Inspection",
    "LengthStats",
    "Spread",
    "TensorSummary",
    "Thumbnails",
    "TokenView",
]

# a chain step's fields that are not its settings
_STEP_FACTS = ("step", "size", "mode", "train_only")


@dataclass(frozen=True)
class ChainStep(Record):
    """One step of an image transform chain: its name, the image's size and mode after it
    (when it changes them), and its settings (the other fields, as written)."""

    step: str = ""
    size: list[int] | None = None  # [width, height]
    mode: str | None = None
    train_only: bool | None = None

    @property
    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.raw.items() if k not in _STEP_FACTS}


@dataclass(frozen=True)
class InspectProblem(Record):
    """A stop condition: the example, what is wrong (`kind`, `message`) and how to fix it
    (lib.preprocess.problems.Problem)."""

    example_id: str = ""
    kind: str = ""
    message: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Spread(Record):
    """The smallest, median and largest of a figure over a category's images."""

    min: float = 0.0
    median: float = 0.0
    max: float = 0.0


@dataclass(frozen=True)
class Thumbnails(Record):
    """An image shown before and after the transforms, as PNG data URIs."""

    before: str = ""
    after: str = ""


@dataclass(frozen=True)
class LengthStats(Record):
    """Token counts of a split or a category (lib.preprocess.text.length_stats); an image
    split's are its size and tensor shape."""

    n: int | None = None
    p50: int | None = None
    p95: int | None = None
    max: int | None = None
    mean: float | None = None
    truncated: int | None = None
    share_truncated: float | None = None
    target_truncated: int | None = None
    shape: list[int] | None = None


@dataclass(frozen=True)
class InspectPreprocess(Record):
    """The preprocessing recipe inspected (lib.preprocess.text.Preprocessor.describe)."""

    architecture: str | None = None
    template: str | None = None
    max_seq_len: int | None = None
    truncation_side: str | None = None
    notes: list[str] | None = None
    steps: list[dict[str, Any]] | None = None  # an image chain's steps, with their settings

    @property
    def chain(self) -> list[ChainStep]:
        """An image chain's steps ([] for text)."""
        return self.parts(ChainStep, "steps")


@dataclass(frozen=True)
class AnswerBudget(Record):
    """The split's answers (target tokens and EOS) against `evaluation.max_new_tokens`."""

    max_new_tokens: int = 0
    n: int = 0
    over: int = 0
    over_ids: list[str] | None = None
    longest: int = 0
    p95: int | None = None

    @property
    def warning(self) -> str | None:
        """What `tunelab inspect` prints (and its page shows) when answers exceed the budget;
        None when they all fit."""
        if not self.over:
            return None
        return (
            f"{self.over} of {self.n} answers (tokens and EOS) are longer than "
            f"evaluation.max_new_tokens ({self.max_new_tokens}), the longest "
            f"{self.longest}: generation stops before their end, so they can never be judged "
            f"right. Set evaluation.max_new_tokens to at least {self.longest} (p95 "
            f"{self.p95}) and keep preprocess.max_seq_len above the prompt plus it."
        )


@dataclass(frozen=True)
class TokenView(Record):
    """One token of a shown example: its text, whether it is special, whether it carries loss."""

    id: int = 0
    text: str = ""
    special: bool = False
    loss: bool = False


@dataclass(frozen=True)
class InspectExample(Record):
    """One text example shown: its rendering, tokens, truncation and loss check."""

    id: str | int = ""
    category: str = ""
    why_shown: str | None = None  # category | longest | broken
    num_tokens: int | None = None
    target_text: str | None = None
    truncated: bool | None = None
    input_tokens: int | None = None
    input_tokens_cut: int | None = None
    truncation_at: int | None = None
    num_loss_tokens: int | None = None
    loss_decoded: str | None = None  # a generating model's loss tokens, decoded
    expected_loss_text: str | None = None  # the target and EOS, as the loss should decode
    label_index: int | None = None  # a classifier's label
    check: str | None = None  # ok, or the kinds of problems found
    problems: list[dict[str, Any]] | None = None  # lib.preprocess.problems.Problem, as dicts

    @property
    def classifier(self) -> bool:
        """Whether the loss is on a label (a classifier) rather than on tokens."""
        return "label_index" in self.raw

    @property
    def tokens(self) -> list[TokenView]:
        return self.parts(TokenView, "tokens")


@dataclass(frozen=True)
class TensorSummary(Record):
    """Shape, dtype and value range of an image's pixel tensor."""

    shape: list[int] | None = None
    dtype: str | None = None
    min: float = 0.0
    max: float = 0.0
    mean: float = 0.0


@dataclass(frozen=True)
class ImageOriginal(Record):
    """An image file as opened: its size, mode, format and EXIF orientation (if any)."""

    size: list[int] = field(default_factory=list)  # [width, height]
    mode: str | None = None
    format: str | None = None
    exif_orientation: int | None = None


@dataclass(frozen=True)
class ImageExample(Record):
    """One image shown: the original's facts, each step of the chain, the tensor."""

    id: str | int = ""
    category: str = ""
    source: str | None = None
    label_index: int | None = None
    steps: list[dict[str, Any]] | None = None  # {step, size?, mode?, and its settings}
    train_view: dict[str, Any] | None = None  # {steps, tensor, thumbnail} with augmentation

    @property
    def original(self) -> ImageOriginal:
        return self.part(ImageOriginal, "original") or ImageOriginal(
            self.path, {}, where=self._at("original")
        )

    @property
    def chain(self) -> list[ChainStep]:
        return self.parts(ChainStep, "steps")

    @property
    def thumbnails(self) -> Thumbnails:
        return self.part(Thumbnails, "thumbnails") or Thumbnails(
            self.path, {}, where=self._at("thumbnails")
        )

    @property
    def train_thumbnail(self) -> str | None:
        """The augmented training view's thumbnail (None without augmentation)."""
        return None if self.train_view is None else self.train_view.get("thumbnail")

    @property
    def train_steps(self) -> list[dict[str, Any]] | None:
        """The chain's steps on a training view (None without augmentation)."""
        return None if self.train_view is None else self.train_view.get("steps") or []

    @property
    def tensor(self) -> TensorSummary:
        return self.part(TensorSummary, "tensor") or TensorSummary(
            self.path, {}, where=self._at("tensor")
        )


@dataclass(frozen=True)
class ImageSpread(Record):
    """A category's images: how many, their width, height and aspect spreads, modes."""

    n: int = 0
    width: dict[str, float] | None = None  # {min, median, max}
    height: dict[str, float] | None = None
    aspect: dict[str, float] | None = None
    modes: dict[str, int] | None = None
    formats: dict[str, int] | None = None

    def spread(self, name: str) -> Spread:
        """The width, height or aspect spread."""
        return self.part(Spread, name) or Spread(self.path, {}, where=self._at(name))

    def check_parts(self) -> None:
        _ = self.spread("width"), self.spread("height"), self.spread("aspect")


@dataclass(frozen=True)
class Inspection(Record):
    """records/inspect/<id>.json: one split inspected after training's exact preprocessing."""

    inspect_id: str = ""
    split: str = ""
    n: int = 0
    ok: bool = False
    problems: list[dict[str, Any]] | None = None  # lib.preprocess.text.Problem, as dicts
    study: str | None = None
    snapshot_id: str | None = None
    config_sha256: str | None = None
    hypothesis_version: int | None = None
    hypothesis_sha256: str | None = None
    per_category: int | None = None
    created_at: str | None = None
    kind: str | None = None  # "image" for an image split; None for text
    task: dict[str, Any] | None = None  # the task as described (kind, labels, ...)
    template_sha256: str | None = None
    collator: dict[str, Any] | None = None  # {checked, why}: training's collator checked
    warnings: list[str] | None = None  # images: categories that differ systematically
    sha256: str | None = None

    @property
    def images(self) -> bool:
        return self.kind == "image"

    @property
    def html_path(self) -> Any:
        """The page written beside the record."""
        return self.path.with_suffix(".html")

    @property
    def collator_skipped(self) -> str | None:
        """Why training's collator was not checked on the examples (None when it was)."""
        collator = self.collator or {}
        return None if collator.get("checked", True) else str(collator.get("why"))

    @property
    def task_kind(self) -> str | None:
        return (self.task or {}).get("kind")

    @property
    def preprocess(self) -> InspectPreprocess:
        return self.part(InspectPreprocess, "preprocess") or InspectPreprocess(
            self.path, {}, where="preprocess"
        )

    @property
    def stats(self) -> LengthStats | None:
        return self.part(LengthStats, "stats")

    @property
    def category_stats(self) -> dict[str, LengthStats]:
        return self.parts_by_key(LengthStats, "category_stats")

    @property
    def answer_budget(self) -> AnswerBudget | None:
        return self.part(AnswerBudget, "answer_budget")

    @property
    def examples(self) -> list[InspectExample]:
        """A text inspection's examples ([] for images: `image_examples`)."""
        return [] if self.images else self.parts(InspectExample, "examples")

    @property
    def image_examples(self) -> list[ImageExample]:
        return self.parts(ImageExample, "examples") if self.images else []

    @property
    def distributions(self) -> dict[str, ImageSpread]:
        return self.parts_by_key(ImageSpread, "distributions")

    @property
    def stop_conditions(self) -> list[InspectProblem]:
        """The problems found, each typed."""
        return self.parts(InspectProblem, "problems")

    def check_parts(self) -> None:
        _ = self.preprocess, self.stats, self.category_stats, self.answer_budget
        _ = self.distributions, self.stop_conditions, self.preprocess.chain
        for example in self.examples:
            _ = example.tokens
        for image in self.image_examples:
            _ = image.tensor, image.original, image.chain, image.thumbnails
