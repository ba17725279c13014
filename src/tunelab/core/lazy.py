"""Names a package loads on first use (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, space: dict[str, Any], homes: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package` (its module globals `space`): `homes` maps each name to
    the submodule it lives in, imported when the name is first read, then kept in `space`."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        space[name] = value
        return value

    return __getattr__
