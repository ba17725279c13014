"""Progress bars: the library reports through callbacks, the CLI draws; in a pipe a plain line
per task appears at once, then every few seconds, and with the final figures at the end."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from helpers import run_cli, write_email_study
from tunelab.cli.progress import ProgressBoard
from tunelab.stages.train.callbacks import ProgressReport, progress_text
from tunelab.stages.train.loop import TrainState


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_plain_lines_at_once_then_throttled_then_final():
    stream = io.StringIO()
    with ProgressBoard(stream=stream, every_s=3600) as board:
        board.update("train", 1, 8, "loss 6.2094")
        board.update("train", 2, 8, "loss 6.2013")  # within every_s: not printed
        assert stream.getvalue().splitlines() == ["train 1/8 (12%) loss 6.2094 | 0:00:00"]
        board.update("minhash", 0.5, 1.0)
        board.update("reading", 12345, None)
    lines = stream.getvalue().splitlines()
    assert lines[1:3] == ["minhash 50% | 0:00:00", "reading 12,345 | 0:00:00"]
    assert "train 2/8 (25%) loss 6.2013 | 0:00:00" in lines[3:]  # the final figures


def test_nothing_when_disabled_and_a_rich_bar_on_a_terminal():
    stream = io.StringIO()
    with ProgressBoard(stream=stream, enabled=False) as board:
        board.update("train", 1, 8, "loss 1.0")
    assert stream.getvalue() == ""
    terminal = Terminal()
    with ProgressBoard(stream=terminal) as board:
        # the training loop's callback, fed to the board as a stage's progress (core.progress)
        ProgressReport(board.prefixed("smoke"), 8)(
            TrainState(step=3), {"loss": 6.25, "tokens_per_s": 2140.0}
        )
    assert "smoke train" in terminal.getvalue()
    assert "loss 6.2500 | 2,140 tok/s" in terminal.getvalue()
    assert progress_text({"loss": None, "tokens_per_s": 12.0}, "img/s") == " | 12 img/s"


def test_tunelab_train_in_a_pipe_shows_its_progress(tmp_path, tiny_llama_dir, capsys):
    torch.set_num_threads(1)
    root = write_email_study(
        tmp_path / "s", tiny_llama_dir, "progress", max_steps=2, eval_every_steps=2,
        checkpoint_every_steps=2,
    )  # fmt: skip
    code, out, err = run_cli(capsys, "train", "-s", root)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("train ")]
    assert lines[0].startswith("train 1/2 (50%) loss ") and "tok/s" in lines[0]
    assert lines[-1].startswith("train 2/2 (100%) loss ")


def test_only_the_cli_progress_module_draws_bars():
    src = Path(__file__).resolve().parents[2] / "src" / "tunelab"
    drawing = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if "rich.progress" in p.read_text() and p != src / "cli" / "progress.py"
    )
    assert drawing == []


def test_the_data_readers_report_rows_read_through_the_one_protocol(tmp_path):
    """`read_source` reports `progress("reading", rows so far, None)`: the board's own update."""
    import json

    from tunelab.core.config_sections import DataConfig
    from tunelab.stages.data.readers import read_source
    from tunelab.stages.data.source_files import PROGRESS_EVERY

    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(2 * PROGRESS_EVERY + 5):
            f.write(json.dumps({"text": f"row {i}", "label": "ab"[i % 2]}) + "\n")
    cfg = DataConfig.model_validate({"source": {"format": "jsonl", "path": str(tmp_path)}})
    stream = io.StringIO()
    calls = []
    with ProgressBoard(stream=stream, every_s=0) as board:

        def both(what, done, total=None, text=""):
            calls.append((what, done, total))
            board.update(what, done, total, text)

        src = read_source(tmp_path, cfg, both)
    assert len(src.rows) == 2 * PROGRESS_EVERY + 5
    assert calls == [("reading", PROGRESS_EVERY, None), ("reading", 2 * PROGRESS_EVERY, None)]
    assert "reading 20,000" in stream.getvalue()
