"""Foundation: init, validate, register/amend, the ledger, runs, env."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import yaml

from helpers import fill_hypothesis, run_cli, tree_hashes
from tunelab.core.config import load_config, validate_config
from tunelab.core.errors import ConfigError, HypothesisError, RunError
from tunelab.core.study import Study
from tunelab.stages.hypothesis import stage as hypothesis_stage
from tunelab.stages.hypothesis.stage import require_hypothesis


@pytest.mark.parametrize("task", ["classification", "format", "extraction"])
def test_init_writes_valid_commented_config(tmp_path, capsys, task):
    code, out, _ = run_cli(capsys, "init", tmp_path / "s", "--task", task)
    assert code == 0
    text = (tmp_path / "s" / "study.yaml").read_text()
    assert "# " in text and "guardrails:" in text and "budget:" in text
    cfg = load_config(tmp_path / "s" / "study.yaml")
    assert cfg.task.kind == task
    assert cfg.guardrails, "the template carries at least one guardrail"


def test_init_refuses_existing(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    code, _, err = run_cli(capsys, "init", tmp_path / "s")
    assert code == 2 and "already exists" in err


def test_config_paths_resolve_assets_home_and_study(tmp_path, bbc_dir):
    from tunelab.core.errors import ModelError
    from tunelab.core.study import resolve_path

    assert resolve_path("asset:bbc/tech") == bbc_dir / "tech"
    assert resolve_path("data/x.jsonl", tmp_path) == tmp_path / "data" / "x.jsonl"
    assert resolve_path("/abs/x", tmp_path) == Path("/abs/x")
    assert resolve_path("~/x") == Path.home() / "x"
    with pytest.raises(ModelError, match="unknown asset 'nope'"):
        resolve_path("asset:nope/x")


def test_validate_reports_every_problem_at_once(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["training"]["lr"] = "fast"
    raw["training"]["micro_batch_size"] = 0
    raw["data"]["splits"]["train"] = 0.9  # sums to 1.1
    raw["adaptation"]["rnak"] = 4
    path.write_text(yaml.safe_dump(raw))
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s")
    assert code == 2
    for fragment in (
        "training.lr",
        "training.micro_batch_size",
        "data.splits",
        "adaptation.rnak",
        "unknown key",
    ):
        assert fragment in err, fragment
    assert "found" in err and "hint:" in err


def test_a_look_alike_key_is_shown_escaped_with_its_letters_named(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["adaptation"]["r\u0430nk"] = 4  # a Cyrillic a
    raw["training"]["micro_batchsize"] = 2
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s")
    text = " ".join(err.split())
    assert code == 2
    assert (
        "adaptation.r\\u0430nk: unknown key (not ASCII: U+0430 CYRILLIC SMALL LETTER A at 2;"
        in text
    )
    assert "did you mean adaptation.rank?" in text and "r\u0430nk" not in text
    assert "training.micro_batchsize: unknown key (did you mean training.micro_batch_size?" in text


def test_keys_other_tools_spell_otherwise_are_named_with_tunelab_s_own(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    sets = [
        "adaptation.quantization.bits=4",
        "adaptation.lora_r=16",
        "training.learning_rate=1e-4",
        "training.gradient_accumulation_steps=4",
    ]
    code, _, err = run_cli(
        capsys, "validate", "-s", tmp_path / "s", *[a for s in sets for a in ("--set", s)]
    )
    flat = " ".join(err.split())
    assert code == 2
    for fragment in (
        "adaptation.quantization.bits: unknown key (QLoRA stores the base in 4 bits only",
        "adaptation.lora_r: unknown key (the LoRA rank is adaptation.rank)",
        "training.learning_rate: unknown key (it is training.lr)",
        "training.gradient_accumulation_steps: unknown key (it is training.grad_accum_steps)",
    ):
        assert fragment in flat, (fragment, err)


def test_set_overrides_and_bad_set(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    cfg = load_config(tmp_path / "s" / "study.yaml", ["training.lr=1e-3", "adaptation.rank=16"])
    assert cfg.training.lr == 1e-3 and cfg.adaptation.rank == 16
    with pytest.raises(ConfigError, match="no '='"):
        load_config(tmp_path / "s" / "study.yaml", ["training.lr"])
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s", "--set", "training.nope=1")
    assert code == 2 and "training.nope" in err


def test_text_for_a_section_is_not_told_to_drop_quotes(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    args = ("validate", "-s", tmp_path / "s", "--set")
    code, _, err = run_cli(capsys, *args, "adaptation.quantization=nf4")
    assert code == 2 and "adaptation.quantization" in err and "found text" in err
    assert "without quotes" not in err
    code, _, err = run_cli(capsys, *args, "training.seed='3'")
    assert code == 2 and "write 3 without quotes" in err


def test_template_names_qlora_and_its_settings():
    from tunelab.stages.hypothesis.template import render_study_yaml

    text = render_study_yaml("classification", "x")
    assert "qlora" in text and "AdamW8bit" in text
    text = text.replace("method: lora ", "method: qlora").replace(
        "# quantization:", "quantization:"
    )
    q = validate_config(yaml.safe_load(text)).adaptation.quantization
    assert (q.quant_type, q.double_quant, q.compute_dtype) == ("nf4", True, "bf16")


def test_contradictions_rejected():
    base = yaml.safe_load(
        __import__("tunelab.stages.hypothesis.template", fromlist=["x"]).render_study_yaml(
            "format", "x"
        )
    )
    base["task"]["regex"] = "^.*$"  # both json_schema and regex
    with pytest.raises(ConfigError, match="exactly one of"):
        validate_config(base)


def test_broken_yaml_names_line(tmp_path):
    p = tmp_path / "study.yaml"
    p.write_text("name: x\ntraining: [unclosed\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(p)


def test_register_refuses_template_then_locks_and_amends(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    code, _, err = run_cli(capsys, "register", "-s", tmp_path / "s")
    assert code == 2 and "template" in err
    assert not list((tmp_path / "s" / "records").glob("hypothesis-*"))

    fill_hypothesis(tmp_path / "s" / "study.yaml")
    code, out, _ = run_cli(capsys, "register", "-s", tmp_path / "s", "--json")
    assert code == 0
    v1 = json.loads(out)
    assert v1["version"] == 1 and len(v1["sha256"]) == 64 and v1["registered_at"].endswith("Z")
    v1_bytes = (tmp_path / "s" / "records" / "hypothesis-v1.json").read_bytes()

    # unchanged: no new version
    code, out, _ = run_cli(capsys, "register", "-s", tmp_path / "s", "--json")
    assert json.loads(out)["created"] is False

    # amend: v2 with a diff, v1 untouched
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["guardrails"][0]["value"] = -0.01
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(path)
    with pytest.raises(HypothesisError, match="changed what hypothesis v1 locked"):
        require_hypothesis(tmp_path / "s", cfg)
    code, out, _ = run_cli(capsys, "register", "-s", tmp_path / "s")
    assert code == 0 and "amendment of v1" in out
    v2 = json.loads((tmp_path / "s" / "records" / "hypothesis-v2.json").read_text())
    assert v2["amends"]["version"] == 1
    assert any(d["path"] == "guardrails[0].value" for d in v2["diff"])
    assert (tmp_path / "s" / "records" / "hypothesis-v1.json").read_bytes() == v1_bytes
    assert require_hypothesis(tmp_path / "s", cfg)["version"] == 2


def test_register_refuses_without_guardrails(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    fill_hypothesis(tmp_path / "s" / "study.yaml")
    cfg = load_config(tmp_path / "s" / "study.yaml", ["guardrails=[]"])
    with pytest.raises(HypothesisError, match="guardrails is empty"):
        hypothesis_stage.run(tmp_path / "s", cfg)


def _make_runs(root: str, n: int) -> None:
    s = Study.open(root)
    for _ in range(n):
        run = s.create_run("train")
        run.set_status("completed")


def test_ledger_concurrent_writers_and_runs_listing(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    procs = [
        mp.get_context("spawn").Process(target=_make_runs, args=(str(tmp_path / "s"), 5))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    s = Study.open(tmp_path / "s")
    rows = s.list_runs()
    assert len(rows) == 10 and len({r.id for r in rows}) == 10
    assert all(r.status == "completed" for r in rows)
    code, out, _ = run_cli(capsys, "runs", "-s", tmp_path / "s", "--json")
    assert code == 0 and len(json.loads(out)) == 10


def test_stale_running_run_becomes_interrupted(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    s = Study.open(tmp_path / "s")
    run = s.create_run("train")
    s.ledger.update_run(run.id, pid=2**22 + 12345)  # a pid that does not exist
    s2 = Study.open(tmp_path / "s")
    rows = {r.id: r for r in s2.list_runs()}
    assert rows[run.id].status == "interrupted" and "killed" in rows[run.id].reason
    assert json.loads((run.dir / "status.json").read_text())["status"] == "interrupted"


def test_env_json_complete(capsys):
    code, out, _ = run_cli(capsys, "env", "--json")
    assert code == 0
    e = json.loads(out)
    for key in (
        "python",
        "os",
        "cpu",
        "torch",
        "cuda",
        "rocm",
        "cudnn",
        "nccl",
        "rccl",
        "driver",
        "gpus",
        "bf16_supported",
        "attention",
        "packages",
        "tunelab_git",
        "compute_device",
    ):
        assert key in e, key
    import torch

    assert e["compute_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    for pkg in (
        "transformers",
        "peft",
        "safetensors",
        "tokenizers",
        "accelerate",
        "datasets",
        "tunelab",
    ):
        assert pkg in e["packages"]
    assert e["packages"]["transformers"]


def test_tunelab_device_chooses_and_a_bad_one_stops_every_command(tmp_path, capsys, monkeypatch):
    """TUNELAB_DEVICE=cpu keeps a GPU machine's work on the CPU; a value tunelab does not know,
    or cuda without a GPU, stops with exit 2 before anything is recorded."""
    import torch

    from tunelab.lib.models import compute_device

    run_cli(capsys, "init", tmp_path / "s")
    before = tree_hashes(tmp_path / "s")
    monkeypatch.setenv("TUNELAB_DEVICE", "cpu")
    assert compute_device() == torch.device("cpu")
    code, out, _ = run_cli(capsys, "env", "--json")
    assert code == 0 and json.loads(out)["compute_device"] == "cpu"
    monkeypatch.setenv("TUNELAB_DEVICE", "tpu")
    code, _, err = run_cli(capsys, "register", "-s", tmp_path / "s")
    assert code == 2 and "TUNELAB_DEVICE='tpu'" in err and "hint:" in err
    assert tree_hashes(tmp_path / "s") == before
    if not torch.cuda.is_available():
        monkeypatch.setenv("TUNELAB_DEVICE", "cuda")
        code, _, err = run_cli(capsys, "env")
        assert code == 2 and "sees no CUDA device" in err


def test_failed_command_changes_no_record(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    fill_hypothesis(tmp_path / "s" / "study.yaml")
    run_cli(capsys, "register", "-s", tmp_path / "s")
    before = tree_hashes(tmp_path / "s")
    code, _, _ = run_cli(capsys, "register", "-s", tmp_path / "s", "--set", "training.lr=-1")
    assert code == 2
    assert tree_hashes(tmp_path / "s") == before


def test_error_messages_are_not_read_as_markup(tmp_path, capsys):
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "[/bold]missing[/x]")
    assert code == 2
    assert "[/bold]missing[/x]" in err


@pytest.mark.parametrize(
    "schema_edit,fragment",
    [
        ({"type": "bool"}, "not a valid JSON Schema"),  # a type JSON Schema does not have
        ({"type": "datetime"}, "not a valid JSON Schema"),
    ],
)
def test_validate_and_register_refuse_a_json_schema_no_stage_could_use(
    tmp_path, capsys, schema_edit, fragment
):
    run_cli(capsys, "init", tmp_path / "s", "--task", "extraction")
    path = tmp_path / "s" / "study.yaml"
    fill_hypothesis(path)
    raw = yaml.safe_load(path.read_text())
    raw["task"]["json_schema"]["properties"]["subject"] = schema_edit
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s")
    assert code == 2 and fragment in err
    code, _, err = run_cli(capsys, "register", "-s", tmp_path / "s")
    assert code == 2 and fragment in err
    assert not list((tmp_path / "s" / "records").glob("hypothesis-*"))


def test_validate_and_register_refuse_scoring_options_naming_no_path(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s", "--task", "extraction")
    path = tmp_path / "s" / "study.yaml"
    fill_hypothesis(path)
    bad = ["task.scoring={'tolerance': {'subject': 0.1}}"]
    for command in ("validate", "register"):
        code, _, err = run_cli(capsys, command, "-s", tmp_path / "s", "--set", *bad)
        assert code == 2 and "not a number path" in err, err
    assert not list((tmp_path / "s" / "records").glob("hypothesis-*"))


def test_register_refuses_what_validate_refuses(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    fill_hypothesis(tmp_path / "s" / "study.yaml")
    over = ["--set", "training.max_steps=10", "--set", "training.warmup_steps=50"]
    code, _, err = run_cli(capsys, "register", "-s", tmp_path / "s", *over)
    assert code == 2 and "training.warmup_steps" in err
    assert not list((tmp_path / "s" / "records").glob("hypothesis-*"))


def test_validate_warns_that_a_json_schema_format_is_not_checked(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s", "--task", "extraction")
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["task"]["json_schema"]["properties"]["date"] = {"type": "string", "format": "date-time"}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    (tmp_path / "s" / "data").mkdir()
    row = {"text": "From: a@x.org", "target": '{"sender": "a@x.org", "subject": "Hi"}'}
    (tmp_path / "s" / "data" / "examples.jsonl").write_text(json.dumps(row) + "\n")
    code, out, err = run_cli(capsys, "validate", "-s", tmp_path / "s", "--json")
    assert code == 0, err
    (warning,) = json.loads(out)["warnings"]
    assert "format is not checked at properties/date ('date-time')" in warning
    assert "pattern" in warning
    from tunelab.lib.tasks.format import make_validator

    # what the warning says: the validator the tasks use lets another form through
    schema = raw["task"]["json_schema"]["properties"]["date"]
    assert not list(make_validator(schema).iter_errors("Tue, 3 Sep 2002 10:00:00 +0100"))


def test_train_refuses_a_name_taken_and_takes_the_parent_by_name(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    s = Study.open(tmp_path / "s")
    first = s.create_run("train", name="v1")
    first.set_status("completed")
    before = tree_hashes(tmp_path / "s")
    code, _, err = run_cli(capsys, "train", "-s", tmp_path / "s", "--name", "v1")
    assert code == 2 and f"--name 'v1' is taken by train run {first.id}" in " ".join(err.split())
    assert tree_hashes(tmp_path / "s") == before and len(s.list_runs("train")) == 1
    assert s.check_new_run("train", "v2", "v1") == first.id  # the parent as any command takes it
    assert s.check_new_run("train", "v2", first.id[:12]) == first.id
    with pytest.raises(RunError, match="parent run 'nope' not found"):
        s.check_new_run("train", "v2", "nope")


def test_non_finite_numbers_are_refused_in_study_yaml_and_set(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    path = tmp_path / "s" / "study.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["training"]["weight_decay"] = float("nan")
    raw["adaptation"]["alpha"] = float("inf")
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "training.weight_decay" in str(err.value) and "adaptation.alpha" in str(err.value)
    raw["training"]["weight_decay"], raw["adaptation"]["alpha"] = 0.0, 16.0
    path.write_text(yaml.safe_dump(raw))
    for item in ("training.lr=.inf", "training.lr=1e400", "training.grad_clip=.nan"):
        with pytest.raises(ConfigError, match=item.split("=")[0]):
            load_config(path, [item])
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s", "--set", "training.lr=nan")
    assert code == 2 and "finite" in err and "without quotes" not in err


def test_set_refuses_a_key_given_twice(tmp_path, capsys):
    run_cli(capsys, "init", tmp_path / "s")
    over = ["--set", "training.max_steps=4", "--set", "training.max_steps=5"]
    code, _, err = run_cli(capsys, "validate", "-s", tmp_path / "s", *over)
    assert code == 2 and "training.max_steps=4" in err and "training.max_steps=5" in err
    code, _, err = run_cli(
        capsys,
        "validate",
        "-s",
        tmp_path / "s",
        "--set",
        "training={lr: 1.0e-3}",
        "--set",
        "training.lr=2e-3",
    )
    assert code == 2 and "twice" in err
