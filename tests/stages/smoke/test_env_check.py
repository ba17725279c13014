"""`tunelab env --check`: the study's adaptation method, precision and extensions against this
backend, before anything is paid for."""

from __future__ import annotations

import json
from types import SimpleNamespace

import yaml

from helpers import run_cli
from tunelab.stages.smoke.backend import backend_checks


def cfg(method: str = "lora", precision: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(
        adaptation=SimpleNamespace(method=method), training=SimpleNamespace(precision=precision)
    )


def env(backend: str, caps: list[str], bf16: bool = True, **ext: str) -> dict:
    return {"backend": backend, "gpus": [{"capability": c} for c in caps],
            "bf16_supported": bf16, "extensions": ext}  # fmt: skip


def verdicts(e: dict, c: SimpleNamespace) -> dict:
    return {x["check"]: x["ok"] for x in backend_checks(e, c)}


def test_backend_checks():
    assert verdicts(env("cpu", []), cfg("qlora")) == {"adaptation qlora": False}
    rocm = env("rocm", ["gfx1100"], bitsandbytes="0.45")
    assert verdicts(rocm, cfg("qlora")) == {"adaptation qlora": False}
    mi300 = env("rocm", ["gfx942:sramecc+:xnack-"], bitsandbytes="0.45")
    assert verdicts(mi300, cfg("qlora")) == {"adaptation qlora": True}
    t4 = env("cuda", ["7.5"], bf16=False, **{"flash-attn": "2.7"})
    assert verdicts(t4, cfg("lora", "bf16")) == {"precision bf16": False, "flash-attn": False}
    a100 = env("cuda", ["8.0"], **{"flash-attn": "2.7"})
    assert verdicts(a100, cfg("lora", "bf16")) == {"precision bf16": True, "flash-attn": True}


def test_cli_env_check_refuses_qlora_on_cpu(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    code, out, err = run_cli(capsys, "env", "--check", "-s", tmp_path / "s", "--json")
    assert code == 0, err
    raw["adaptation"]["method"] = "qlora"
    path.write_text(yaml.safe_dump(raw))
    code, out, err = run_cli(capsys, "env", "--check", "-s", tmp_path / "s", "--json")
    got = json.loads(out)
    if got["backend"] == "cpu":
        assert code == 2 and got["checks"][0]["check"] == "adaptation qlora"
