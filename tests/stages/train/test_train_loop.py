"""The training loop core on tiny models: loss normalization, data order, schedules, precision,
checkpoint round trips. Stage tests (real runs, kills, statuses) are in test_train_run.py."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_cli, write_topic_study
from tunelab.core.config_training import TrainingConfig
from tunelab.core.errors import ConfigError
from tunelab.stages.train import checkpoint as ckpt
from tunelab.stages.train.batches import DataOrder, Position, StepSource, collate, count_loss_tokens
from tunelab.stages.train.loop import (
    InvalidRun,
    Loop,
    TrainState,
    build_optimizer,
    build_scheduler,
    loss_sum,
    lr_factor,
    make_grad_scaler,
    train_loop,
    validation_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def causal_examples(n: int = 16, seed: int = 0) -> list[dict]:
    """Examples of unequal lengths with prompts of unequal lengths (labels -100 on the prompt)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 40)
        prompt = rng.randint(1, length - 2)
        ids = [rng.randint(3, 400) for _ in range(length)]
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def encoder_examples(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "input_ids": [2] + [rng.randint(5, 400) for _ in range(rng.randint(3, 30))] + [3],
            "label": rng.randint(0, 2),
        }
        for _ in range(n)
    ]


def llama(path, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, **kw)


def bert(path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(  # no dropout: comparable runs
        path, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )


def one_step(model, examples, arch, micro, accum, packing=False, **cfg_kw):
    """Run one optimizer step with lr 0; return (metrics row, gradients before the update)."""
    cfg = TrainingConfig(micro_batch_size=micro, grad_accum_steps=accum, max_steps=1, **cfg_kw)
    source = StepSource(examples, DataOrder(len(examples), 0), micro, accum, 0, arch, packing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(opt, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(keep_grads)
    rows = []
    loop = Loop(model, optimizer, build_scheduler(optimizer, cfg, 1), source, cfg, 1, arch)
    train_loop(loop, TrainState(), [lambda s, r: rows.append(r)])
    return rows[0], grads


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def progress_of(state):
    """The progress a checkpoint's state.json keeps, as the trainer's saver writes it."""
    return {
        "position": state.position.to_dict(),
        "tokens_seen": state.tokens_seen,
        "loss_tokens_seen": state.loss_tokens_seen,
        "last_loss": state.last_loss,
    }


@pytest.mark.parametrize("packing", [False, True])
def test_accumulation_4x2_equals_8x1_causal(tiny_llama_dir, packing):
    examples = causal_examples(8)
    assert len({len(e["input_ids"]) for e in examples}) > 4, "lengths must differ"
    row_8x1, g_8x1 = one_step(llama(tiny_llama_dir), examples, "causal_lm", 8, 1, packing)
    row_4x2, g_4x2 = one_step(llama(tiny_llama_dir), examples, "causal_lm", 4, 2, packing)
    row_1x8, g_1x8 = one_step(llama(tiny_llama_dir), examples, "causal_lm", 1, 8, packing)
    assert row_8x1["loss_tokens"] == row_4x2["loss_tokens"] == row_1x8["loss_tokens"]
    assert row_8x1["loss"] == pytest.approx(row_4x2["loss"], abs=1e-6)
    assert row_8x1["loss"] == pytest.approx(row_1x8["loss"], abs=1e-6)
    assert max_diff(g_8x1, g_4x2) < 1e-6
    assert max_diff(g_8x1, g_1x8) < 1e-6
    # A per-micro-batch mean (the common mistake) would differ here: prove the test can fail.
    model = llama(tiny_llama_dir)
    means = []
    for k in (0, 4):
        batch = collate(examples[k : k + 4], 0, "causal_lm")
        means.append(loss_sum(model, batch, "causal_lm").item() / count_loss_tokens(batch))
    assert abs(sum(means) / 2 - row_8x1["loss"]) > 1e-4


def test_loss_is_token_mean_cross_entropy(tiny_llama_dir):
    """The logged loss equals the mean over loss tokens of transformers' own cross-entropy."""
    examples = causal_examples(6)
    model = llama(tiny_llama_dir)
    row, _ = one_step(model, examples, "causal_lm", 3, 2)
    order = DataOrder(len(examples), 0).take(Position(), 6)[0]
    batch = collate([examples[i] for i in order], 0, "causal_lm")
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
    assert row["loss"] == pytest.approx(out.loss.item(), abs=1e-5)


def test_packed_batch_equals_padded(tiny_llama_dir):
    examples = causal_examples(5)
    model = llama(tiny_llama_dir)
    padded = collate(examples, 0, "causal_lm", packing=False)
    packed = collate(examples, 0, "causal_lm", packing=True)
    assert packed["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples))
    assert count_loss_tokens(packed) == count_loss_tokens(padded)
    with torch.no_grad():
        a = loss_sum(model, padded, "causal_lm").item()
        b = loss_sum(model, packed, "causal_lm").item()
    assert a == pytest.approx(b, rel=1e-5)


def test_accumulation_equivalence_encoder(tiny_bert_dir):
    """Encoder classification: every example is one loss token."""
    examples = encoder_examples(8)
    (r1, g1), (r2, g2) = (
        one_step(bert(tiny_bert_dir), examples, "encoder", 8, 1),
        one_step(bert(tiny_bert_dir), examples, "encoder", 4, 2),
    )
    assert r1["loss_tokens"] == r2["loss_tokens"] == 8
    assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-6)
    assert max_diff(g1, g2) < 1e-6


def test_data_order_is_seeded_and_crosses_epochs():
    order = DataOrder(5, seed=3)
    first, pos = order.take(Position(), 4)
    second, pos = order.take(pos, 4)
    assert pos == Position(1, 3)
    assert sorted(first + second[:1]) == list(range(5))  # epoch 0 is a permutation
    assert second[1:] == DataOrder(5, seed=3).permutation(1)[:3]
    assert order.permutation(0) != order.permutation(1)
    # taking from a saved position gives what an uninterrupted reader gets
    again, _ = DataOrder(5, seed=3).take(Position(0, 4), 4)
    assert again == second


def test_schedules_warmup_and_decay():
    cfg = TrainingConfig(warmup_steps=4, schedule="linear")
    f = [lr_factor(s, cfg, 20) for s in range(20)]
    assert f[0] == pytest.approx(0.2) and f[4] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:5], f[1:5], strict=False))
    assert all(a > b for a, b in zip(f[4:], f[5:], strict=False)) and f[-1] > 0
    cos = TrainingConfig(warmup_steps=0, schedule="cosine")
    c = [lr_factor(s, cos, 10) for s in range(10)]
    assert c[0] == 1.0 and c[5] == pytest.approx(0.5) and 0 < c[-1] < 0.05
    const = TrainingConfig(warmup_steps=2, schedule="constant")
    assert [lr_factor(s, const, 10) for s in (0, 1, 2, 9)] == pytest.approx([1 / 3, 2 / 3, 1, 1])


def test_optimizers_by_name():
    params = [torch.nn.Parameter(torch.ones(3))]
    adamw = build_optimizer(params, TrainingConfig(optimizer="AdamW", lr=1e-3, weight_decay=0.1))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["weight_decay"] == 0.1
    sgd = build_optimizer(params, TrainingConfig(optimizer="SGD", lr=0.5))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 0.5
    assert isinstance(
        build_optimizer(params, TrainingConfig(optimizer="Adagrad")), torch.optim.Adagrad
    )
    with pytest.raises(ConfigError, match="unknown optimizer 'Adamw'") as exc:
        build_optimizer(params, TrainingConfig(optimizer="Adamw"))
    assert "AdamW" in exc.value.hint


def test_validate_refuses_an_unknown_optimizer(tmp_path, capsys):
    root = write_topic_study(tmp_path / "s", tmp_path / "base", "optimizer")
    assert run_cli(capsys, "validate", "-s", root, "--set", "training.optimizer=SGD")[0] == 0
    code, _, err = run_cli(capsys, "validate", "-s", root, "--set", "training.optimizer=Adamw")
    assert code == 2, err
    assert "training.optimizer: unknown optimizer 'Adamw'" in err and "AdamW" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_validate_warns_that_this_machine_cannot_train_fp16(tmp_path, capsys):
    root = write_topic_study(tmp_path / "s", tmp_path / "base", "fp16")
    code, out, _ = run_cli(capsys, "validate", "-s", root, "--set", "training.precision=fp16")
    assert code == 0 and "fp16 needs a CUDA device" in out and "on this machine" in out
    code, out, _ = run_cli(capsys, "validate", "-s", root, "--set", "training.precision=bf16")
    assert code == 0 and "CUDA" not in out


def test_fp16_refused_on_cpu_and_bf16_autocast_trains(tiny_llama_dir):
    with pytest.raises(ConfigError, match="fp16 needs a CUDA"):
        make_grad_scaler("fp16", torch.device("cpu"))
    row, grads = one_step(
        llama(tiny_llama_dir), causal_examples(4), "causal_lm", 2, 2, precision="bf16"
    )
    fp32, _ = one_step(llama(tiny_llama_dir), causal_examples(4), "causal_lm", 2, 2)
    assert row["loss"] == pytest.approx(fp32["loss"], rel=2e-2) and row["loss"] != fp32["loss"]
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_activation_checkpointing_same_gradients(tiny_llama_dir):
    from tunelab.lib.models import enable_activation_checkpointing

    examples = causal_examples(4)
    plain, g_plain = one_step(llama(tiny_llama_dir), examples, "causal_lm", 2, 2)
    model = llama(tiny_llama_dir)
    enable_activation_checkpointing(model)
    assert model.is_gradient_checkpointing
    ckpted, g_ckpt = one_step(model, examples, "causal_lm", 2, 2)
    assert ckpted["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert max_diff(g_plain, g_ckpt) < 1e-6


def test_nan_loss_is_invalid(tiny_llama_dir):
    model = llama(tiny_llama_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    examples = causal_examples(4)
    examples[0]["input_ids"][0] = 5
    with pytest.raises(InvalidRun, match="non-finite loss at step 1"):
        one_step(model, examples, "causal_lm", 4, 1)


def test_no_loss_tokens_is_invalid(tiny_llama_dir):
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}] * 2
    with pytest.raises(InvalidRun, match="no loss tokens"):
        one_step(llama(tiny_llama_dir), examples, "causal_lm", 2, 1)


def test_validation_loss_token_normalized(tiny_llama_dir):
    examples = causal_examples(6)
    model = llama(tiny_llama_dir)
    model.train()
    batches_a = [collate(examples[:3], 0, "causal_lm"), collate(examples[3:], 0, "causal_lm")]
    batches_b = [collate(examples, 0, "causal_lm")]
    a, n_a = validation_loss(model, batches_a, "causal_lm")
    b, n_b = validation_loss(model, batches_b, "causal_lm")
    assert n_a == n_b and a == pytest.approx(b, abs=1e-6)
    assert model.training  # back in training mode after evaluating


def test_optimizer_state_round_trip_without_pickle():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.8, 0.95))
    p.grad = torch.randn(4, 3)
    opt.step()
    tensors, rest = ckpt.flatten_optimizer(opt.state_dict())
    tensors = {k: v.clone() for k, v in tensors.items()}  # as if read back from the file
    assert set(tensors) == {"0.step", "0.exp_avg", "0.exp_avg_sq"}
    import json

    rest = json.loads(json.dumps(rest))  # JSON survives
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = torch.optim.AdamW([q], lr=5.0)
    opt2.load_state_dict(ckpt.unflatten_optimizer(tensors, rest))
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95) and opt2.param_groups[0]["lr"] == 1e-2
    g = torch.randn(4, 3)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)


def test_rng_round_trip():
    import numpy as np

    tensors, rest = ckpt.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    ckpt.restore_rng(tensors, rest)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_checkpoint_round_trip_is_bit_exact_with_dropout(tiny_llama_dir, tmp_path):
    """In one process: 8 straight steps == 3 steps, checkpoint, fresh objects, load, 5 steps."""
    examples = causal_examples(20)
    cfg = TrainingConfig(
        micro_batch_size=3,
        grad_accum_steps=2,
        max_steps=8,
        lr=1e-2,
        warmup_steps=2,
        schedule="cosine",
    )

    def build():
        model = llama(tiny_llama_dir, attention_dropout=0.2)  # dropout consumes the torch RNG
        opt = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        sched = build_scheduler(opt, cfg, 8)
        src = StepSource(examples, DataOrder(len(examples), 0), 3, 2, 0, "causal_lm", True)
        return model, opt, sched, Loop(model, opt, sched, src, cfg, 8, "causal_lm")

    model, _, _, loop = build()
    straight = []
    train_loop(loop, TrainState(), [lambda s, r: straight.append(r["loss"])])

    class Stop(Exception):
        pass

    m2, o2, s2, loop2 = build()
    resumed = []

    def stop_at_3(state, row):
        resumed.append(row["loss"])
        if state.step == 3:
            ckpt.save_checkpoint(
                tmp_path,
                3,
                model=m2,
                optimizer=o2,
                scheduler=s2,
                scaler=None,
                method="full",
                state=progress_of(state),
            )
            raise Stop

    with pytest.raises(Stop):
        train_loop(loop2, TrainState(), [stop_at_3])
    torch.manual_seed(1234), random.seed(1234)  # disturb every generator
    m3, o3, s3, loop3 = build()
    path = ckpt.latest_checkpoint(tmp_path)
    assert path.name == "step-000003" and (path / "model" / "model.safetensors").exists()
    saved = ckpt.load_checkpoint(path, model=m3, optimizer=o3, scheduler=s3, method="full")
    state = TrainState(step=saved.step, position=Position.from_dict(saved.position))
    train_loop(loop3, state, [lambda s, r: resumed.append(r["loss"])])
    assert resumed == straight
    for (n, a), b in zip(model.named_parameters(), m3.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_checkpoint_files_verified_and_pruned(tiny_llama_dir, tmp_path):
    model = llama(tiny_llama_dir)
    cfg = TrainingConfig(max_steps=4)
    opt = build_optimizer(list(model.parameters()), cfg)
    sched = build_scheduler(opt, cfg, 4)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(
            tmp_path,
            step,
            model=model,
            optimizer=opt,
            scheduler=sched,
            scaler=None,
            method="full",
            state=progress_of(TrainState(step=step)),
        )
    (tmp_path / ".step-000004.tmp-dead").mkdir()  # a save cut by a kill
    ckpt.mark_final(tmp_path, 1)
    removed = ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in removed] == ["step-000002"]
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path)] == ["step-000001", "step-000003"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000003"
    assert ckpt.remove_stale_temp(tmp_path) and not (tmp_path / ".step-000004.tmp-dead").exists()
    # a changed file is detected
    target = tmp_path / "step-000003" / "optimizer.json"
    target.write_text(target.read_text().replace("0.9", "0.8"))
    from tunelab.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
        ckpt.read_checkpoint_state(tmp_path / "step-000003")
    (tmp_path / "step-000003" / "rng.safetensors").unlink()
    found = ckpt.check_checkpoint_files(tmp_path / "step-000003")
    assert (found["changed"], found["missing"], found["ok"]) == (
        ["optimizer.json"],
        ["rng.safetensors"],
        False,
    )
    assert ckpt.check_checkpoint_files(tmp_path / "step-000001")["ok"]
    (tmp_path / "step-000001" / "DONE").unlink()
    assert ckpt.check_checkpoint_files(tmp_path / "step-000001")["missing"] == ["DONE"]
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        ckpt.read_checkpoint_state(tmp_path / "step-000001")


def test_checking_a_checkpoint_imports_no_torch():
    """verify's parent process and export check checkpoints without paying torch's import."""
    code = (
        "import sys, tunelab.stages.train.checkpoint, tunelab.stages.verify.stage; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    src = str(Path(__file__).resolve().parents[3] / "src")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": src})


def test_lora_with_activation_checkpointing_trains_every_adapter_tensor(tiny_llama_dir):
    """With checkpointing on a frozen base, every LoRA tensor still gets a gradient."""
    from tunelab.core.config_training import AdaptationConfig
    from tunelab.lib.models import adapt, enable_activation_checkpointing

    model, _ = adapt(llama(tiny_llama_dir), AdaptationConfig(method="lora"), "causal_lm")
    enable_activation_checkpointing(model)
    _, grads = one_step(model, causal_examples(4), "causal_lm", 2, 2)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    assert set(grads) == set(lora)
    assert all(grads[n].abs().sum() > 0 for n in lora if "lora_B" in n)  # A's is 0 at step 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_on_cuda(tiny_llama_dir, precision):
    examples = causal_examples(8)
    cfg = TrainingConfig(micro_batch_size=2, grad_accum_steps=2, max_steps=3, precision=precision)
    model = llama(tiny_llama_dir).cuda()
    opt = build_optimizer(list(model.parameters()), cfg)
    scaler = make_grad_scaler(precision, torch.device("cuda"))
    assert scaler.is_enabled() == (precision == "fp16")
    source = StepSource(examples, DataOrder(8, 0), 2, 2, 0, "causal_lm", True)
    loop = Loop(
        model, opt, build_scheduler(opt, cfg, 3), source, cfg, 3, "causal_lm", scaler=scaler
    )
    rows = []
    train_loop(loop, TrainState(), [lambda s, r: rows.append(r)])
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
