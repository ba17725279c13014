"""Property-based fuzzing of what a user hands tunelab: the data readers (JSONL, CSV, Parquet,
folder), the config loader and the safetensors header check.

Generated broken inputs (bytes mutated at random, and the classes of tests/bad_inputs: keys
given twice, deep nesting, alias bombs, huge numbers, other encodings and containers, control
characters, links out of a folder, damaged headers) must give either a result or a
TunelabError whose message names the place, never another exception and never a hang (each
example runs under an alarm), and a refused `tunelab data` leaves records/ byte-identical.

Bounded for CI: derandomized, a fixed number of examples per property, a deadline per example.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import struct
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import MINIMAL_HYPOTHESIS, run_cli, tree_hashes, write_topic_study

FUZZ = settings(
    max_examples=40,
    deadline=3000,  # ms per example
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ALARM_S = 10  # a hang fails the example instead of the whole run


@contextmanager
def no_hang(seconds: int = ALARM_S):
    def fail(*_):
        raise TimeoutError(f"an input made tunelab run for over {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- generated inputs

GOOD_ROWS = [
    {"id": f"r{i}", "text": f"example text number {i}", "label": ["a", "b"][i % 2]}
    for i in range(6)
]
MAGIC = [b"\x1f\x8b\x08", b"\xff\xfe", b"\xfe\xff", b"PK\x03\x04", b"\xef\xbb\xbf", b"PAR1"]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


row_fault = st.sampled_from(
    [
        '{"id": "x", "text": "t", "label": "a", "label": "b"}',
        '{"id": "x", "text": ' + _deep(5000) + ', "label": "a"}',
        '{"id": "x", "text": "t", "label": ' + "9" * 5000 + "}",
        '{"id": "x", "text": "t", "label": NaN}',
        '{"id": "x", "text": 12, "label": "a"}',
        '{"id": "x", "text": "t", "label": [1, 2]}',
        '{"id": "x", "text": "t\\u001b[31m", "label": "a"}',
        '{"id": "x", "text": "t", "label": " A"}',
        '{"id": "x", "text": "t", "label": 1}',
        '[{"id": "x"}]',
        '{"id": "x", "text": "t"',
        '"just a string"',
        "",
    ]
)


@st.composite
def jsonl_bytes(draw) -> bytes:
    lines = [json.dumps(r) for r in GOOD_ROWS]
    for _ in range(draw(st.integers(0, 3))):
        lines.insert(draw(st.integers(0, len(lines))), draw(row_fault))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    how = draw(st.sampled_from(["plain", "magic", "flip", "cut", "noise", "utf16", "gzip"]))
    if how == "magic":
        data = draw(st.sampled_from(MAGIC)) + data
    elif how == "flip":
        pos = draw(st.integers(0, len(data) - 1))
        data = data[:pos] + bytes([data[pos] ^ draw(st.integers(1, 255))]) + data[pos + 1 :]
    elif how == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "noise":
        data = draw(st.binary(max_size=300))
    elif how == "utf16":
        data = data.decode("utf-8").encode("utf-16")
    elif how == "gzip":
        data = gzip.compress(data, mtime=0)
    return data


def _csv_from(rows: list[list[str]]) -> bytes:
    return "".join(",".join(r) + "\n" for r in rows).encode("utf-8")


@st.composite
def csv_bytes(draw) -> bytes:
    header = draw(
        st.sampled_from(
            [["id", "text", "label"], ["id", "text", "label", "label"], ["text", "id"], ["id"]]
        )
    )
    cell = st.text(alphabet='ab ,"\n\x00\x1b\r', max_size=8)
    body = draw(st.lists(st.lists(cell, min_size=1, max_size=5), max_size=6))
    data = _csv_from([header] + body)
    if draw(st.booleans()):
        data = draw(st.sampled_from(MAGIC)) + data
    return data


def _check_located(exc: Exception, *names: str) -> None:
    from tunelab.core.errors import TunelabError

    assert isinstance(exc, TunelabError), f"{type(exc).__name__}: {exc}"
    assert any(n in exc.message for n in names), exc.message
    assert exc.hint, exc.message


def _read(root: Path, **source) -> None:
    from tunelab.core.config_sections import DataConfig
    from tunelab.core.errors import TunelabError
    from tunelab.stages.data.checks import RowsRead, run_checks
    from tunelab.stages.data.readers import read_source

    cfg = DataConfig.model_validate(
        {"source": source, "fields": {"id": "id", "text": "text", "label": "label"}}
    )
    names = [p.name for p in root.rglob("*")] + [root.name]
    with no_hang():
        try:
            src = read_source(root, cfg)
            study_cfg = _study_config(cfg)
            run_checks(RowsRead(src.rows, study_cfg, root))
        except TunelabError as exc:
            _check_located(exc, *names)
        except Exception as exc:  # noqa: BLE001 - the property: nothing else escapes
            pytest.fail(f"{type(exc).__name__} escaped the reader: {exc!r}"[:500])


def _study_config(data):
    from tunelab.core.config import validate_config

    return validate_config(
        {
            "name": "fuzz",
            "hypothesis": MINIMAL_HYPOTHESIS,
            "guardrails": [],
            "data": data.model_dump(mode="json"),
            "model": {"path": "nowhere"},
        }
    )


# ---------------------------------------------------------------- readers


@FUZZ
@given(data=jsonl_bytes())
def test_jsonl_reader_locates_every_problem(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("jsonl")
    (folder / "data.jsonl").write_bytes(data)
    _read(folder / "data.jsonl", format="jsonl", path="data.jsonl")


@FUZZ
@given(data=csv_bytes())
def test_csv_reader_locates_every_problem(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("csv")
    (folder / "data.csv").write_bytes(data)
    _read(folder / "data.csv", format="csv", path="data.csv")


@FUZZ
@given(
    names=st.lists(st.sampled_from(["id", "text", "label", "x"]), min_size=1, max_size=5),
    values=st.lists(st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=5)), max_size=4),
    cut=st.one_of(st.none(), st.floats(0, 1)),
)
def test_parquet_reader_locates_every_problem(names, values, cut, tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("parquet")
    path = folder / "data.parquet"
    try:  # odd columns as text, even ones as generated (mixed types are not a table: noise)
        columns = [pa.array([str(v) if i % 2 else v for v in values]) for i in range(len(names))]
        pq.write_table(pa.table(columns, names=names), path)
    except (pa.ArrowException, ValueError):
        path.write_bytes(b"PAR1 not really")
    if cut is not None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)])
    _read(path, format="parquet", path="data.parquet")


@FUZZ
@given(
    tree=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "A", " a", ".hidden"]),
            st.sampled_from(["file", "link_out", "link_in", "dir_link_out", "binary"]),
            st.binary(max_size=40),
        ),
        max_size=5,
    )
)
def test_folder_reader_locates_every_problem(tree, tmp_path_factory):
    base = tmp_path_factory.mktemp("folder")
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside the data folder")
    root = base / "docs"
    root.mkdir()
    for i, (label, kind, data) in enumerate(tree):
        folder = root / label
        if kind == "dir_link_out":
            if not folder.exists():
                os.symlink(outside, folder)
            continue
        if folder.is_symlink():
            continue
        folder.mkdir(exist_ok=True)
        path = folder / f"f{i}.txt"
        if kind == "link_out":
            os.symlink(outside / "secret.txt", path)
        elif kind == "link_in":
            (root / "f-target.txt").write_bytes(data)
            os.symlink(root / "f-target.txt", path)
        elif kind == "binary":
            path.write_bytes(b"\x1f\x8b" + data)
        else:
            path.write_bytes(data)
    _read(root, format="folder", path="docs", glob="*.txt")


# ---------------------------------------------------------------- the config loader

yaml_fault = st.sampled_from(
    [
        "training:\n  lr: 0.1\n",
        "name: again\n",
        "x0: &x0 [a, a, a, a, a, a, a, a, a]\n"
        + "".join(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]\n" for i in range(1, 9)),
        "deep: " + _deep(2000) + "\n",
        "loop: &l [*l]\n",
        "seed_again: " + "9" * 5000 + "\n",
        "training: {max_steps: '4'}\n",
        "evaluation:\n  batch_size: yes\n",
        "budget: [unclosed\n",
        "\t- tab\n",
        "*undefined\n",
    ]
)


@FUZZ
@given(
    faults=st.lists(yaml_fault, max_size=2),
    noise=st.one_of(st.none(), st.binary(max_size=60)),
    value=st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=10), st.none()),
)
def test_config_loader_locates_every_problem(faults, noise, value, tmp_path_factory):
    import yaml

    from tunelab.core.config import load_config
    from tunelab.core.errors import TunelabError

    folder = tmp_path_factory.mktemp("config")
    write_topic_study(folder, "model", "fuzz")
    path = folder / "study.yaml"
    text = path.read_text() + "".join(faults)
    text = text.replace("max_steps: 4", f"max_steps: {yaml.safe_dump(value).splitlines()[0]}")
    data = text.encode("utf-8") + (noise or b"")
    path.write_bytes(data)
    with no_hang():
        try:
            load_config(path)
        except TunelabError as exc:
            _check_located(exc, "study.yaml")
        except Exception as exc:  # noqa: BLE001 - the property: nothing else escapes
            pytest.fail(f"{type(exc).__name__} escaped the config loader: {exc!r}"[:500])


# ---------------------------------------------------------------- safetensors headers


@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory) -> bytes:
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, path)
    return path.read_bytes()


def _with_header(data: bytes, header: bytes) -> bytes:
    (size,) = struct.unpack("<Q", data[:8])
    return struct.pack("<Q", len(header)) + header + data[8 + size :]


@FUZZ
@given(
    how=st.sampled_from(["flip", "cut", "noise", "header", "length"]),
    pos=st.floats(0, 1),
    blob=st.binary(max_size=64),
    text=st.text(max_size=80),
)
def test_safetensors_check_is_total_and_sound(how, pos, blob, text, safetensors_file, tmp_path):
    """Any bytes give a list of problems (never an exception); a file the check passes is one
    the safetensors library loads."""
    from safetensors import safe_open

    from tunelab.core.safetensors_header import header_problems, safetensors_problems

    data = safetensors_file
    at = int(pos * (len(data) - 1))
    if how == "flip":
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    elif how == "cut":
        data = data[:at]
    elif how == "noise":
        data = blob
    elif how == "header":
        data = _with_header(data, text.encode("utf-8"))
    else:
        data = struct.pack("<Q", int(pos * 2**64) % 2**64) + data[8:]
    with no_hang():
        problems = header_problems(data, len(data))
        assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
        path = tmp_path / "w.safetensors"
        path.write_bytes(data)
        assert safetensors_problems(path) == problems
        if not problems:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)


# ---------------------------------------------------------------- records stay byte-identical


@pytest.fixture(scope="module")
def data_study(tmp_path_factory, tiny_bert_dir) -> Path:
    root = write_topic_study(tmp_path_factory.mktemp("fuzz-study") / "s", tiny_bert_dir, "fuzz")
    code = run_cli_plain("data", "-s", str(root))
    assert code == 0
    return root


def run_cli_plain(*args: str) -> int:
    from tunelab.cli import main

    try:
        main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


@settings(FUZZ, max_examples=15)
@given(data=jsonl_bytes())
def test_refused_data_leaves_records_byte_identical(data, data_study, tmp_path_factory, capsys):
    root = tmp_path_factory.mktemp("copy") / "s"
    shutil.copytree(data_study, root, symlinks=True)
    before = tree_hashes(root / "records")
    (root / "data.jsonl").write_bytes(data)
    with no_hang(30):
        code, _, err = run_cli(capsys, "data", "-s", str(root))
    after = tree_hashes(root / "records")
    assert code in (0, 2), err
    assert "Traceback" not in err
    assert {k: after.get(k) for k in before} == before  # nothing existing changed
    if code == 2:
        assert after == before, "a refused input added records"
