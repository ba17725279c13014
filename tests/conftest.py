"""Shared fixtures: offline guard, tiny models saved once per test run, real packaged assets.

Every test runs offline: HF_HUB_OFFLINE=1 and sockets that reach outside the machine refuse.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Most tests train without the smoke and baseline the platform gate asks for (each tests its own
# stage); the reason is recorded with every such run. The gate's own tests unset it.
os.environ["TUNELAB_PLATFORM_WHY"] = "test suite: each test runs the stages it tests"

_real_connect = socket.socket.connect


def _guarded_connect(self, address):  # noqa: ANN001
    # Loopback and unix sockets stay open: torchrun's rendezvous and gloo use them.
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and (
        host in ("localhost", "::1", "") or host.startswith("127.") or "/" in host
    ):
        return _real_connect(self, address)
    raise OSError(f"network access blocked in tests (tried {address!r})")


socket.socket.connect = _guarded_connect  # type: ignore[method-assign]

REPO = Path(__file__).resolve().parents[1]

# fixtures shared across folders, defined beside the builders they use
pytest_plugins = ["helpers.pinned"]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 32) with a ChatML byte-level BPE tokenizer."""
    from tunelab.lib.models.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT (hidden 32) with a WordPiece tokenizer."""
    from tunelab.lib.models.tiny import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_vit_dir(tmp_path_factory) -> Path:
    """A 2-layer ViT backbone (hidden 32, 16x16 images) with its image processor."""
    from tunelab.lib.models.tiny import save_tiny_vit

    return save_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from tunelab.core.assets import minilm_path

    return minilm_path()


@pytest.fixture(scope="session")
def bbc_dir() -> Path:
    from tunelab.core.assets import bbc_path

    return bbc_path()


@pytest.fixture(scope="session")
def spam_dir() -> Path:
    from tunelab.core.assets import spamassassin_path

    return spamassassin_path()


def write_study(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.yaml").write_text(text)
    return root


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted once from its GGUF into the tunelab cache.

    The first use converts (20-50 s, 2 GB RAM); later ones find the cached folder. Slow tests only.
    """
    from tunelab.core.assets import smollm2_gguf
    from tunelab.lib.models import convert_gguf

    return convert_gguf(*smollm2_gguf())


@pytest.fixture
def make_study(tmp_path):
    """The study factory (`tests/helpers/study.py`, `build_study`) under this test's temporary
    folder: `make_study(kind, rows=..., model_dir=..., register=True, training={...})` writes a
    new study folder at each call and returns it."""
    from helpers.study import build_study

    made = iter(range(1_000))

    def make(kind: str = "classification", **options):  # noqa: ANN202
        return build_study(tmp_path / f"study-{next(made)}", kind, **options)

    return make


@pytest.fixture
def one_thread():
    """One torch thread: the tiny models' ops are too small to split, and a second thread only
    makes them slower and their timings noisier."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REAL_MODEL_FIXTURES = ("minilm_dir", "smollm2_dir")


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    """A test that asks for a real model must be marked `slow`, so `make test-fast` stays a
    fast tier: a missing mark stops the run naming the test."""
    unmarked = [
        item.nodeid
        for item in items
        if set(REAL_MODEL_FIXTURES) & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "mark these tests @pytest.mark.slow (they load a real model): " + ", ".join(unmarked)
        )
