"""tunelab: fine-tuning experiments run as a careful protocol, with the evidence kept."""

import signal as _signal
import sys as _sys


def _interrupted(*_: object) -> None:
    _sys.stderr.write("interrupted\n")
    raise SystemExit(130)


# `python -m tunelab`: a Ctrl-C while Python finds and starts tunelab.__main__ ends as quietly
# as one in a command; `run` gives Ctrl-C back to Python once the command line is imported
_orig = getattr(_sys, "orig_argv", [])
if any(a == "-m" and b == "tunelab" for a, b in zip(_orig, _orig[1:], strict=False)):
    _signal.signal(_signal.SIGINT, _interrupted)

import logging as _logging  # noqa: E402

__version__ = "0.1.0"


class _DropOptionalKernelNote(_logging.Filter):
    """bitsandbytes warns when imported on a CPU with AVX-512 BF16 that the optional `kernels`
    package is missing, then uses its own CPU kernel: nothing a user has to act on."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


# before anything imports peft, which imports bitsandbytes
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropOptionalKernelNote())


def run() -> None:
    """The `tunelab` command. A Ctrl-C while the command line's modules import (the first half
    second) ends quietly with 130, like one during a command."""
    try:
        from tunelab.cli import main
    except KeyboardInterrupt:
        _interrupted()
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    main()
