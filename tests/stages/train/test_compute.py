"""How a run computes: `training.precision: auto`, `training.compile`, and the record of both
with the attention route (compute.json)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_cli, write_email_study
from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import ConfigError
from tunelab.core.records import read_json
from tunelab.core.study import Study
from tunelab.stages.train import compute
from tunelab.stages.train.precision import resolve_precision

pytestmark = pytest.mark.usefixtures("one_thread")


def test_precision_auto_is_the_default_and_fp32_on_cpu():
    assert TrainingConfig().precision == "auto"
    assert resolve_precision("auto", "cpu") == "fp32"
    for explicit in ("fp32", "bf16", "fp16"):
        assert TrainingConfig(precision=explicit).precision == explicit
        assert resolve_precision(explicit, "cpu") == explicit
    assert TrainingConfig().compile is False and TrainingConfig().attention == "auto"


def test_bad_precision_compile_and_attention_values_are_config_errors():
    from tunelab.core.config import validate_config

    raw = {
        "name": "x",
        "hypothesis": {
            "behaviour": "b",
            "rationale": "r",
            "expected_effect": "e",
            "primary_metric": "accuracy",
        },
        "guardrails": [],
        "data": {"source": {"format": "jsonl", "path": "x.jsonl"}},
        "model": {"path": "m"},
        "training": {"precision": "fp64", "compile": "maybe", "attention": "fast"},
    }
    with pytest.raises(ConfigError) as err:
        validate_config(raw, source="study.yaml")
    text = str(err.value)
    for field in ("training.precision", "training.compile", "training.attention"):
        assert field in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precision_auto_on_cuda_is_bf16_where_supported():
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert resolve_precision("auto", "cuda") == expected


def _study(tmp_path, tiny_llama_dir, **training):
    return write_email_study(
        tmp_path / "s",
        tiny_llama_dir,
        "compute-test",
        max_steps=2,
        eval_every_steps=2,
        checkpoint_every_steps=2,
        **training,
    )


def test_a_run_records_how_it_computes(tmp_path, tiny_llama_dir, capsys):
    study_dir = _study(tmp_path, tiny_llama_dir)
    code, out, err = run_cli(capsys, "train", "-s", study_dir)
    assert code == 0, err
    (run,) = Study.open(study_dir).list_runs()
    record = read_json(Study.open(study_dir).get_run(run.id).path("compute.json"))
    assert record["precision"]["requested"] == "auto"
    assert record["precision"]["used"] == "fp32" and "CPU" in record["precision"]["why"]
    assert record["compile"] == {"enabled": False, "blocks": 0}
    assert record["attention"] == "per_example" and record["packing_exact"] is True
    assert record["loss_route"] == "split" and record["cross_entropy"] == "fused"
    assert {r["route"] for r in record["attention_not_used"]} == {
        "flash_varlen",
        "torch_varlen",
        "flex",
    }


def test_compile_without_a_compiler_is_a_config_error_at_the_start(
    tmp_path, tiny_llama_dir, capsys
):
    """No C++ compiler for inductor: the run stops before its first step with a located error
    and a hint (exit 2), not a traceback from inside the compiled forward."""
    import torch._inductor.config as inductor_config

    study_dir = _study(tmp_path, tiny_llama_dir)
    # inductor's own patch: monkeypatch's undo deletes the entry, hiding it from later tests
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
            compute.check_compile("cpu")
        code, out, err = run_cli(capsys, "train", "-s", study_dir, "--set", "training.compile=true")
    assert code == 2
    assert "training.compile" in err and "C++ compiler" in err and "Traceback" not in err
    assert "training.compile: false" in err  # the hint
    (run,) = Study.open(study_dir).list_runs()
    assert (
        run.status == "failed" and not (Study.open(study_dir).get_run(run.id).dir / "DONE").exists()
    )


@pytest.mark.slow
def test_compiled_blocks_train_a_step_like_eager_ones(tiny_llama_dir):
    """torch.compile of the decoder blocks (inductor on CPU) runs a real optimizer step of the
    tiny LoRA Llama on packed rows of two different lengths (no recompilation needed: the packed
    attention stays outside the graphs), with the eager step's losses."""
    from helpers.throughput import examples, lora, tiny_llama
    from tunelab.stages.train.batches import DataOrder, StepSource
    from tunelab.stages.train.loop import (
        Loop,
        TrainState,
        build_optimizer,
        build_scheduler,
        train_loop,
    )

    compute.check_compile("cpu")

    def two_steps(compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = lora(tiny_llama())
        if compiled:
            assert compute.prepare_model(model, TrainingConfig(compile=True), "cpu") == 2
            assert compute.compiled_blocks(model) == 2
        cfg = TrainingConfig(micro_batch_size=3, grad_accum_steps=1, max_steps=2, lr=1e-2)
        data = examples(6, seed=3)
        source = StepSource(data, DataOrder(len(data), 0), 3, 1, 0, "causal_lm", True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg)
        loop = Loop(
            model, optimizer, build_scheduler(optimizer, cfg, 2), source, cfg, 2, "causal_lm"
        )
        rows: list[dict] = []
        train_loop(loop, TrainState(), [lambda state, row: rows.append(row)])
        after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return [r["loss"] for r in rows], after

    eager_losses, eager_params = two_steps(False)
    compiled_losses, compiled_params = two_steps(True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled_params.keys() == eager_params.keys()
    for name, p in eager_params.items():
        assert (compiled_params[name] - p).abs().max() <= 1e-5 * (1 + p.abs().max()), name
