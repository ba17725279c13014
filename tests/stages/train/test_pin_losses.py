"""Pinned losses: the tiny Llama trained for four optimizer steps through `train_stage.run` (what
`tunelab train` calls in a single process) must give these exact per-step losses.

A refactor of the training path keeps identical loss (tolerance 0). The literals hold for fp32 on
the CPU with one thread (the study sets `training.num_threads: 1`; the test forces the CPU). MKL
takes other code paths on other CPUs (an AMD EPYC's last digits differ from the other set's
from the first optimizer step on), so each method has one set per CPU kind measured, and the
losses must equal one of them exactly. A change of torch or of the tiny model moves the last
digits, and then the literals are regenerated on purpose, never loosened; a CPU kind not yet
measured gets its own set, printed by the failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import write_email_study
from tunelab.core.records import read_jsonl
from tunelab.core.study import Study
from tunelab.stages.train import stage as train_stage

# step: (training loss, validation loss or None); step 0 holds the validation loss before training
PINNED = {
    "lora": [
        {
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (6.201317148760331, 6.193141634502108),
            3: (6.2012481689453125, None),
            4: (6.1658485814144735, 6.161661662752667),
        },
        {  # AMD EPYC, AVX512
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (6.201316644337552, 6.193141634502108),
            3: (6.2012481689453125, None),
            4: (6.1658485814144735, 6.161661662752667),
        },
        {  # AMD EPYC, AVX2 without AVX512
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (6.201317148760331, 6.193141634502108),
            3: (6.2012481689453125, None),
            4: (6.1658485814144735, 6.161661420549665),
        },
    ],
    "full": [
        {
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (5.921041693569215, 5.512468610491071),
            3: (5.520567673903245, None),
            4: (6.6388813219572365, 4.65014157976423),
        },
        {  # AMD EPYC, AVX512
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (5.921041693569215, 5.512468549940321),
            3: (5.520567673903245, None),
            4: (6.63888517680921, 4.65014145866273),
        },
        {  # AMD EPYC, AVX2 without AVX512
            0: (None, 6.217223031180246),
            1: (6.2094121709600225, None),
            2: (5.921041693569215, 5.512468610491071),
            3: (5.520568260779748, None),
            4: (6.638886461759869, 4.6501413981119795),
        },
    ],
}


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """The training tests' email study (LoRA dropout 0.1, micro 2 x accum 2, warm-up then
    cosine), four steps, validation and a checkpoint every two."""
    return write_email_study(
        tmp_path_factory.mktemp("pin") / "s",
        tiny_llama_dir,
        "pin-losses",
        max_steps=4,
        eval_every_steps=2,
        checkpoint_every_steps=2,
    )


@pytest.mark.parametrize("method", sorted(PINNED))
def test_losses_are_the_pinned_ones(study_dir, method, monkeypatch):
    monkeypatch.setenv("TUNELAB_DEVICE", "cpu")
    study = Study.open(study_dir, [f"adaptation.method={method}"])
    run = train_stage.run(study, name=f"pin-{method}", why="pinned losses")
    got = {
        r["step"]: (r.get("loss"), r.get("val_loss")) for r in read_jsonl(run.path("metrics.jsonl"))
    }
    assert got in PINNED[method], f"losses pinned for no CPU kind measured: {got}"
    assert run.status()["status"] == "completed"
