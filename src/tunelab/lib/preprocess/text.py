"""Preprocessing: prompt templates, tokenization, truncation and the loss mask.

One code path renders the prompt for training (`encode`) and for inference (`prompt_ids`): a
causal-LM sequence is `prefix + input + suffix + target + EOS`, where `prefix` and `suffix` come
from rendering the template once around a placeholder for the input (the tokenizer's chat
template with the generation prompt, or `preprocess.plain_template`). Each piece is tokenized on
its own, so `prompt_ids(example)` is exactly the first tokens of `encode(example)["input_ids"]`.
User text (input and target) is tokenized with special tokens split, so an input that contains
"<|im_end|>" cannot inject a control token.

Truncation cuts the input tokens only (left or right side, `preprocess.truncation_side`); the
target is never cut unless `preprocess.allow_target_truncation` (an example whose target would
be cut is encoded cut and flagged, and `check` refuses it). Labels follow the transformers
convention (aligned with input_ids, -100 where no loss) and are built from positions, never by
masking token values, so the target's EOS keeps its loss even when pad == EOS.

`template_sha256` hashes the rendering recipe; `mask_checks.check_template_match` refuses an evaluation whose
recipe differs from training's.

`Preprocessor(tokenizer, cfg, task, architecture)`, architecture "encoder" or "causal_lm" ("image"
gives a `tunelab.lib.preprocess.images.ImagePreprocessor`):

- `encode(example) -> dict`: causal `{"id", "input_ids", "labels", "truncated", "prompt_len",
  "target_len", "input_tokens", "input_tokens_cut", "target_truncated", "target_text"}` (labels
  -100 everywhere but the loss positions; EOS included in the target); encoder classification
  `{"id", "input_ids", "label": int, "truncated"}`. `encode_train` is `encode` for text;
  `train_views(rows, encoded)` is None for text.
- `prompt_ids(example, *, generate=None)`: the prompt on the same rendering path, no target;
  the cut leaves room for the example's target, or with `generate=N` (evaluation of format and
  extraction) for N generated tokens.
- `encode_candidates(example)` (causal classification: one encoding per label, target = label
  + EOS, one shared prompt; the score is the summed log-prob of the loss positions),
  `encode_with_target(example, text)`, `render_prompt(example)` (text, special tokens visible),
  `describe()` (preprocess.json: template_sha256, prefix/suffix text, notes), `eos_id`, `pad_id`.
- `find_problems(encoded) -> [Problem]` (no raise; `Problem`: example_id, kind, message, fix),
  `check(encoded)` raises PreprocessError (each example judged by
  `tunelab.lib.preprocess.mask_checks.example_problems`); `mask_checks.check_collated(encoded, labels_rows, pad_id,
  eos_id) -> [Problem]` finds a collator that masks labels by value (`eos_masked_by_pad`);
  `raise_problems(problems)`; `length_stats(encoded)` -> n, p50, p95, max, share_truncated
  (image encodings: `{n, shape}`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tunelab.core.config import StudyConfig
from tunelab.core.errors import PreprocessError
from tunelab.core.hashing import sha256_json
from tunelab.lib.preprocess.chat import ChatRendering, render_chat
from tunelab.lib.preprocess.mask_checks import IGNORE_INDEX, example_problems
from tunelab.lib.preprocess.problems import FIXES as FIXES  # re-exported
from tunelab.lib.preprocess.problems import Problem, raise_problems
from tunelab.lib.tasks import ClassificationTask, Task

RECIPE_VERSION = 1
ARCHITECTURES = ("encoder", "causal_lm")


def _find_sublist(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


class Preprocessor:
    """Render, tokenize, truncate and mask examples of one study the same way everywhere.

    Args:
        tokenizer: the base model's transformers tokenizer.
        cfg: the study config (`preprocess` and `task` sections are read).
        task: from `tunelab.lib.tasks.get_task`.
        architecture: "encoder" (classification head) or "causal_lm".

    Raises:
        PreprocessError: a template that cannot render prompts (no chat template, one that drops
            the input or ignores the generation prompt, a plain template without {input}), no
            EOS token, or a task the architecture cannot do.
    """

    def __new__(cls, tokenizer: Any, cfg: StudyConfig, task: Task, architecture: str):
        # an image model's examples go through the image chain, behind this same interface
        if cls is Preprocessor and architecture == "image":
            from tunelab.lib.preprocess.images import ImagePreprocessor

            return ImagePreprocessor(tokenizer, cfg, task, architecture)
        return super().__new__(cls)

    def __init__(self, tokenizer: Any, cfg: StudyConfig, task: Task, architecture: str):
        if architecture not in ARCHITECTURES:
            raise PreprocessError(
                f"unknown architecture {architecture!r}",
                hint="set model.architecture to encoder or causal_lm",
            )
        self.tokenizer = tokenizer
        self.cfg = cfg.preprocess
        self.task = task
        self.architecture = architecture
        self.notes: list[str] = []
        self.chat: ChatRendering | None = None
        self.eos_id: int | None = tokenizer.eos_token_id
        self.eos_token: str | None = tokenizer.eos_token
        self.pad_id: int | None = tokenizer.pad_token_id
        self.lead_ids, self.trail_ids = self._special_wrapping()
        if architecture == "encoder":
            if task.kind != "classification":
                raise PreprocessError(
                    f"an encoder model can only do classification, the task is {task.kind!r}",
                    hint="use a causal LM (model.architecture: causal_lm) for format and "
                    "extraction tasks",
                )
            self.prefix_text = self.suffix_text = ""
            self.prefix_ids: list[int] = []
            self.suffix_ids: list[int] = []
        else:
            if self.eos_id is None or self.eos_token is None:
                raise PreprocessError(
                    "the tokenizer has no EOS token, so the model cannot learn to stop",
                    hint="use a tokenizer with eos_token set (tokenizer_config.json)",
                )
            self.prefix_text, self.suffix_text = self._render_template()
            lead = self.lead_ids if self.cfg.template == "plain" else []
            self.prefix_ids = lead + self._ids(self.prefix_text, user_text=False)
            self.suffix_ids = self._ids(self.suffix_text, user_text=False)
            if self.pad_id is not None and self.pad_id == self.eos_id:
                self.notes.append(
                    f"pad token == EOS ({self.eos_token!r}): labels are built from positions, so "
                    "the target's EOS keeps its loss; a collator must not mask labels by value"
                )
        self._special_texts = self._find_special_texts()
        self._target_reserve = self._classification_reserve()
        self.template_sha256 = sha256_json(self.recipe())

    # ------------------------------------------------------------ templates

    def _ids(self, text: str, *, user_text: bool) -> list[int]:
        if not text:
            return []
        if user_text:
            try:
                return list(
                    self.tokenizer(
                        text, add_special_tokens=False, verbose=False, split_special_tokens=True
                    )["input_ids"]
                )
            except TypeError:  # a tokenizer without split_special_tokens
                pass
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def _find_special_texts(self) -> list[str] | None:
        """Strings of the special tokens, or None when the tokenizer gives no offsets."""
        try:
            self.tokenizer("x", add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError):
            return None
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
        texts |= set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        return sorted(t for t in texts if t)

    def _special_wrapping(self) -> tuple[list[int], list[int]]:
        """Tokens the tokenizer puts around a text by itself (BOS, [CLS] ... [SEP])."""
        bare = list(self.tokenizer("x", add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer("x", add_special_tokens=True)["input_ids"])
        at = _find_sublist(full, bare)
        if at < 0:
            return [], []
        return full[:at], full[at + len(bare) :]

    def _render_template(self) -> tuple[str, str]:
        instruction = self.task.instruction
        if self.cfg.template == "plain":
            template = self.cfg.plain_template
            if template.count("{input}") != 1:
                raise PreprocessError(
                    f"preprocess.plain_template must contain {{input}} exactly once, found "
                    f"{template.count('{input}')} in {template!r}",
                    hint='write e.g. plain_template: "{instruction}\\n\\n### Input:\\n{input}'
                    '\\n\\n### Answer:\\n"',
                )
            if instruction and "{instruction}" not in template:
                self.notes.append(
                    "preprocess.plain_template has no {instruction}: task.instruction is not shown"
                )
            prefix, suffix = template.replace("{instruction}", instruction).split("{input}")
            if not suffix:
                self.notes.append(
                    "preprocess.plain_template ends right after {input}: the answer is glued to "
                    "the input; add a separator such as '\\n\\n### Answer:\\n'"
                )
            return prefix, suffix
        chat = render_chat(
            self.tokenizer,
            instruction,
            self.cfg.instruction_role,
            dict(self.cfg.chat_template_kwargs or {}),
        )
        self.notes += chat.notes
        self.chat = chat
        return chat.prefix, chat.suffix

    def recipe(self) -> dict[str, Any]:
        """Everything that decides how a prompt is rendered and cut (hashed as template_sha256).

        Training-only switches (train_on_prompt, allow_target_truncation) are not part of it.
        """
        return {
            "version": RECIPE_VERSION,
            "architecture": self.architecture,
            "template": self.cfg.template if self.architecture == "causal_lm" else None,
            "chat_template": (
                getattr(self.tokenizer, "chat_template", None)
                if self.architecture == "causal_lm" and self.cfg.template == "chat"
                else None
            ),
            "plain_template": (
                self.cfg.plain_template
                if self.architecture == "causal_lm" and self.cfg.template == "plain"
                else None
            ),
            "instruction": self.task.instruction if self.architecture == "causal_lm" else None,
            "prefix_text": self.prefix_text,
            "suffix_text": self.suffix_text,
            "prefix_ids": self.prefix_ids,
            "suffix_ids": self.suffix_ids,
            "wrapping_ids": [self.lead_ids, self.trail_ids],
            "eos_token": self.eos_token,
            "eos_id": self.eos_id,
            "max_seq_len": self.cfg.max_seq_len,
            "truncation_side": self.cfg.truncation_side,
            "split_special_tokens_in_user_text": True,
            # only when set, so recipes (and their sha256) of studies without them stay as they are
            **self._chat_settings(),
        }

    def _chat_settings(self) -> dict[str, Any]:
        chat = self.chat
        out: dict[str, Any] = {}
        if chat is None:
            return out
        if self.cfg.chat_template_kwargs:
            out["chat_template_kwargs"] = dict(self.cfg.chat_template_kwargs)
        if self.cfg.instruction_role != "user":
            out["instruction_role"] = chat.instruction_role
        return out

    def describe(self) -> dict[str, Any]:
        """The recipe summary saved with runs (preprocess.json) and inspect records."""
        return {
            "template_sha256": self.template_sha256,
            "architecture": self.architecture,
            "template": self.cfg.template,
            "prefix_text": self.prefix_text,
            "suffix_text": self.suffix_text,
            "eos_token": self.eos_token,
            "pad_token": getattr(self.tokenizer, "pad_token", None),
            "max_seq_len": self.cfg.max_seq_len,
            "truncation_side": self.cfg.truncation_side,
            "train_on_prompt": self.cfg.train_on_prompt,
            "allow_target_truncation": self.cfg.allow_target_truncation,
            "inserted_text": self.chat.inserted if self.chat else "",
            **self._chat_settings(),
            "notes": list(self.notes),
        }

    # ------------------------------------------------------------ encoding

    def _classification_reserve(self) -> int | None:
        """Causal classification: room kept for the longest label, so the prompt's cut never
        depends on which label is the gold one (and all label candidates share one prompt)."""
        if self.architecture != "causal_lm" or not isinstance(self.task, ClassificationTask):
            return None
        return max(len(self._ids(label, user_text=True)) for label in self.task.labels) + 1

    def _cut_input(self, input_ids: list[int], reserve: int) -> tuple[list[int], int]:
        """Cut the input so prefix + input + suffix + reserve fits; returns (ids, tokens cut)."""
        room = self.cfg.max_seq_len - len(self.prefix_ids) - len(self.suffix_ids) - reserve
        room = max(room, 0)
        cut = max(len(input_ids) - room, 0)
        if cut == 0:
            return input_ids, 0
        if self.cfg.truncation_side == "left":
            return input_ids[cut:], cut
        return input_ids[: len(input_ids) - cut], cut

    def _prompt(self, input_text: str, reserve: int) -> tuple[list[int], int, int]:
        """(prompt ids, input tokens before the cut, input tokens cut).

        The prompt is tokenized as one string, as the template's own tokenization would do it
        (`apply_chat_template(..., tokenize=True)`), so the base model sees its native tokens.
        An input holding special-token text is tokenized piecewise instead, with its special
        tokens split, so that it cannot inject control tokens.
        """
        input_ids = self._ids(input_text, user_text=True)
        room = max(self.cfg.max_seq_len - reserve, 0)
        if not self._native_ok(input_text):
            kept, cut = self._cut_input(input_ids, reserve)
            return self.prefix_ids + kept + self.suffix_ids, len(input_ids), cut
        ids = self._native(input_text)
        if len(ids) <= room:
            return ids, len(input_ids), 0
        # Cut whole input tokens (by their character offsets), re-tokenize, repeat if the
        # boundaries merged differently.
        offsets = self.tokenizer(
            input_text, add_special_tokens=False, verbose=False, return_offsets_mapping=True
        )["offset_mapping"]
        n = len(input_ids)
        cut = min(max(self._cut_input(input_ids, reserve)[1], 1), n)
        while True:
            if cut >= n:
                kept_text = ""
            elif self.cfg.truncation_side == "left":
                kept_text = input_text[offsets[cut][0] :]
            else:
                kept_text = input_text[: offsets[n - cut - 1][1]]
            ids = self._native(kept_text)
            if len(ids) <= room or cut >= n:
                return ids, n, cut
            cut = min(cut + len(ids) - room, n)

    def _native_ok(self, text: str) -> bool:
        if self._special_texts is None:
            return False
        return not any(special in text for special in self._special_texts)

    def _native(self, input_text: str) -> list[int]:
        # verbose=False: inputs longer than the model's maximum are expected here; they are cut
        # by the truncation policy, so the tokenizer's length warning would only be noise.
        lead = self.lead_ids if self.cfg.template == "plain" else []
        text = self.prefix_text + input_text + self.suffix_text
        return lead + list(
            self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        )

    def _target_ids(self, target_text: str) -> list[int]:
        return self._ids(target_text, user_text=True) + [self.eos_id]

    def target_len(self, example: dict[str, Any]) -> int:
        """The tokens of the example's answer and its EOS, as `encode` puts them under the loss
        (`encode(example)["target_len"]`), without tokenizing the input."""
        return len(self._target_ids(self.task.render(example)[1]))

    def _encode_causal(self, example: dict[str, Any], input_text: str, target_text: str) -> dict:
        target_ids = self._target_ids(target_text)
        reserve = self._target_reserve or len(target_ids)
        prompt, n_input, cut = self._prompt(input_text, reserve)
        room = self.cfg.max_seq_len - len(prompt)
        kept_target = target_ids[: max(room, 0)]
        target_truncated = len(kept_target) < len(target_ids)
        input_ids = prompt + kept_target
        if self.cfg.train_on_prompt:
            labels = list(input_ids)
        else:
            labels = [IGNORE_INDEX] * len(prompt) + kept_target
        return {
            "id": example.get("id"),
            "input_ids": input_ids,
            "labels": labels,
            "truncated": bool(cut or target_truncated),
            "prompt_len": len(prompt),
            "target_len": len(target_ids),
            "input_tokens": n_input,
            "input_tokens_cut": cut,
            "target_truncated": target_truncated,
            "target_text": target_text,
            "min_seq_len_needed": len(self.prefix_ids) + len(self.suffix_ids) + len(target_ids),
        }

    def _encode_encoder(self, example: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(self.task, ClassificationTask)
        text = self.task.input_text(example)
        content = self._ids(text, user_text=True)
        room = max(self.cfg.max_seq_len - len(self.lead_ids) - len(self.trail_ids), 0)
        cut = max(len(content) - room, 0)
        if cut:
            content = content[cut:] if self.cfg.truncation_side == "left" else content[:room]
        return {
            "id": example.get("id"),
            "input_ids": self.lead_ids + content + self.trail_ids,
            "label": self.task.label_index(example),
            "truncated": bool(cut),
            "input_tokens": len(content) + cut,
            "input_tokens_cut": cut,
            "target_text": self.task.target_text(example),
        }

    def encode(self, example: dict[str, Any]) -> dict[str, Any]:
        """One example -> model inputs.

        causal_lm: `{"id", "input_ids", "labels", "truncated", "prompt_len", "target_len",
        "input_tokens", "input_tokens_cut", "target_truncated", "target_text"}`, labels -100 on
        the prompt (unless train_on_prompt), the target and its EOS under the loss.
        encoder: `{"id", "input_ids", "label": int, "truncated", ...}`.
        """
        if self.architecture == "encoder":
            return self._encode_encoder(example)
        input_text, target_text = self.task.render(example)
        return self._encode_causal(example, input_text, target_text)

    def encode_train(self, example: dict[str, Any]) -> dict[str, Any]:
        """A training example's encoding (text: `encode`; images may augment)."""
        return self.encode(example)

    def train_views(self, rows: Any, encoded: Any) -> None:
        """Text has one view of each example: the loop reads `encoded` every epoch."""
        return None

    def encode_with_target(self, example: dict[str, Any], target_text: str) -> dict[str, Any]:
        """Encode with another target text (e.g. a candidate label to score), same prompt."""
        if self.architecture == "encoder":
            raise PreprocessError("encode_with_target is for causal LMs")
        return self._encode_causal(example, self.task.input_text(example), target_text)

    def encode_candidates(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        """Causal classification: one encoding per label (target = label + EOS), one shared
        prompt. Score each by the summed log-likelihood of its loss positions."""
        if not isinstance(self.task, ClassificationTask) or self.architecture != "causal_lm":
            raise PreprocessError("encode_candidates is for classification with a causal LM")
        return [self.encode_with_target(example, label) for label in self.task.labels]

    def prompt_ids(self, example: dict[str, Any], *, generate: int | None = None) -> list[int]:
        """The prompt: the same rendering and cut as `encode`, without the target.

        For format/extraction the cut keeps room for the example's target when it has one (so
        this is exactly the prefix of `encode(example)["input_ids"]`), else for EOS only.
        `generate=N` is the inference prompt: the cut keeps room for the N tokens generation may
        add, whatever the example's target, so that the gold answer's length never decides how
        much of the input the model sees (causal classification keeps its label room).
        """
        if self.architecture == "encoder":
            return self._encode_encoder(example)["input_ids"]
        input_text = self.task.input_text(example)
        if self._target_reserve is not None:
            reserve = self._target_reserve
        elif generate is not None:
            reserve = int(generate)
        elif example.get("target") not in (None, ""):
            reserve = len(self._ids(self.task.target_text(example), user_text=True)) + 1
        else:
            reserve = 1
        return self._prompt(input_text, reserve)[0]

    def render_prompt(self, example: dict[str, Any]) -> str:
        """The prompt as text with special tokens visible (what `prompt_ids` decodes to)."""
        return self.tokenizer.decode(self.prompt_ids(example), skip_special_tokens=False)

    # ------------------------------------------------------------ checks

    def find_problems(self, encoded: Sequence[dict[str, Any]]) -> list[Problem]:
        """Every broken example among `encoded` (empty list when all are sound)."""
        problems: list[Problem] = []
        for ex in encoded:
            problems.extend(example_problems(self, ex))
        return problems

    def check(self, encoded: Sequence[dict[str, Any]]) -> None:
        """Raise PreprocessError naming every broken example (the stop conditions)."""
        raise_problems(self.find_problems(encoded))


def nearest_rank(ordered: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of sorted values: the smallest with at least q of them <= it."""
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def length_stats(encoded: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Token-count statistics of encoded examples: p50, p95, max, share truncated (images:
    the number of examples and the tensor shape)."""
    if encoded and "pixel_values" in encoded[0]:
        return {"n": len(encoded), "shape": list(encoded[0]["pixel_values"].shape)}
    lengths = sorted(len(e["input_ids"]) for e in encoded)
    n = len(lengths)
    if n == 0:
        return {
            "n": 0,
            "p50": None,
            "p95": None,
            "max": None,
            "mean": None,
            "truncated": 0,
            "share_truncated": None,
        }

    truncated = sum(1 for e in encoded if e.get("truncated"))
    return {
        "n": n,
        "p50": nearest_rank(lengths, 0.50),
        "p95": nearest_rank(lengths, 0.95),
        "max": lengths[-1],
        "mean": sum(lengths) / n,
        "truncated": truncated,
        "share_truncated": truncated / n,
        "target_truncated": sum(1 for e in encoded if e.get("target_truncated")),
    }
