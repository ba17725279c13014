"""The CLI's own error handling: usage errors, aborts and unexpected exceptions.

A user error is a TunelabError (exit 2, tests/cli/test_bad_inputs.py). Anything else is a bug: one
line says what failed and where, the traceback goes to a crash file (under the study folder
when a study was opened, else the temp dir) that the next line names, exit 1, and no record
changes. The handler uses only public typer/click names, so it is run under the newest typer
installed and under the lowest one pyproject allows (installed by `make setup` into
.cache/typer-lowest).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import typer

from helpers import run_cli, tree_hashes, write_topic_study

ROOT = Path(__file__).resolve().parents[2]
TYPER_LOWEST = ROOT / ".cache" / "typer-lowest"


@contextmanager
def extra_command(name: str, fn):
    """A command registered on the app for one test, removed afterwards."""
    from tunelab.cli import load_commands
    from tunelab.cli.common import app

    load_commands()  # the stage commands first, so that restoring keeps them
    before = list(app.registered_commands)
    app.command(name)(fn)
    try:
        yield
    finally:
        app.registered_commands[:] = before


def _deep_failure() -> None:
    raise RuntimeError("the index was lost " + "x" * 5000)


def test_unexpected_exception_is_one_line_and_a_crash_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def probe() -> None:
        _deep_failure()

    with extra_command("crash-probe", probe):
        code, out, err = run_cli(capsys, "crash-probe")
    assert code == 1
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(
        "error: tunelab crash-probe failed: RuntimeError: the index was lost"
    )
    assert "test_cli_errors.py" in lines[0] and "_deep_failure" in lines[0]  # where it failed
    assert len(lines[0]) < 400  # the 5,000-character message is cut
    (crash,) = tmp_path.glob("crash-*.txt")
    assert str(crash) in lines[1]
    text = crash.read_text()
    assert "command: tunelab crash-probe" in text
    assert "Traceback (most recent call last)" in text and "_deep_failure" in text


def test_crash_file_goes_to_the_study_and_records_stay(tmp_path, capsys, tiny_bert_dir):
    from tunelab.cli.common import open_study

    root = write_topic_study(tmp_path / "study", tiny_bert_dir, "crash")
    (root / "records").mkdir(exist_ok=True)
    before = tree_hashes(root / "records")

    def probe(study: Path = typer.Option(..., "--study", "-s")) -> None:
        open_study(study, None)
        {}["missing"]

    with extra_command("crash-probe", probe):
        code, _, err = run_cli(capsys, "crash-probe", "-s", str(root))
    assert code == 1, err
    assert "KeyError: 'missing'" in err and "test_cli_errors.py" in err
    (crash,) = (root / "crashes").glob("crash-*.txt")
    assert str(crash) in " ".join(err.split())
    assert tree_hashes(root / "records") == before


def test_abort_exits_1_without_traceback(capsys):
    def probe() -> None:
        raise typer.Abort()

    with extra_command("abort-probe", probe):
        code, _, err = run_cli(capsys, "abort-probe")
    assert code == 1 and "aborted" in err and "Traceback" not in err


def test_interrupt_exits_130_and_says_so(capsys):
    def probe() -> None:
        raise KeyboardInterrupt  # what Ctrl-C raises in a command

    with extra_command("interrupt-probe", probe):
        code, _, err = run_cli(capsys, "interrupt-probe")
    assert code == 130 and "interrupted" in err and "Traceback" not in err, (code, err)


@pytest.mark.parametrize("after_s", [0.0, 0.15, 0.3, 0.45])
def test_interrupt_while_starting_up_says_so_without_a_traceback(after_s):
    """A Ctrl-C while `python -m tunelab` imports its command line, or later: `after_s` counts
    from the moment the package itself is imported (`-X importtime` names it), so that a loaded
    machine's slow interpreter start cannot move the signal into Python's own start-up."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "tunelab", "--help"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    while (line := proc.stderr.readline()) and not line.rstrip().endswith("| tunelab"):
        pass
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)


def test_usage_errors_name_the_command_help(capsys):
    code, _, err = run_cli(capsys, "inspect", "--per-category", "two")
    assert code == 2 and "--per-category" in err and "`tunelab inspect --help`" in err
    code, out, err = run_cli(capsys, "--help")
    assert code == 0 and "Usage" in out and not err


PROBE = r"""
import sys, typer
from tunelab.cli import main
from tunelab.cli.common import app

@app.command("crash-probe")
def crash() -> None:
    raise ValueError("broken")

@app.command("abort-probe")
def abort() -> None:
    raise typer.Abort()

@app.command("interrupt-probe")
def interrupt() -> None:
    raise KeyboardInterrupt

for args in [["trian"], ["train", "--learning-rate", "1"], ["resume"],
             ["inspect", "--per-category", "two"], ["--help"], ["crash-probe"], ["abort-probe"],
             ["interrupt-probe"]]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(f"@@ {args[0]} {code}", file=sys.stderr)
"""


def _probe(typer_path: Path | None, tmp_path: Path) -> tuple[dict[str, int], str]:
    paths = ([str(typer_path)] if typer_path else []) + [str(ROOT / "src")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    codes = {}
    for line in proc.stderr.splitlines():
        if line.startswith("@@ "):
            _, name, code = line.split()
            codes[name] = int(code)
    return codes, proc.stderr


@pytest.mark.parametrize("which", ["newest", "lowest"])
def test_handler_under_each_typer(which, tmp_path):
    if which == "lowest" and not TYPER_LOWEST.is_dir():
        pytest.skip("the lowest typer is not installed (`make setup` installs it)")
    typer_path = TYPER_LOWEST if which == "lowest" else None
    codes, err = _probe(typer_path, tmp_path)
    expected = {"trian": 2, "train": 2, "resume": 2, "inspect": 2, "--help": 0}
    assert codes == {**expected, "crash-probe": 1, "abort-probe": 1, "interrupt-probe": 130}, err
    assert "Traceback" not in err and "AttributeError" not in err, err
    assert err.count("hint:") == 4, err  # each usage error names the command's --help
    assert "error: tunelab crash-probe failed: ValueError: broken" in err
    assert len(list(tmp_path.glob("crash-*.txt"))) == 1
