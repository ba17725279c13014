"""The dossier: built from records, escaped, self-contained, rendered by headless Chromium."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from helpers import fill_hypothesis, run_cli
from tunelab.report import build_report
from tunelab.study import Study

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render_dom(html_path, tmp_path) -> str:
    """The DOM Chromium builds from the page (headless, no network, fresh profile)."""
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chrome-profile'}",
            "--dump-dom",
            html_path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture
def hostile_study(tmp_path, capsys):
    """A registered study whose strings try to inject HTML."""
    run_cli(capsys, "init", tmp_path / "s")
    fill_hypothesis(tmp_path / "s" / "study.yaml")
    raw = yaml.safe_load((tmp_path / "s" / "study.yaml").read_text())
    raw["name"] = "evil<script>document.body.setAttribute('data-pwned', '1')</script>"
    raw["hypothesis"]["behaviour"] = (
        "<img src=x onerror=\"document.body.setAttribute('data-pwned', '2')\">route"
    )
    (tmp_path / "s" / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    run_cli(capsys, "register", "-s", tmp_path / "s")
    return tmp_path / "s"


def test_report_from_records_escapes_everything(hostile_study, capsys):
    code, out, _ = run_cli(capsys, "report", "-s", hostile_study, "--json")
    assert code == 0
    html_text = (hostile_study / "report" / "dossier.html").read_text()
    assert "<script>document" not in html_text and "&lt;script&gt;" in html_text
    assert "<img src=x onerror" not in html_text
    md = (hostile_study / "report" / "dossier.md").read_text()
    assert "## Hypothesis and guardrails" in md and "Version 1 registered" in md
    assert "The sealed test split was opened 0 time(s)." in md


def test_report_is_rebuilt_not_recorded(hostile_study):
    s = Study.open(hostile_study)

    def body(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if not line.startswith("Built "))

    first = body(build_report(s)["markdown"].read_text())
    second = body(build_report(s)["markdown"].read_text())
    assert first == second and "Version 1" in first


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (make setup installs it as root)"
)
def test_dossier_renders_in_headless_chromium(hostile_study, tmp_path):
    paths = build_report(Study.open(hostile_study))
    dom = render_dom(paths["html"], tmp_path)
    assert "tunelab dossier" in dom
    assert "Hypothesis and guardrails" in dom and "Limitations" in dom
    assert 'data-pwned="' not in dom, "a script from the data ran in the dossier"
