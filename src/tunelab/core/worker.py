"""A tunelab module run as a worker in a new Python process: `python -m tunelab.X SPEC.json`.

A fresh process is how tunelab proves a checkpoint loads on its own (verify, the smoke's
reload) and how sizing measures a step without another measurement's allocator state.

The parent opens a `Worker`: a temporary folder, where it may put inputs, then `run(spec)`
writes the spec as `spec.json` (its `out` field names the folder), starts the module and reads
what the child left. The child's `__main__` calls `serve(body)`: `body(spec, out)` does the work,
its return value becomes `result.json`; an exception becomes `error.json` (kind, message, hint,
traceback). `Outcome.value()` returns the result or raises the child's error again, whole: a
TunelabError as its own kind, anything else as the caller's kind with the child's traceback.

Parent: `with Worker("tunelab.x") as w:` (inputs may go in `w.dir`), `outcome = w.run(spec,
timeout_s=, offline=True, env=None, poll=None)` -> `Outcome(returncode (None at the timeout),
result, error, stderr, seconds)` with `timed_out`, `killed` and `value(failure_kind, what, hint)`;
`poll()` is called about every half second while the child runs. Child:
`sys.exit(serve(body))`; `write_result(out, result)` for a child that answers early. Used by
`tunelab.lib.models.reload`, `tunelab.stages.verify.fresh` and `tunelab.stages.sizing.measure`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core import errors
from tunelab.core.errors import TunelabError
from tunelab.core.records import read_json, write_json_atomic

SPEC = "spec.json"
RESULT = "result.json"
ERROR = "error.json"


@dataclass
class Outcome:
    """What a worker left: its exit code (None when stopped at the timeout), result.json or
    error.json, its stderr and the seconds the process took."""

    returncode: int | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    stderr: str
    seconds: float
    timeout_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def killed(self) -> bool:
        """Stopped by SIGKILL (most often the kernel's out-of-memory killer)."""
        return self.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)

    def value(self, failure: type[TunelabError], what: str, hint: str) -> dict[str, Any]:
        """result.json, else the child's error raised here: its own TunelabError kind, or
        `failure` (for an exception, a crash or the timeout) with `hint`. `what` opens the
        message, e.g. "in the fresh process"."""
        if self.error is not None:
            kind = getattr(errors, str(self.error.get("kind")), None)
            if self.error.get("tunelab") and isinstance(kind, type):
                raise kind(f"{what}: {self.error['message']}", self.error.get("hint") or hint)
            raise failure(
                f"{what}: {self.error['kind']}: {self.error['message']}\n"
                f"{self.error.get('traceback') or ''}".rstrip(),
                hint,
            )
        if self.result is not None and self.returncode == 0:
            return self.result
        if self.timed_out:
            raise failure(f"{what}: no result after {self.timeout_s:g} s", hint)
        raise failure(
            f"{what}: exit {self.returncode} without a result:\n{self.stderr.strip()}", hint
        )


class Worker:
    """`with Worker("tunelab.stages.verify.fresh") as w: ...; outcome = w.run(spec, timeout_s=600)`; the
    folder `w.dir` (inputs, and what the child writes) is removed on leaving."""

    def __init__(self, module: str):
        self.module = module
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.dir = Path()

    def __enter__(self) -> Worker:
        name = self.module.rsplit(".", 1)[-1]
        self._tmp = tempfile.TemporaryDirectory(prefix=f"tunelab-{name}-")
        self.dir = Path(self._tmp.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def run(
        self,
        spec: dict[str, Any],
        *,
        timeout_s: float,
        offline: bool = True,
        env: dict[str, str] | None = None,
        python: str | None = None,
        poll: Callable[[], None] | None = None,
    ) -> Outcome:
        """Run the module on `spec` and wait (at most `timeout_s`). `offline`: the child may not
        reach the Hugging Face hub; `env`: more variables for it; `poll()` is called about
        every half second while the child runs (to read what it has written so far)."""
        (self.dir / SPEC).write_text(json.dumps({**spec, "out": str(self.dir)}, default=str))
        child_env = dict(os.environ)
        child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if offline:
            child_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        child_env.update(env or {})
        cmd = [python or sys.executable, "-m", self.module, str(self.dir / SPEC)]
        started = time.perf_counter()
        returncode, stderr = _wait(cmd, child_env, timeout_s, poll)
        seconds = time.perf_counter() - started
        result = read_json(self.dir / RESULT) if (self.dir / RESULT).exists() else None
        error = read_json(self.dir / ERROR) if (self.dir / ERROR).exists() else None
        return Outcome(returncode, result, error, stderr, seconds, timeout_s)


def _wait(
    cmd: list[str], env: dict[str, str], timeout_s: float, poll: Callable[[], None] | None
) -> tuple[int | None, str]:
    """(exit code, or None when stopped at the timeout; stderr, else stdout)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.perf_counter() + timeout_s
    while True:
        left = deadline - time.perf_counter()
        try:  # communicate again after its timeout loses no output
            out, err = proc.communicate(timeout=max(0.01, min(left, 0.5 if poll else left)))
            return proc.returncode, err or out or ""
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                proc.kill()
                out, err = proc.communicate()
                return None, _text(err)
            if poll is not None:
                poll()


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


# ------------------------------------------------------------------ the child's side


def write_result(out: Path, result: dict[str, Any]) -> None:
    """result.json of a worker (for a child that must answer before its body returns, e.g. a
    watchdog that stops the process)."""
    write_json_atomic(out / RESULT, result, overwrite=True)


def describe_error(exc: BaseException) -> dict[str, Any]:
    """error.json: a TunelabError by its kind in `tunelab.core.errors` (the parent raises that kind),
    anything else by its type name; message, hint and traceback whole."""
    if isinstance(exc, TunelabError):
        kind = next(c.__name__ for c in type(exc).__mro__ if c.__module__ == "tunelab.core.errors")
        message, hint = exc.message, exc.hint
    else:
        kind, message, hint = type(exc).__name__, str(exc), None
    return {
        "kind": kind,
        "tunelab": isinstance(exc, TunelabError),
        "message": message,
        "hint": hint,
        "traceback": "".join(traceback.format_exception(exc)),
    }


def serve(body: Callable[[dict[str, Any], Path], dict[str, Any] | None]) -> int:
    """The `__main__` of a worker module: `sys.exit(serve(body))`. Returns the exit code: 0
    with result.json, else the error's (a TunelabError's own code, 1 otherwise)."""
    if len(sys.argv) != 2:
        print(f"usage: python -m {body.__module__} {SPEC}", file=sys.stderr)
        return 2
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    try:
        result = body(spec, out)
    except Exception as exc:  # noqa: BLE001 - the parent raises it again
        write_json_atomic(out / ERROR, describe_error(exc), overwrite=True)
        print(str(exc), file=sys.stderr)
        return int(getattr(exc, "exit_code", 1)) if isinstance(exc, TunelabError) else 1
    write_result(out, result or {})
    return 0
