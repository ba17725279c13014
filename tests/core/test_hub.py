"""Bases (and data sets) named by hub id, served offline from a real hub cache layout.

The cache is written as huggingface_hub writes it (blobs, snapshots of symlinks, refs, trees)
and read back through its own API (`snapshot_download(local_files_only=True)`,
`scan_cache_dir`), with HF_HUB_OFFLINE=1 and sockets blocked (conftest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import run_cli
from tunelab.core.config import ConfigError
from tunelab.core.config_training import ModelConfig
from tunelab.core.errors import HypothesisError, ModelError
from tunelab.core.hub_cache import cached_repos, write_snapshot

REPO = "tunelab-test/tiny-llama"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama_dir) -> Path:
    """A hub cache holding the tiny Llama at commit A (main, tag v1)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    write_snapshot(tiny_llama_dir, REPO, refs=("main", "v1"), commit=COMMIT_A)
    return cache


def move_main(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A new commit B on main: the same model with another generation_config."""
    changed = tmp_path / "tiny-llama-b"
    shutil.copytree(tiny_llama_dir, changed)
    (changed / "generation_config.json").write_text(json.dumps({"max_length": 77}))
    write_snapshot(changed, REPO, refs=("main",), commit=COMMIT_B)


# ---------------------------------------------------------------- the cache layout


def test_cache_layout_is_huggingface_hubs(hub_cache, tiny_llama_dir):
    from huggingface_hub import snapshot_download

    storage = hub_cache / "models--tunelab-test--tiny-llama"
    assert (storage / "refs" / "main").read_text() == COMMIT_A
    link = storage / "snapshots" / COMMIT_A / "model.safetensors"
    assert link.is_symlink() and not Path(link.readlink()).is_absolute()
    blob = link.resolve()
    assert blob.parent == (storage / "blobs").resolve()
    from tunelab.core.hashing import sha256_file

    assert blob.name == sha256_file(tiny_llama_dir / "model.safetensors")  # LFS: by sha256
    got = snapshot_download(REPO, cache_dir=hub_cache, local_files_only=True)
    assert Path(got).name == COMMIT_A
    (repo,) = cached_repos("model")
    assert repo["repo_id"] == REPO
    assert repo["revisions"][0]["commit"] == COMMIT_A
    assert repo["revisions"][0]["refs"] == ["main", "v1"]


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize("revision", [None, "main", "v1", COMMIT_A])
def test_resolve_main_tag_and_commit(hub_cache, tiny_llama_dir, revision):
    from tunelab.lib.models import model_identity, resolve_model

    base = resolve_model(ModelConfig(name=REPO, revision=revision))
    assert base.path.name == COMMIT_A
    assert base.architecture == "causal_lm"
    ident = base.identity
    assert ident["name"] == REPO and ident["revision"] == COMMIT_A
    assert ident["source"]["hub"] == {
        "repo_id": REPO,
        "repo_type": "model",
        "revision": revision or "main",
        "commit": COMMIT_A,
    }
    # the same files as the folder they came from: the same identity
    assert ident["files"] == model_identity(tiny_llama_dir)["files"]
    assert ident["sha256"] == model_identity(tiny_llama_dir)["sha256"]


def test_pinned_commit_wins_over_moved_main(hub_cache, tmp_path, tiny_llama_dir):
    from tunelab.lib.models import resolve_model

    move_main(tmp_path, tiny_llama_dir)
    assert resolve_model(ModelConfig(name=REPO)).path.name == COMMIT_B
    pinned = resolve_model(ModelConfig(name=REPO), commit=COMMIT_A)
    assert pinned.path.name == COMMIT_A
    assert pinned.identity["source"]["hub"]["revision"] == "main"


def test_offline_and_missing_names_cache_and_command(hub_cache):
    from tunelab.lib.models import resolve_model

    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="tunelab-test/absent"))
    assert "offline" in exc.value.message and str(hub_cache) in exc.value.message
    assert "hf download tunelab-test/absent --revision main" in exc.value.hint
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name=REPO, revision="v9"))
    assert "v9" in exc.value.message and "--revision v9" in exc.value.hint
    with pytest.raises(ModelError, match="not in the cache"):
        resolve_model(ModelConfig(name=REPO, revision="c" * 40))


def test_a_typo_or_an_uncached_revision_offline_names_what_the_cache_holds(hub_cache):
    from tunelab.lib.models import resolve_model

    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="tunelab-test/tiny-lama"))  # one letter short
    assert exc.value.hint.startswith(f"model.name: the cache holds {REPO}; or fill the cache")
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name=REPO, revision="v9"))
    assert f"the cache holds {REPO} at main, v1, {COMMIT_A}" in exc.value.hint
    assert "model.revision" in exc.value.hint
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="someone-else/other-model"))
    assert exc.value.hint.startswith("fill the cache")  # nothing near: only the download


def test_only_the_files_a_load_needs(hub_cache, tmp_path, tiny_llama_dir, monkeypatch):
    from tunelab.lib.models import resolve_model

    extra = tmp_path / "with-extras"
    shutil.copytree(tiny_llama_dir, extra)
    (extra / "training_log.txt").write_text("not for loading\n")
    (extra / "pytorch_model.bin").write_bytes(b"a pickle")
    write_snapshot(extra, "tunelab-test/extras", commit="e" * 40)
    base = resolve_model(ModelConfig(name="tunelab-test/extras"))
    assert "pytorch_model.bin" not in base.identity["files"]
    assert "model.safetensors" in base.identity["files"]


def test_pickles_refused_unless_opted_in(hub_cache, tmp_path, tiny_llama_dir):
    from tunelab.lib.models import resolve_model

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle")
    write_snapshot(pickled, "tunelab-test/pickled", commit="d" * 40)
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="tunelab-test/pickled"))
    assert "pytorch_model.bin" in exc.value.message
    assert "safetensors" in exc.value.hint and "allow_pickle" in exc.value.hint
    base = resolve_model(ModelConfig(name="tunelab-test/pickled", allow_pickle=True))
    assert "pytorch_model.bin" in base.identity["files"]


def test_custom_code_needs_trust_remote_code(hub_cache, tmp_path, tiny_llama_dir):
    from tunelab.lib.models import resolve_model

    custom = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "modeling_x.py").write_text("# custom code\n")
    write_snapshot(custom, "tunelab-test/custom", commit="f" * 40)
    with pytest.raises(ModelError, match="trust_remote_code"):
        resolve_model(ModelConfig(name="tunelab-test/custom"))
    base = resolve_model(ModelConfig(name="tunelab-test/custom", trust_remote_code=True))
    assert (base.path / "modeling_x.py").is_file()  # the code comes along when trusted


def test_config_path_or_hub_id():
    from tunelab.core.config import validate_config

    def problems(model):
        raw = yaml.safe_load(
            __import__("tunelab.stages.hypothesis.template", fromlist=["x"]).render_study_yaml(
                "classification", "s"
            )
        )
        raw["model"] = model
        with pytest.raises(ConfigError) as exc:
            validate_config(raw)
        return exc.value.message

    assert "choose one" in problems({"path": "m", "revision": "main"})
    assert "model.path" in problems({"revision": "main"})
    assert "not a hub repo id" in problems({"name": "a/b/c"})
    assert ModelConfig(name=REPO).hub_id == REPO
    assert ModelConfig(path="m", name=REPO).hub_id is None  # with path, name is a label


# ---------------------------------------------------------------- pinning at register


DATA_REPO = "tunelab-test/mail"
DATA_COMMIT = "d" * 40


def mail_rows(n: int = 12) -> list[dict[str, str]]:
    rows = []
    for i in range(n):
        sender, subject = f"user{i % 3}@example.com", f"note {i % 4}"
        text = f"From: {sender}\nSubject: {subject}\n\nhello {i}"
        target = json.dumps({"sender": sender, "subject": subject})
        rows.append({"id": f"m{i}", "text": text, "target": target})
    return rows


def write_mail_dataset(tmp_path: Path) -> None:
    """The 12 emails as a hub data set of Parquet files, one per split (8/2/2), at DATA_COMMIT."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mail-dataset"
    (folder / "data").mkdir(parents=True)
    rows = mail_rows()
    for split, part in (("train", rows[:8]), ("validation", rows[8:10]), ("test", rows[10:])):
        table = pa.Table.from_pylist(part)
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")
    (folder / "README.md").write_text("# mail\n\nTwelve short emails.\n")
    write_snapshot(folder, DATA_REPO, repo_type="dataset", commit=DATA_COMMIT)


def write_hub_study(
    root: Path, *, revision: str | None = None, steps: int = 2, hub_data: bool = False
) -> Path:
    """An extraction study on the tiny Llama named by hub id: 12 emails in mail.jsonl, or the
    hub data set DATA_REPO with its own splits."""
    from helpers.study import build_study

    fields = {"id": "id", "text": "text", "label": None, "target": "target"}
    hub = {"data.source": {"format": "hub", "name": DATA_REPO}} if hub_data else {}
    if hub_data:
        fields["split"] = "__split__"  # keep the data set's own splits
    training = {"max_steps": steps, "warmup_steps": 0, "micro_batch_size": 2, "lr": 1e-2}
    return build_study(
        root,
        "extraction",
        name="hub-study",
        rows=mail_rows(),
        data_file="mail.jsonl",
        set={
            "data.fields": fields,
            "data.cleaning": [],
            "model": {"name": REPO, **({"revision": revision} if revision else {})},
            "adaptation.target_modules": ["q_proj", "v_proj"],
            "preprocess.max_seq_len": 96,
            "evaluation.max_new_tokens": 8,
            "evaluation.batch_size": 4,
            **hub,
            **{f"training.{k}": v for k, v in (training | {"num_threads": 1}).items()},
        },
    )


def test_register_pins_and_moved_main_is_named(hub_cache, tmp_path, tiny_llama_dir, capsys):
    from tunelab.core.study import Study
    from tunelab.lib.models import resolve_base
    from tunelab.stages.hypothesis import stage as hyp

    root = write_hub_study(tmp_path / "study")
    code, out, err = run_cli(capsys, "register", "--study", root)
    assert code == 0, err
    assert f"pinned to commit {COMMIT_A}" in out
    record = json.loads((root / "records" / "hypothesis-v1.json").read_text())
    assert record["content"]["pins"]["model"] == {
        "repo_id": REPO,
        "repo_type": "model",
        "revision": "main",
        "commit": COMMIT_A,
    }

    move_main(tmp_path, tiny_llama_dir)
    code, out, err = run_cli(capsys, "validate", "--study", root)
    assert code == 0, err
    assert f"main now resolves to {COMMIT_B[:12]}" in out and COMMIT_A[:12] in out
    # every stage loads the pinned commit, not what main says now
    assert resolve_base(Study.open(root)).path.name == COMMIT_A
    # registering again keeps the pin (and says main moved); --repin moves it, a new version
    code, out, err = run_cli(capsys, "register", "--study", root)
    assert code == 0 and "already registered" in out and "--repin" in out
    code, out, err = run_cli(capsys, "register", "--study", root, "--repin")
    assert code == 0 and f"pinned to commit {COMMIT_B}" in out
    v2 = json.loads((root / "records" / "hypothesis-v2.json").read_text())
    assert {"path": "pins.model.commit", "old": COMMIT_A, "new": COMMIT_B} in v2["diff"]
    assert resolve_base(Study.open(root)).path.name == COMMIT_B

    # a revision changed in study.yaml after register is refused until registered
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["model"]["revision"] = "v1"
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(HypothesisError, match="pinned tunelab-test/tiny-llama@main"):
        hyp.require_hypothesis(root, Study.open(root).config)


def test_register_offline_and_missing_is_refused(hub_cache, tmp_path, capsys):
    root = write_hub_study(tmp_path / "study", revision="no-such-branch")
    code, out, err = run_cli(capsys, "register", "--study", root)
    assert code == 2
    assert "no-such-branch" in err and "hf download" in err
    assert not (root / "records" / "hypothesis-v1.json").exists()


# ---------------------------------------------------------------- a study by hub id, end to end


@pytest.mark.slow
def test_study_by_hub_id_runs_every_stage_offline(hub_cache, tmp_path, tiny_llama_dir, capsys):
    write_mail_dataset(tmp_path)
    root = write_hub_study(tmp_path / "study", steps=2, hub_data=True)
    for args in (["register"], ["data"], ["baseline"]):
        code, out, err = run_cli(capsys, *args, "-s", root)
        assert code == 0, (args, out, err)
    record = json.loads((root / "records" / "hypothesis-v1.json").read_text())
    assert record["content"]["pins"]["data"]["commit"] == DATA_COMMIT
    (manifest_path,) = (root / "records" / "data").glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    data_hub = manifest["source"]["hub"]
    assert data_hub["repo_id"] == DATA_REPO and data_hub["commit"] == DATA_COMMIT
    assert data_hub["splits"] == {"train": 8, "validation": 2, "test": 2}
    assert set(data_hub["fingerprints"]) == {"train", "validation", "test"}
    assert manifest["counts"]["final"] == {"train": 8, "validation": 2, "test": 2}
    move_main(tmp_path, tiny_llama_dir)  # main moves after register: nothing below follows it
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "lora", "--json")
    assert code == 0, (out, err)
    run_id = json.loads(out)["run_id"]
    for args in (["eval", run_id], ["verify", run_id]):
        code, out, err = run_cli(capsys, *args, "-s", root, "--json")
        assert code == 0, (args, out, err)
    code, out, err = run_cli(capsys, "export", run_id, "-s", root, "--json")
    assert code == 0, (out, err)
    export = json.loads(out)
    hub = {"repo_id": REPO, "repo_type": "model", "revision": "main", "commit": COMMIT_A}
    assert export["manifest"]["base"]["hub"] == hub
    assert export["manifest"]["base"]["revision"] == COMMIT_A
    assert COMMIT_A in (Path(export["path"]) / "README.md").read_text()
    code, out, _ = run_cli(capsys, "runs", "-s", root, "--json")
    runs = {r["kind"]: root / "records" / "runs" / r["id"] for r in json.loads(out)}
    config = json.loads((runs["train"] / "config.json").read_text())
    assert config["base_model"]["source"]["hub"] == hub
    for kind in ("baseline", "eval"):
        assert json.loads((runs[kind] / "metrics-validation.json").read_text())["base_hub"] == hub

    code, out, err = run_cli(capsys, "check-export", export["path"], "--base", REPO, "--json")
    assert code == 0, (out, err)
    checked = json.loads(out)
    assert checked["base"]["hub"]["commit"] == COMMIT_A and checked["example"]["matches_recorded"]
    code, out, err = run_cli(capsys, "check-export", export["path"], "--base", f"{REPO}@main")
    assert code == 2
    assert f"commit {COMMIT_B}" in err and f"{REPO}@{COMMIT_A}" in err
    # the same files under another repo id: accepted (a base is its bytes), and said so
    write_snapshot(tiny_llama_dir, "org/copy")
    code, out, err = run_cli(capsys, "check-export", export["path"], "--base", "org/copy")
    assert code == 0, (out, err)
    flat = " ".join(out.split())
    assert f"of {REPO} at {COMMIT_A[:12]} match --base" in flat
    assert "org/copy (the same files under another repo id)" in flat
    assert '(gold {"sender": ' in flat and "{'" not in flat  # the gold as JSON, not a repr


# ---------------------------------------------------------------- data sets


def test_hub_data_set_splits_and_errors(hub_cache, tmp_path, capsys):
    from tunelab.core.errors import DataError, EvaluationError
    from tunelab.core.study import Study
    from tunelab.stages.data import load_snapshot
    from tunelab.stages.data import stage as data_stage

    write_mail_dataset(tmp_path)
    root = write_hub_study(tmp_path / "study", hub_data=True)
    code, out, err = run_cli(capsys, "validate", "-s", root)
    assert code == 0, err
    code, out, err = run_cli(capsys, "register", "-s", root)
    assert code == 0 and f"data: {DATA_REPO}@main pinned to commit {DATA_COMMIT}" in out
    study = Study.open(root)
    data_stage.run(study)
    snap = load_snapshot(study)
    assert [r["id"] for r in snap.rows("validation")] == ["m8", "m9"]
    with pytest.raises(EvaluationError):
        snap.rows("test")  # the data set's own test split is sealed like any other

    def snapshot_with(**source):
        raw = yaml.safe_load((root / "study.yaml").read_text())
        raw["data"]["source"].update(source)
        (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        with pytest.raises(DataError) as exc:
            data_stage.run(Study.open(root))
        return exc.value

    exc = snapshot_with(splits=["train", "dev"])
    assert "no split 'dev'" in exc.message and "data.source.splits" in exc.hint
    exc = snapshot_with(splits=None, config="nope")
    assert "data.source.config" in exc.hint
    exc = snapshot_with(config=None, name="tunelab-test/absent")
    assert "not in the cache" in exc.message and "--repo-type dataset" in exc.hint


# ---------------------------------------------------------------- the CLI


def test_models_lists_the_cache_and_hub_cache_fills_it(hub_cache, tmp_path, tiny_llama_dir, capsys):
    code, out, err = run_cli(
        capsys, "hub-cache", tiny_llama_dir, "org/copy", "--ref", "v2", "--json"
    )
    assert code == 0, err
    made = json.loads(out)
    code, out, err = run_cli(capsys, "hub-cache", tiny_llama_dir, "org/copy", "--json")
    assert json.loads(out)["commit"] == made["commit"]  # the same files, the same commit
    code, out, err = run_cli(capsys, "models", "--json")
    assert code == 0, err
    repos = {r["repo_id"]: r for r in json.loads(out)["repos"]}
    assert set(repos) == {REPO, "org/copy"}
    assert repos["org/copy"]["revisions"][0]["refs"] == ["main", "v2"]
    code, out, err = run_cli(capsys, "models")
    assert code == 0 and COMMIT_A[:12] in out and "main, v1" in out
    code, out, err = run_cli(capsys, "hub-cache", tiny_llama_dir, "not a repo")
    assert code == 2 and "org/name" in err
    code, out, err = run_cli(capsys, "hub-cache", tiny_llama_dir, "org/x", "--commit", "abc")
    assert code == 2 and "40 hex" in err


@pytest.mark.slow  # hashes and resolves the real MiniLM's files
def test_the_hub_example_resolves_from_a_cache_of_the_packaged_asset(
    tmp_path, monkeypatch, minilm_dir, capsys
):
    from tunelab.core.hashing import sha256_file
    from tunelab.core.study import Study
    from tunelab.lib.models import resolve_base

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    code, out, err = run_cli(
        capsys, "hub-cache", minilm_dir, "sentence-transformers/all-MiniLM-L6-v2", "--json"
    )
    assert code == 0, err
    commit = json.loads(out)["commit"]
    root = tmp_path / "bbc-hub"
    root.mkdir()
    shutil.copy(Path(__file__).parents[2] / "examples/classification-bbc-hub/study.yaml", root)
    code, out, err = run_cli(capsys, "register", "-s", root)
    assert code == 0, err
    assert f"pinned to commit {commit}" in out
    base = resolve_base(Study.open(root))
    assert base.identity["source"]["hub"]["commit"] == commit
    assert base.identity["files"]["model.safetensors"] == sha256_file(
        minilm_dir / "model.safetensors"
    )


# ---------------------------------------------------------------- what the hub answers


@pytest.fixture
def hub_server(hub_cache, monkeypatch):
    """A local HTTP endpoint answering as the hub does for a missing repo, a gated repo and a
    missing revision (status and X-Error-Code), with offline mode off."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    answers = {
        "org/missing": (401, "RepoNotFound"),
        "org/gated": (401, "GatedRepo"),
        f"{REPO}": (404, "RevisionNotFound"),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            repo = "/".join(self.path.split("/")[3:5])
            status, code = answers.get(repo, (404, "RepoNotFound"))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield
    server.shutdown()


def test_hub_errors_say_how_to_fix(hub_server):
    from tunelab.lib.models import resolve_model

    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="org/missing"))
    assert "no such repo" in exc.value.message and "no HF_TOKEN is set" in exc.value.message
    assert "hf auth login" in exc.value.hint and "HF_TOKEN" in exc.value.hint
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name="org/gated"))
    assert "gated" in exc.value.message and "huggingface-cli login" in exc.value.hint
    with pytest.raises(ModelError) as exc:
        resolve_model(ModelConfig(name=REPO, revision="nope"))
    assert "no revision 'nope'" in exc.value.message


def test_register_pins_without_the_weights_and_a_stage_names_the_missing_commit(
    hub_cache, tmp_path, tiny_llama_dir, capsys
):
    from tunelab.core.study import Study
    from tunelab.lib.models import resolve_base

    # the cache holds the repo's listing and config.json, not its weights (as after a register
    # on a machine that never loaded the model)
    snapshot = hub_cache / "models--tunelab-test--tiny-llama" / "snapshots" / COMMIT_A
    (snapshot / "model.safetensors").unlink()
    root = write_hub_study(tmp_path / "study")
    code, out, err = run_cli(capsys, "register", "-s", root)
    assert code == 0 and f"pinned to commit {COMMIT_A}" in out, err
    with pytest.raises(ModelError) as exc:
        resolve_base(Study.open(root))
    assert f"--revision {COMMIT_A}" in exc.value.hint  # the pinned commit, not main


def test_register_refuses_a_pickle_only_repo(hub_cache, tmp_path, tiny_llama_dir, capsys):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle")
    write_snapshot(pickled, REPO, refs=("main",), commit="9" * 40)
    root = write_hub_study(tmp_path / "study")
    code, out, err = run_cli(capsys, "register", "-s", root)
    assert code == 2 and "pytorch_model.bin" in err and "allow_pickle" in err
    assert not (root / "records" / "hypothesis-v1.json").exists()


def test_hub_cache_lays_in_a_folder_that_lies_under_a_dot_cache(tmp_path, tiny_llama_dir):
    # a conversion cache such as ~/.cache/tunelab/gguf/<digest>/ is a model folder like any other
    folder = tmp_path / ".cache" / "tunelab" / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download.lock").write_text("")
    snap = write_snapshot(folder, "org/converted", cache_dir=tmp_path / "hub")
    laid = sorted(p.name for p in snap.path.iterdir())
    assert laid == sorted(p.name for p in tiny_llama_dir.iterdir() if p.is_file())


def test_data_of_a_hub_data_set_names_it_and_draws_no_bars_of_its_own(hub_cache, tmp_path, capsys):
    write_mail_dataset(tmp_path)
    root = write_hub_study(tmp_path / "study", hub_data=True)
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 0, err
    assert f"(hub: {DATA_REPO}@{DATA_COMMIT[:12]})" in out and "None" not in out
    assert "Generating" not in err and "examples/s" not in err  # `datasets`' own bars


def test_models_prints_a_long_repo_id_whole_at_80_columns(
    hub_cache, tiny_llama_dir, capsys, monkeypatch
):
    long_id = "a-long-organisation-name/a-model-name-of-forty-letters-or-so"
    write_snapshot(tiny_llama_dir, long_id, commit=COMMIT_B)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(capsys, "models")
    assert code == 0, err
    assert long_id in out.splitlines() and REPO in out.splitlines()
    assert COMMIT_B[:12] in out and all(len(line) <= 80 for line in out.splitlines()[1:])


@pytest.mark.parametrize("ref", ["", "../../outside", "/abs", "a/../b", "main.lock", "-x"])
def test_hub_cache_refuses_a_ref_that_is_no_branch_name_before_writing(
    tmp_path, tiny_llama_dir, capsys, ref
):
    cache = tmp_path / "hub"
    with pytest.raises(ConfigError, match="is not a branch or tag name"):
        write_snapshot(tiny_llama_dir, "org/x", refs=(ref,), cache_dir=cache)
    assert not cache.exists()  # nothing written, inside the cache or out of it
    assert not (tmp_path / "outside").exists()
    code, _, err = run_cli(capsys, "hub-cache", tiny_llama_dir, "org/x", "--ref", ref)
    assert code == 2 and "--ref" in err


def test_hub_cache_takes_nested_refs_and_says_a_commit_is_lowercase(tmp_path, tiny_llama_dir):
    snap = write_snapshot(tiny_llama_dir, "org/x", refs=("release/v1.0",), cache_dir=tmp_path)
    assert (tmp_path / "models--org--x" / "refs" / "release" / "v1.0").read_text() == snap.commit
    with pytest.raises(ConfigError, match="40 hex digits in lowercase"):
        write_snapshot(tiny_llama_dir, "org/x", commit="A" * 40, cache_dir=tmp_path)


def test_a_hub_target_column_datasets_would_retype_is_refused(hub_cache, tmp_path, capsys):
    """JSON lines whose targets are objects: `datasets` infers one type for the column and
    reads the string "3" as the number 3; the data stage refuses rather than score that."""
    folder = tmp_path / "objects"
    folder.mkdir()
    rows = mail_rows(6)
    for i, r in enumerate(rows):
        target = json.loads(r["target"])
        r["target"] = {**target, "count": "3" if i == 1 else i}
    (folder / "mail.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_snapshot(folder, DATA_REPO, repo_type="dataset")
    root = write_hub_study(tmp_path / "study", hub_data=True)
    raw = yaml.safe_load((root / "study.yaml").read_text())
    raw["data"]["fields"]["split"] = None
    (root / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert run_cli(capsys, "register", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 2, out
    assert "the target column 'target'" in err and "mail.jsonl" in err
    assert "JSON string" in err
    assert not (root / "records" / "data").exists() or not any(
        (root / "records" / "data").iterdir()
    )


def test_check_export_base_missing_from_the_cache_names_the_option(hub_cache):
    from tunelab.stages.export.check import resolve_base_arg

    manifest = {"base": {"hub": {"repo_id": REPO, "commit": COMMIT_A}, "patterns": ["*"]}}
    with pytest.raises(ModelError) as exc:
        resolve_base_arg(f"{REPO}@v9", manifest)
    assert f"pass --base {REPO}@REV, REV one of them" in exc.value.hint
    assert "model.revision" not in exc.value.hint
    with pytest.raises(ModelError) as exc:
        resolve_base_arg("tunelab-test/tiny-lama", manifest)
    assert exc.value.hint.startswith(f"--base: the cache holds {REPO}")


def test_validate_offline_names_a_hub_repo_the_cache_lacks(hub_cache, tmp_path, capsys):
    root = write_hub_study(tmp_path / "study")
    assert run_cli(capsys, "validate", "-s", root)[0] == 0
    code, _, err = run_cli(
        capsys, "validate", "-s", root, "--set", "model.name=tunelab-test/tiny-lama"
    )
    assert code == 2
    assert "model.name: tunelab-test/tiny-lama@main is not in the hub cache" in err
    assert f"the cache holds {REPO}; or fill it" in err
    code, _, err = run_cli(capsys, "validate", "-s", root, "--set", "model.revision=v9")
    assert code == 2 and f"the cache holds {REPO} at main, v1, {COMMIT_A}" in err
    assert not (root / "records").exists() or not list((root / "records").glob("hypothesis-*"))


def test_the_dossier_names_the_pinned_repos_and_the_data_source(hub_cache, tmp_path, capsys):
    write_mail_dataset(tmp_path)
    root = write_hub_study(tmp_path / "study", hub_data=True)
    for args in (["register"], ["data"], ["report"]):
        code, out, err = run_cli(capsys, *args, "-s", root)
        assert code == 0, (args, out, err)
    dossier = (root / "report" / "dossier.md").read_text()
    assert f"| model | {REPO} | main | {COMMIT_A} |" in dossier
    assert f"| data | {DATA_REPO} | main | {DATA_COMMIT} |" in dossier
    assert f"from hub data set {DATA_REPO} at commit {DATA_COMMIT}" in dossier
