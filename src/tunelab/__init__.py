"""tunelab: fine-tuning experiments run as a careful protocol, with the evidence kept."""

import logging as _logging

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
    import sys

    try:
        from tunelab.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    main()
