"""A tokenizer's chat template turned into the prompt pieces training and inference share.

The template is judged by what it renders, not by the flags it reads. Two renderings of one
conversation are made: the inference prompt (the user turn with `add_generation_prompt=True`)
and the training conversation (the same user turn followed by an assistant turn holding the
answer). The template is accepted when the inference prompt is a prefix of the training
conversation; it is refused otherwise, naming the tokens where the two renderings part.

Rules this module decides (docs/inspect.md and docs/models.md describe them):

- Text the template puts between the generation prompt and the answer (an empty reasoning block
  `<think>\\n\\n</think>\\n\\n` in Qwen3's style, or the assistant header of a template that
  ignores `add_generation_prompt`) is part of the prompt: it carries no loss, and generation
  starts after it, where training's loss starts.
- `preprocess.instruction_role: system` puts the task instruction in a system turn. A template
  that refuses a system role (Gemma's style raises, others drop it) gets the instruction folded
  into the user turn instead, and a note says so.
- `preprocess.chat_template_kwargs` (e.g. Qwen3's `enable_thinking: false`) are passed to every
  rendering and belong to the hashed recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunelab.core.errors import PreprocessError

# Stand for the input and the answer while the template is rendered; split out afterwards.
INPUT_PLACEHOLDER = "\u27e6tunelab-input-3f9c\u27e7"
TARGET_PLACEHOLDER = "\u27e6tunelab-target-3f9c\u27e7"
_PLAIN_HINT = "or set preprocess.template: plain (with preprocess.plain_template)"


@dataclass
class ChatRendering:
    """The prompt around the input: `prefix + input + suffix` is the inference prompt, and the
    answer follows the suffix directly."""

    prefix: str
    suffix: str
    inserted: str = ""  # template text before the answer, kept in the suffix (no loss)
    instruction_role: str = "user"  # where the instruction went: "user", "system", "folded"
    notes: list[str] = field(default_factory=list)


def _apply(tokenizer: Any, messages: list[dict[str, str]], gen: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen, **kwargs
    )


def _messages(instruction: str, role: str) -> list[dict[str, str]]:
    if role == "system" and instruction:
        return [
            {"role": "system", "content": instruction},
            {"role": "user", "content": INPUT_PLACEHOLDER},
        ]
    content = f"{instruction}\n\n{INPUT_PLACEHOLDER}" if instruction else INPUT_PLACEHOLDER
    return [{"role": "user", "content": content}]


def _render_prompt(
    tokenizer: Any, instruction: str, role: str, kwargs: dict
) -> tuple[list[dict[str, str]], str, str, list[str]]:
    """(messages, prompt text, the role the instruction went to, notes)."""
    notes: list[str] = []
    if role == "system" and instruction:
        messages = _messages(instruction, "system")
        try:
            prompt = _apply(tokenizer, messages, True, kwargs)
        except Exception as exc:  # Gemma-style templates raise on a system turn
            why = f"refuses a system role ({str(exc)[:80]})"
        else:
            if instruction in prompt:
                return messages, prompt, "system", notes
            why = "drops the system turn's text"
        notes.append(
            f"the chat template {why}: the instruction is folded into the user turn "
            "(preprocess.instruction_role: system cannot be honoured)"
        )
        role = "folded"
    messages = _messages(instruction, "user")
    try:
        prompt = _apply(tokenizer, messages, True, kwargs)
    except Exception as exc:  # jinja errors, templates that refuse a role or a kwarg
        raise PreprocessError(
            f"the chat template fails to render a user message: {exc}",
            hint=f"fix the tokenizer's chat_template or preprocess.chat_template_kwargs, {_PLAIN_HINT}",
        ) from None
    return messages, prompt, role if role == "folded" else "user", notes


def _token_view(tokenizer: Any, ids: list[int], at: int) -> str:
    window = ids[max(at - 2, 0) : at + 3]
    shown = ", ".join(f"{i}:{tokenizer.decode([i], skip_special_tokens=False)!r}" for i in window)
    return f"[{shown}]" if window else "[] (ends here)"


def parting_tokens(tokenizer: Any, prompt: str, conversation: str) -> str:
    """Where the token ids of `prompt` stop being a prefix of `conversation`'s: the position and
    the tokens (id:text) of each rendering around it."""
    a = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    b = list(tokenizer(conversation, add_special_tokens=False)["input_ids"])
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return (
        f"they part at token {at}: inference prompt {_token_view(tokenizer, a, at)}, "
        f"training conversation {_token_view(tokenizer, b, at)}"
    )


def render_chat(tokenizer: Any, instruction: str, role: str, kwargs: dict) -> ChatRendering:
    """Judge the tokenizer's chat template and split its prompt around the input.

    Raises:
        PreprocessError: no template, one that fails to render, drops the input, renders the
            answer elsewhere than after the inference prompt (the parting tokens named).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PreprocessError(
            "the tokenizer has no chat template (preprocess.template: chat)",
            hint=f"use a tokenizer that ships a chat template, {_PLAIN_HINT}",
        )
    messages, prompt, role, notes = _render_prompt(tokenizer, instruction, role, kwargs)
    if prompt.count(INPUT_PLACEHOLDER) != 1:
        raise PreprocessError(
            "the chat template does not render the user message's content "
            f"(the input appears {prompt.count(INPUT_PLACEHOLDER)} times)",
            hint="fix the tokenizer's chat_template so it prints message['content'], "
            + _PLAIN_HINT,
        )
    answer = [*messages, {"role": "assistant", "content": TARGET_PLACEHOLDER}]
    try:
        conversation = _apply(tokenizer, answer, False, kwargs)
    except Exception as exc:
        raise PreprocessError(
            f"the chat template fails to render an assistant turn after the prompt: {exc}",
            hint=f"fix the tokenizer's chat_template, {_PLAIN_HINT}",
        ) from None
    at = conversation.find(TARGET_PLACEHOLDER, len(prompt))
    if not conversation.startswith(prompt) or at < 0:
        raise PreprocessError(
            "the chat template's inference prompt is not a prefix of the conversation it renders "
            "for training, so training and inference would not agree on where the answer "
            "starts; " + parting_tokens(tokenizer, prompt, conversation),
            hint="fix the tokenizer's chat_template so that the generation prompt "
            "(add_generation_prompt=True) is how an assistant turn begins, " + _PLAIN_HINT,
        )
    inserted = conversation[len(prompt) : at]
    if inserted:
        notes.append(
            f"the chat template inserts {inserted!r} before the answer: it is part of the "
            "prompt (no loss), and generation starts after it"
        )
    prefix, suffix = (prompt + inserted).split(INPUT_PLACEHOLDER)
    out = ChatRendering(prefix, suffix, inserted, role, notes)
    out.notes += _ending_notes(tokenizer, conversation[at + len(TARGET_PLACEHOLDER) :])
    return out


def _ending_notes(tokenizer: Any, after: str) -> list[str]:
    eos = tokenizer.eos_token or ""
    if after.startswith(eos):
        return []
    return [
        f"the chat template ends an assistant turn with {after[:20]!r}, not the EOS token "
        f"{eos!r}; tunelab appends EOS and generation stops on it"
    ]
