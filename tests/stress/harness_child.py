"""What a process forked by the kill harness runs: `tunelab ARGS`, output to a log file.

Imported once by the fork server (with torch, transformers, peft and every CLI module), so a
forked child starts at `main(argv)` without paying the imports again.
"""

from __future__ import annotations

import os
import sys

import peft.tuners.lora  # noqa: F401
import transformers

import tunelab.lib.models  # noqa: F401
import tunelab.lib.preprocess.text  # noqa: F401
import tunelab.lib.tasks  # noqa: F401
import tunelab.stages.data  # noqa: F401
import tunelab.stages.train.stage  # noqa: F401
from tunelab.cli import load_commands, main

load_commands()
# transformers imports lazily; touch what a tiny Llama / BERT run needs (imports only: no torch
# op runs here, so the forked children start with fresh thread pools)
for _name in (
    "AutoConfig",
    "AutoTokenizer",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "PreTrainedTokenizerFast",
    "LlamaForCausalLM",
    "BertForSequenceClassification",
    "GenerationConfig",
):
    getattr(transformers, _name)


def run_cli(argv: list[str], log: str, env: dict[str, str]) -> None:
    """Run the CLI with stdout and stderr in `log`; exit with its exit code."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback is the log's to show
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
