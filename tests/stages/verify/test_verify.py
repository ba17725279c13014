"""tunelab verify: a real checkpoint reproduces its predictions in a fresh process; a tampered
one (one byte, or edited weights with rewritten hashes) fails with a clear reason."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from helpers import run_cli, tree_hashes
from helpers.verify import trained_study
from tunelab.core.run_parts import RunEnv
from tunelab.stages.verify.checks import compare_env, compare_predictions, env_message

# ---------------------------------------------------------------- a small trained study


@pytest.fixture(scope="module")
def lora_study(tmp_path_factory, tiny_bert_dir):
    """A trained and evaluated LoRA run on the tiny BERT (built once for this file)."""
    return trained_study(tmp_path_factory.mktemp("verify") / "s", tiny_bert_dir)


# ---------------------------------------------------------------- pure comparisons


def _row(i, pred, scores=None, raw=None):
    return {
        "id": i,
        "gold": "a",
        "prediction": pred,
        "raw_output": raw if raw is not None else pred,
        "correct": pred == "a",
        "scores": scores,
    }


def test_compare_predictions_identical_and_changed():
    rec = [_row("x", "a", {"a": 0.9, "b": 0.1}), _row("y", "b", {"a": 0.2, "b": 0.8})]
    same = compare_predictions(rec, [dict(r) for r in rec], atol=1e-4)
    assert same["ok"] and same["matched"] == 2 and same["max_score_diff"] == 0.0

    drift = [_row("x", "a", {"a": 0.90005, "b": 0.09995}), rec[1]]
    assert compare_predictions(rec, drift, atol=1e-4)["ok"]
    too_far = [_row("x", "a", {"a": 0.8, "b": 0.2}), rec[1]]
    cmp = compare_predictions(rec, too_far, atol=1e-4)
    assert not cmp["ok"] and cmp["mismatched"] == 1
    assert cmp["mismatches"][0]["field"] == "scores"
    assert cmp["mismatches"][0]["max_abs_diff"] == pytest.approx(0.1)

    flipped = [_row("x", "b", {"a": 0.9, "b": 0.1}), rec[1]]
    cmp = compare_predictions(rec, flipped, atol=1e-4)
    fields = {m["field"] for m in cmp["mismatches"]}
    assert not cmp["ok"] and {"prediction", "raw_output", "correct"} <= fields

    missing = compare_predictions(rec, rec[:1], atol=1e-4)
    assert not missing["ok"] and missing["missing"] == ["y"]
    assert not compare_predictions([], [], atol=1e-4)["ok"]  # nothing reproduced is no pass


def test_tolerance_follows_the_precision_the_run_used(tmp_path):
    """precision auto: the run's compute.json says what it trained in; without one, auto is
    resolved on this machine (fp32 on CPU)."""
    from tunelab.stages.verify.stage import _used_precision

    record = tmp_path / "compute.json"
    assert _used_precision("auto", record) == "fp32"
    record.write_text(json.dumps({"precision": {"requested": "auto", "used": "bf16"}}))
    assert _used_precision("auto", record) == "bf16"


def test_generated_outputs_compared_exactly():
    rec = [_row("x", {"sender": "a@b"}, raw='{"sender": "a@b"}')]
    rec[0].pop("scores")
    other = [dict(rec[0], raw_output='{"sender":  "a@b"}')]
    cmp = compare_predictions(rec, other, atol=1.0)
    assert not cmp["ok"] and cmp["mismatches"][0]["field"] == "raw_output"


def test_environment_differences_are_named():
    from tunelab.core.env import capture_env

    env = RunEnv.of("env.json", capture_env())
    assert compare_env(env, env) == []
    other = json.loads(json.dumps(env.raw))
    other["torch"] = "2.0.0"
    other["backend"] = "cuda"
    other["cuda"] = "12.1"
    other["gpus"] = [{"name": "NVIDIA H100 80GB HBM3"}]
    diff = {d["field"]: d for d in compare_env(RunEnv.of("env.json", other), env)}
    assert set(diff) == {"torch", "backend", "cuda", "devices"}
    assert diff["devices"]["recorded"] == ["NVIDIA H100 80GB HBM3"]
    msg = env_message("train-1", list(diff.values()))
    assert "torch 2.0.0 -> " in msg and "tunelab smoke" in msg and "tunelab baseline" in msg
    assert env_message("train-1", []) is None
    assert compare_env(None, env)[0]["field"] == "env.json"


# ---------------------------------------------------------------- on a real checkpoint


@pytest.mark.slow
def test_verify_passes_then_catches_a_changed_byte(lora_study, capsys):
    root, run_id = lora_study
    code, out, err = run_cli(capsys, "verify", run_id, "-s", root, "--json")
    assert code == 0, (out, err)
    rec = json.loads(out)
    assert rec["passed"] and rec["checkpoint"]["ok"] and rec["environment"]["same"]
    assert rec["predictions"]["n"] == rec["predictions"]["matched"] > 0
    assert rec["model_run"] == run_id and rec["evaluation_run"] != run_id  # the eval run's rows
    first = root / "records" / "runs" / run_id / "verify-1.json"
    assert json.loads(first.read_text())["passed"] is True
    # the table a user reads names the new record by its whole path, even at 80 columns
    table = root.parent / "table"
    shutil.copytree(root, table)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "80")
        code, out, err = run_cli(capsys, "verify", run_id, "-s", table)
    assert code == 0, err
    assert f"record: {table / 'records' / 'runs' / run_id / 'verify-2.json'}" in out
    assert "…" not in out

    # One byte of the adapter changed: refused by hash before anything is loaded.
    work = root.parent / "byte"
    shutil.copytree(root, work)
    ckpt = work / "records" / "runs" / run_id / "checkpoints" / "final"
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work, "--json")
    assert code == 1, (out, err)
    rec = json.loads(out)
    assert not rec["passed"] and rec["checkpoint"]["changed"] == [
        "adapter/adapter_model.safetensors"
    ]
    assert "does not match the sha256 recorded" in rec["reason"]
    # no fresh process ran: the environment is still recorded, this process's own
    assert rec["environment"]["same"] and rec["environment"]["torch"]
    assert rec["predictions"] is None
    # both records kept: the earlier pass is never overwritten
    names = sorted(p.name for p in (work / "records" / "runs" / run_id).glob("verify-*.json"))
    assert names == ["verify-1.json", "verify-2.json"]


@pytest.mark.slow
def test_verify_compares_the_fresh_process_environment(lora_study, capsys):
    """The environment compared is the one of the process that re-evaluated: a run recorded on
    another torch is reproduced here, and the record names the difference."""
    root, run_id = lora_study
    work = root.parent / "other-torch"
    shutil.copytree(root, work)
    env_path = work / "records" / "runs" / run_id / "env.json"
    env = json.loads(env_path.read_text())
    env["torch"] = "1.0.0-elsewhere"
    env_path.write_text(json.dumps(env))
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work, "--json")
    assert code == 0, (out, err)
    rec = json.loads(out)
    assert rec["passed"] and not rec["environment"]["same"]
    assert any("torch" in json.dumps(d) for d in rec["environment"]["differences"])
    assert rec["environment"]["torch"] != "1.0.0-elsewhere"


@pytest.mark.slow
def test_verify_catches_edited_weights_with_rewritten_hashes(lora_study, capsys):
    """Someone edits the adapter and rewrites state.json's hashes: the predictions give it away."""
    from safetensors.torch import load_file, save_file

    from tunelab.core.hashing import sha256_file

    root, run_id = lora_study
    work = root.parent / "edited"
    shutil.copytree(root, work)
    ckpt = (work / "records" / "runs" / run_id / "checkpoints" / "final").resolve()
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    head = [k for k in tensors if "classifier" in k and k.endswith("weight")]
    assert head, f"the classification head must be in the adapter: {sorted(tensors)}"
    tensors[head[0]] = tensors[head[0]] * -3.0
    save_file(tensors, str(weights), metadata={"format": "pt"})
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["adapter/adapter_model.safetensors"] = sha256_file(weights)
    (ckpt / "state.json").write_text(json.dumps(state))

    code, out, err = run_cli(capsys, "verify", run_id, "-s", work, "--json")
    assert code == 1, (out, err)
    rec = json.loads(out)
    assert rec["checkpoint"]["ok"]  # the hashes were made to agree ...
    assert not rec["passed"] and rec["predictions"]["mismatched"] > 0  # ... the outputs do not
    assert "not reproduced" in rec["reason"]
    assert rec["predictions"]["mismatches"][0]["field"] in ("prediction", "scores")


def test_verify_refuses_what_it_cannot_verify(lora_study, capsys):
    root, run_id = lora_study
    code, _, err = run_cli(capsys, "verify", "no-such-run", "-s", root)
    assert code == 2 and "not found" in err


@pytest.mark.processes
def test_verify_records_a_model_that_cannot_be_reloaded(lora_study, capsys):
    """The fresh process cannot load the run's model (here: the recorded base identity no longer
    matches the base folder): a failed verification with the child's reason, not a crash."""
    root, run_id = lora_study
    work = root.parent / "base-changed"
    shutil.copytree(root, work)
    config = work / "records" / "runs" / run_id / "config.json"
    record = json.loads(config.read_text())
    record["base_model"]["sha256"] = "0" * 64
    config.write_text(json.dumps(record))
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work, "--json")
    assert code == 1, (out, err)
    rec = json.loads(out)
    assert not rec["passed"] and rec["predictions"] is None
    assert "could not be reloaded" in rec["reason"] and "base model" in rec["reason"]


def test_verify_refuses_a_drifted_study(lora_study, capsys):
    root, run_id = lora_study
    work = root.parent / "drifted"
    shutil.copytree(root, work)
    raw = yaml.safe_load((work / "study.yaml").read_text())
    raw["evaluation"]["batch_size"] = 3
    (work / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    before = tree_hashes(work / "records" / "runs")
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work)
    assert code == 2 and "evaluation.batch_size" in err
    assert tree_hashes(work / "records" / "runs") == before  # nothing recorded


def test_a_damaged_record_stops_verify_naming_it(lora_study, capsys):
    """A run's compute.json without the precision it used, or an evaluation whose `merge` is
    not an object, stops verify with exit 2 naming the file and the field; nothing is
    recorded."""
    root, run_id = lora_study
    work = root.parent / "damaged"
    shutil.copytree(root, work)
    run_dir = work / "records" / "runs" / run_id
    before = tree_hashes(work / "records" / "runs")
    compute = run_dir / "compute.json"
    written = compute.read_bytes()
    record = json.loads(written)
    compute.write_text(json.dumps({**record, "precision": {"requested": "auto"}}))
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work)
    assert code == 2, (out, err)
    assert "compute.json: precision: field 'used' is missing" in err
    compute.write_bytes(written)
    (metrics,) = (work / "records" / "runs").glob("eval-*/metrics-validation.json")
    written = metrics.read_bytes()
    metrics.write_text(json.dumps({**json.loads(written), "merge": "yes"}))
    code, out, err = run_cli(capsys, "verify", run_id, "-s", work)
    assert code == 2, (out, err)
    assert "metrics-validation.json: field 'merge' is 'yes', not an object" in err
    metrics.write_bytes(written)
    assert tree_hashes(work / "records" / "runs") == before  # nothing recorded
