"""Cleaning rules from `data.cleaning`, applied in order to the text of each example.

Pure: takes texts, returns kept indices, the new texts and what each rule did. The target (the
gold answer) is never rewritten; labels change only through `unify_labels`, which
`tunelab.stages.data.checks.check_labels` applies.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunelab.core.config_sections import CleaningRule
from tunelab.core.errors import ConfigError
from tunelab.core.hashing import sha256_json

_SPACES = re.compile(r"[^\S\n]+")  # whitespace other than newline
# ANSI escape sequences (CSI and OSC), then single control characters: C0 but tab, newline and
# carriage return; DEL; C1
CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"
)
_CONTROL_SPACES = re.compile(r"[\x0b\x0c\x1c-\x1f\x85]")  # controls that separate words
_TRAILING = re.compile(r" +\n")
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalize_whitespace(text: str) -> str:
    """Unify line ends, collapse runs of spaces/tabs (any Unicode space) to one space, strip
    trailing spaces and keep at most one blank line: paragraphs survive, layout noise does not."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACES.sub(" ", text)
    text = _TRAILING.sub("\n", text)
    return _BLANK_RUNS.sub("\n\n", text)


def strip_control(text: str) -> str:
    """Remove ANSI escape sequences and control characters (those that separate words, such
    as form feed, become a space); tab, newline and carriage return stay."""
    return CONTROL.sub(lambda m: " " if _CONTROL_SPACES.fullmatch(m.group()) else "", text)


def rule_params(rule: CleaningRule) -> dict[str, Any]:
    """The rule as recorded: its name and only the arguments it uses."""
    used = {
        "drop_longer_than": ("max_chars",),
        "drop_shorter_than": ("min_chars",),
        "regex_replace": ("pattern", "replacement"),
    }.get(rule.rule, ())
    return {"rule": rule.rule, **{k: getattr(rule, k) for k in used}}


def rules_sha256(rules: list[CleaningRule]) -> str:
    return sha256_json([rule_params(r) for r in rules])


def compile_rules(rules: list[CleaningRule]) -> list[tuple[str, Callable[[str], str | None]]]:
    """Each rule as (name, fn) where fn returns the new text, or None to drop the example.

    Raises ConfigError for a regular expression that does not compile.
    """
    out: list[tuple[str, Callable[[str], str | None]]] = []
    for i, r in enumerate(rules):
        name = r.rule
        if name == "unicode_nfc":
            out.append((name, lambda t: unicodedata.normalize("NFC", t)))
        elif name == "unicode_nfkc":
            out.append((name, lambda t: unicodedata.normalize("NFKC", t)))
        elif name == "normalize_whitespace":
            out.append((name, normalize_whitespace))
        elif name == "strip":
            out.append((name, str.strip))
        elif name == "lowercase":
            out.append((name, str.lower))
        elif name == "strip_control":
            out.append((name, strip_control))
        elif name == "unify_labels":  # a rule on labels (data.checks.check_labels), not texts
            out.append((name, lambda t: t))
        elif name == "drop_empty":
            out.append((name, lambda t: t if t.strip() else None))
        elif name == "drop_longer_than":
            n_max = r.max_chars
            out.append((name, lambda t, n=n_max: t if len(t) <= n else None))
        elif name == "drop_shorter_than":
            n_min = r.min_chars
            out.append((name, lambda t, n=n_min: t if len(t) >= n else None))
        elif name == "regex_replace":
            try:
                pattern = re.compile(r.pattern or "")
            except re.error as exc:
                raise ConfigError(
                    f"data.cleaning[{i}].pattern: {r.pattern!r} is not a valid regular "
                    f"expression ({exc})",
                    hint="fix the pattern (Python `re` syntax; quote it in YAML)",
                ) from None
            repl = r.replacement
            out.append((name, lambda t, p=pattern, s=repl: p.sub(s, t)))
        else:  # pragma: no cover - the config's Literal lists every rule
            raise ConfigError(f"data.cleaning[{i}]: unknown rule {name!r}")
    return out


@dataclass
class CleaningResult:
    kept: list[int]  # indices of the input texts that survive, in order
    texts: list[str]  # their cleaned texts
    effects: list[dict[str, Any]]  # per rule: rule, params, changed, dropped
    dropped: list[tuple[int, str]]  # (input index, rule that dropped it)


def clean_texts(texts: list[str], rules: list[CleaningRule]) -> CleaningResult:
    """Apply the rules in order; count, per rule, the texts it changed and the ones it dropped."""
    fns = compile_rules(rules)
    changed = [0] * len(fns)
    dropped_by = [0] * len(fns)
    kept: list[int] = []
    out: list[str] = []
    dropped: list[tuple[int, str]] = []
    for i, text in enumerate(texts):
        t: str | None = text
        for k, (name, fn) in enumerate(fns):
            new = fn(t)
            if new is None:
                dropped_by[k] += 1
                dropped.append((i, name))
                t = None
                break
            if new != t:
                changed[k] += 1
            t = new
        if t is not None:
            kept.append(i)
            out.append(t)
    effects = [
        {**rule_params(r), "changed": changed[k], "dropped": dropped_by[k]}
        for k, r in enumerate(rules)
    ]
    return CleaningResult(kept, out, effects, dropped)
