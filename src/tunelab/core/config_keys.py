"""An unknown config key shown so that it cannot look like a known one: escaped, its non-ASCII
characters named, and the closest key that section knows suggested (look-alike letters from
other scripts, accents and case folded first)."""

from __future__ import annotations

import difflib
import types
import typing
import unicodedata
from typing import Any

# Latin look-alikes of other scripts that Unicode's compatibility form leaves as they are
LOOK_ALIKES = str.maketrans(
    "аесорхуіјѕԁһӏԛԝАВЕКМНОРСТХІЈЅαορτυνκεΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aecopxyijsdhlqwABEKMHOPCTXIJSaoptvvkeABEZHIKMNOPTYX",
)


def shown_key(key: str) -> str:
    """The key as written when ASCII, else escaped (`'le\\u0430rning'`)."""
    return key if key.isascii() else ascii(key)[1:-1]


def non_ascii_named(key: str) -> str:
    """'U+0430 CYRILLIC SMALL LETTER A at 3, ...' for each non-ASCII character of `key`."""
    return ", ".join(
        f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')} at {i + 1}"
        for i, c in enumerate(key)
        if not c.isascii()
    )


def fold(key: str) -> str:
    """The key with look-alikes as their Latin letters, accents dropped, case folded."""
    text = unicodedata.normalize("NFKD", key.translate(LOOK_ALIKES))
    return "".join(c for c in text if not unicodedata.combining(c)).casefold()


def _section_model(root: Any, parents: list[Any]) -> Any:
    """The pydantic model of the section at `parents` (a path of field names), or None."""
    model = root
    for part in parents:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def closest_key(root: Any, loc: list[Any]) -> str | None:
    """The known key of the section at loc[:-1] closest to the unknown loc[-1]."""
    model = _section_model(root, list(loc[:-1]))
    if model is None:
        return None
    known = list(model.model_fields)
    folded = {fold(k): k for k in known}
    wanted = fold(str(loc[-1]))
    if wanted in folded:
        return folded[wanted]
    match = difflib.get_close_matches(wanted, list(folded), n=1, cutoff=0.6)
    return folded[match[0]] if match else None


def unknown_key_message(root: Any, loc: list[Any], hint: str) -> str:
    """The message of an unknown key at `loc`: its non-ASCII characters and the closest key."""
    key = str(loc[-1])
    parts = []
    if not key.isascii():
        parts.append(f"not ASCII: {non_ascii_named(key)}")
    near = closest_key(root, loc)
    if near is not None and near != key:
        prefix = ".".join(str(p) for p in loc[:-1])
        parts.append(f"did you mean {prefix + '.' if prefix else ''}{near}?")
    return f"unknown key ({'; '.join([*parts, hint])})"
