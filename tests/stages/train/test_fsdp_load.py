"""FSDP's losses pinned, and sharded loading (the base read rank by rank, never whole).

The pinned losses are those of two CPU ranks (gloo, fp32, one thread each) on the tiny Llama
study of tests/helpers/distributed.py with a micro batch of 2 per rank, written down from the
loading path that gave every rank the whole base and broadcast rank 0's weights. Sharded
loading (the model built on the meta device, each rank reading only its rows of the base's
safetensors) must give these same numbers exactly: tolerance 0. As in tests/test_pin_losses.py
the literals hold on the CPU kind they were measured on; another kind prints its own set.
"""

from __future__ import annotations

import math

import pytest

from helpers.distributed import BASE_SETS, only_run_since, runs, tunelab, write_distributed_study
from tunelab.core.records import read_json, read_jsonl


@pytest.fixture(scope="module")
def study_root(tmp_path_factory, tiny_llama_dir):
    return write_distributed_study(tmp_path_factory.mktemp("dist-study"), tiny_llama_dir)


# step: (training loss, validation loss or None); step 0 holds the validation loss before training
PINNED_FSDP: dict[str, list[dict[int, tuple]]] = {
    "lora": [
        {  # AMD EPYC, AVX512
            0: (None, 6.209719440129798),
            1: (6.219576908991887, None),
            2: (6.218692995467276, 6.183011272760827),
            3: (6.196337142080631, None),
            4: (6.194931175595238, 6.169016680379552),
        },
    ],
    "full": [
        {  # AMD EPYC, AVX512
            0: (None, 6.209719440129798),
            1: (6.219576908991887, None),
            2: (5.805333839272553, 5.566631767693467),
            3: (5.584195694833432, None),
            4: (5.344389997209821, 5.2482156828632505),
        },
    ],
}


def losses(run_dir) -> dict[int, tuple]:
    return {
        r["step"]: (r.get("loss"), r.get("val_loss")) for r in read_jsonl(run_dir / "metrics.jsonl")
    }


def fsdp_run(root, method: str, *extra: str):
    before = runs(root)
    out = tunelab("train", "-s", root, "--nproc", 2, "--strategy", "fsdp",
                  "--set", BASE_SETS[0], "--set", f"adaptation.method={method}",
                  "--set", "training.packing=false", *extra)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return only_run_since(root, before)


@pytest.mark.distributed
@pytest.mark.parametrize("method", sorted(PINNED_FSDP))
def test_fsdp_losses_are_the_pinned_ones(study_root, method):  # noqa: F811
    run_dir = fsdp_run(study_root, method)
    got = losses(run_dir)
    assert got in PINNED_FSDP[method], f"FSDP losses pinned for no CPU kind measured: {got}"
    assert read_json(run_dir / "status.json")["status"] == "completed"
    # each rank read its own rows: together the weights once, each about half
    load = read_json(run_dir / "compute.json")["weights_load"]
    total = weight_bytes(read_json(run_dir / "config.json")["config"]["model"]["path"])
    assert load["mode"] == "sharded" and sum(load["bytes_read_per_rank"]) == total
    assert max(load["bytes_read_per_rank"]) < 0.55 * total


def weight_bytes(folder) -> int:
    """The bytes of every tensor in a model folder's safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    total = 0
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                total += math.prod(t.get_shape()) * 4  # fp32 here
    return total


# ------------------------------------------------------------------ pieces, in this process


def test_rows_of_is_fsdps_split():
    import torch

    from tunelab.stages.train.sharded_load import rows_of

    for n in (0, 1, 3, 7, 8, 49152):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.chunk(torch.arange(n), world) if n else []
            for r in range(world):
                start, end = rows_of(n, r, world)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(start, end)) == want, (n, world, r)


def test_base_key_strips_peft_wrapping():
    from tunelab.stages.train.sharded_load import base_key

    assert base_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_key("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert base_key("model.norm.weight") == "model.norm.weight"


@pytest.mark.parametrize("method", ["lora", "full"])
def test_skeleton_holds_no_weights_and_the_adapter_of_a_whole_load(
    tmp_path, tiny_llama_dir, method
):
    """The skeleton's base parameters have no storage; LoRA's matrices equal, bit for bit,
    those of the model loaded whole and adapted from the same seed."""
    import torch

    from helpers import write_email_study
    from tunelab.core.study import Study
    from tunelab.lib.models import resolve_base
    from tunelab.stages.train.build import build_model
    from tunelab.stages.train.parallel import FSDP

    root = write_email_study(tmp_path / "s", tiny_llama_dir, "skeleton", max_steps=4,
                             eval_every_steps=2, checkpoint_every_steps=2)  # fmt: skip
    study = Study.open(root, [f"adaptation.method={method}"])
    base = resolve_base(study)

    class Sharded:  # what build_model asks of a strategy: only whether it loads sharded
        loads_sharded = FSDP.loads_sharded

    whole, audit_whole = build_model(base, study.config, None, torch.device("cpu"))
    skeleton, audit_skel = build_model(base, study.config, None, torch.device("cpu"), Sharded())
    assert audit_skel == audit_whole
    params = dict(skeleton.named_parameters())
    real = {n: p for n, p in params.items() if p.untyped_storage().nbytes() > p.element_size()}
    if method == "full":
        assert not real  # nothing loaded: every weight waits for its shard
    else:
        assert real and all("lora_" in n for n in real)
        want = dict(whole.named_parameters())
        assert all(torch.equal(p, want[n]) for n, p in real.items())
    assert params.keys() == dict(whole.named_parameters()).keys()
    for (n, b), (_, w) in zip(skeleton.named_buffers(), whole.named_buffers(), strict=True):
        assert torch.equal(b, w), n  # rotary frequencies computed, not loaded


@pytest.mark.slow  # about 13 s
def test_validate_refuses_qlora_under_fsdp(study_root):  # noqa: F811
    out = tunelab("validate", "-s", study_root, "--strategy", "fsdp", "--nproc", 2,
                  "--set", "adaptation.method=qlora")  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "qlora cannot run under --strategy fsdp" in out.stderr
    assert "quantization state" in out.stderr and "--strategy ddp" in out.stderr
    ok = tunelab("validate", "-s", study_root, "--strategy", "fsdp", "--nproc", 2)
    assert ok.returncode == 0, ok.stderr
