"""Stage 2, data: readers, bad input, cleaning rules, stable splits, snapshots, tamper, sealed test."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers import run_cli
from helpers.data import LABELS, jsonl_study, make_rows, make_study, ticket, write_jsonl
from tunelab.core.config_sections import CleaningRule, SplitConfig
from tunelab.core.errors import ConfigError, DataError, EvaluationError, SnapshotError
from tunelab.core.study import Study
from tunelab.stages.data import latest_snapshot_id, load_snapshot, open_test_split
from tunelab.stages.data import stage as data_stage
from tunelab.stages.data.cleaning import clean_texts
from tunelab.stages.data.splits import content_keys, split_by_hash


def snapshot_dirs(study: Study) -> list[str]:
    d = study.records / "data"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def all_rows(study: Study, snap_id: str | None = None) -> dict[str, list[dict]]:
    snap = load_snapshot(study, snap_id)
    test = open_test_split(study, snap, who="pytest", why="check the split")
    return {"train": snap.rows("train"), "validation": snap.rows("validation"), "test": test}


# ---------------------------------------------------------------- checks


def test_snapshot_runs_every_source_check_in_order(tmp_path, monkeypatch):
    from tunelab.stages.data import checks

    seen = []

    def note_rows(read):
        seen.append(len(read.rows))
        return [f"{len(read.rows)} rows read"]

    def refuse_sales(read):
        bad = next((r for r in read.rows if r.label == "sales"), None)
        if bad is not None:
            raise DataError(f"{bad.where}: sales refused", hint="drop it")
        return []

    monkeypatch.setattr(checks, "SOURCE_CHECKS", [*checks.SOURCE_CHECKS, note_rows])
    s = jsonl_study(tmp_path, make_rows(30), dedup={"near": False})
    assert data_stage.run(s)["notes"][-1] == "30 rows read" and seen == [30]
    monkeypatch.setattr(checks, "SOURCE_CHECKS", [*checks.SOURCE_CHECKS, refuse_sales])
    with pytest.raises(DataError, match=r"rows.jsonl line 3: sales refused"):
        data_stage.run(s)


# ---------------------------------------------------------------- readers


def test_jsonl_reader_maps_fields(tmp_path):
    rows = [
        {"uid": f"t{i}", "body": ticket(i, "x"), "cat": LABELS[i % 3], "answer": {"team": i}}
        for i in range(60)
    ]
    s = jsonl_study(
        tmp_path,
        rows,
        fields={"id": "uid", "text": "body", "label": "cat", "target": "answer"},
        dedup={"near": False},
    )
    m = data_stage.run(s)
    got = {r["id"]: r for rows_ in all_rows(s).values() for r in rows_}
    assert len(got) == 60 and m["counts"]["rows_read"] == 60
    assert got["t7"] == {
        "id": "t7",
        "text": ticket(7, "x"),
        "label": LABELS[1],
        "target": '{"team": 7}',
    }
    assert m["labels"] == LABELS
    assert m["source"]["files"][0]["path"] == "rows.jsonl"
    assert len(m["source"]["files"][0]["sha256"]) == 64


def test_csv_reader_handles_quotes_and_newlines(tmp_path):
    lines = ["text,label"]
    for i in range(30):
        lines.append(f'"{ticket(i, "q")}, with a comma\nand a second line",{LABELS[i % 3]}')
    path = tmp_path / "s" / "data.csv"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")
    s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "data.csv"}})
    data_stage.run(s)
    texts = [r["text"] for rows in all_rows(s).values() for r in rows]
    assert len(texts) == 30
    assert all(", with a comma\nand a second line" in t for t in texts)


def test_parquet_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(45)
    (tmp_path / "s").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s" / "rows.parquet")
    s = make_study(tmp_path / "s", {"source": {"format": "parquet", "path": "rows.parquet"}})
    m = data_stage.run(s)
    assert sum(m["counts"]["final"].values()) == 45
    assert m["labels"] == LABELS


def test_folder_reader_labels_are_folder_names(tmp_path):
    root = tmp_path / "s" / "corpus"
    for i in range(36):
        label = LABELS[i % 3]
        (root / label).mkdir(parents=True, exist_ok=True)
        (root / label / f"{i:03d}.txt").write_text(ticket(i, label))
    (root / "README.txt").write_text("not an example")
    s = make_study(tmp_path / "s", {"source": {"format": "folder", "path": "corpus"}})
    m = data_stage.run(s)
    got = {r["id"]: r for rows in all_rows(s).values() for r in rows}
    assert got["outage/001.txt"]["label"] == "outage"
    assert got["outage/001.txt"]["text"] == ticket(1, "outage")
    assert m["source"]["num_files"] == 36 and any("README.txt" in n for n in m["notes"])


def test_hf_disk_reader_dataset_dict_and_class_labels(tmp_path):
    datasets = pytest.importorskip("datasets")
    feats = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=LABELS)}
    )

    def part(lo: int, n: int) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {
                "text": [ticket(i, "h") for i in range(lo, lo + n)],
                "label": [i % 3 for i in range(lo, lo + n)],
            },
            features=feats,
        )

    dd = datasets.DatasetDict({"train": part(0, 30), "valid": part(30, 9), "test": part(39, 9)})
    dd.save_to_disk(str(tmp_path / "s" / "hf"))
    s = make_study(
        tmp_path / "s",
        {"source": {"format": "hf_disk", "path": "hf"}, "fields": {"split": "__split__"}},
    )
    m = data_stage.run(s)
    assert m["splits"]["method"] == "column"
    assert m["counts"]["final"] == {"train": 30, "validation": 9, "test": 9}
    assert m["labels"] == LABELS
    train = load_snapshot(s).rows("train")
    assert {r["label"] for r in train} == set(LABELS)


# ---------------------------------------------------------------- bad input


def _cli_fails(capsys, study: Study, *fragments: str) -> str:
    code, _, err = run_cli(capsys, "data", "-s", study.root)
    assert code == 2, err
    for f in fragments:
        assert f in err, (f, err)
    assert "hint:" in err
    assert snapshot_dirs(study) == [], "no partial snapshot may be left behind"
    return err


@pytest.mark.parametrize(
    ("line", "fragments"),
    [
        ('{"text": "a b c", "label": "sales"', ("rows.jsonl line 3", "not valid JSON")),
        ('{"label": "sales"}', ("rows.jsonl line 3", "'text'", "missing")),
        ('{"text": "hello there", "label": ""}', ("rows.jsonl line 3", "'label'", "empty")),
        ('{"text": "hello there", "label": null}', ("rows.jsonl line 3", "'label'", "null")),
        ('{"text": ["a"], "label": "sales"}', ("rows.jsonl line 3", "'text'", "string")),
        ('["text", "label"]', ("rows.jsonl line 3", "object")),
    ],
)
def test_bad_jsonl_line_names_file_line_field(tmp_path, capsys, line, fragments):
    good = [json.dumps(r) for r in make_rows(2)]
    path = tmp_path / "s" / "data" / "rows.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join([*good, line, *good]) + "\n")
    s = make_study(tmp_path / "s", {"source": {"format": "jsonl", "path": "data/rows.jsonl"}})
    _cli_fails(capsys, s, *fragments)


def test_unknown_label_and_duplicate_ids(tmp_path, capsys):
    rows = make_rows(6)
    rows[4]["label"] = "refunds"
    s = jsonl_study(tmp_path / "a", rows)
    s.config.task.labels = LABELS
    with pytest.raises(DataError, match=r"rows.jsonl line 5: unknown label 'refunds'"):
        data_stage.run(s)

    rows = [{**r, "id": "same" if i in (1, 4) else f"r{i}"} for i, r in enumerate(make_rows(6))]
    s = jsonl_study(tmp_path / "b", rows, fields={"id": "id"})
    err = _cli_fails(capsys, s, "rows.jsonl line 5", "'same'", "rows.jsonl line 2")
    assert "unique" in err


def test_invalid_utf8_error_and_replace(tmp_path, capsys):
    path = tmp_path / "s" / "data" / "rows.jsonl"
    path.parent.mkdir(parents=True)
    good = "".join(json.dumps(r) + "\n" for r in make_rows(30))
    path.write_bytes(good.encode() + b'{"text": "price \xa3 5", "label": "sales"}\n')
    s = make_study(tmp_path / "s", {"source": {"format": "jsonl", "path": "data/rows.jsonl"}})
    _cli_fails(capsys, s, "rows.jsonl line 31", "invalid UTF-8", "encoding_errors")

    s = make_study(
        tmp_path / "s",
        {
            "source": {"format": "jsonl", "path": "data/rows.jsonl", "encoding_errors": "replace"},
            "splits": {"stratify": False},
        },
    )
    m = data_stage.run(s)
    assert m["source"]["replaced_invalid_utf8_bytes"] == 1
    texts = [r["text"] for rows in all_rows(s).values() for r in rows]
    assert "price \ufffd 5" in texts


def test_invalid_utf8_in_folder_names_the_file(tmp_path, capsys):
    root = tmp_path / "s" / "corpus"
    for label in LABELS:
        (root / label).mkdir(parents=True)
        for i in range(12):
            (root / label / f"{i}.txt").write_text(ticket(i, label))
    (root / "sales" / "bad.txt").write_bytes(b"line one\ncosts \xa3 5\n")
    s = make_study(tmp_path / "s", {"source": {"format": "folder", "path": "corpus"}})
    _cli_fails(capsys, s, "sales/bad.txt", "line 2", "invalid UTF-8")


def test_bad_csv_rows(tmp_path, capsys):
    p = tmp_path / "s" / "data.csv"
    p.parent.mkdir(parents=True)
    p.write_text("text,label\nhello world,sales\none,two,three\n")
    s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "data.csv"}})
    _cli_fails(capsys, s, "data.csv line 3", "3 fields", "header has 2")

    p.write_text('text,label\nhello world,sales\n"unterminated,sales\nmore,sales\n')
    _cli_fails(capsys, s, "data.csv line", "malformed CSV")

    p.write_text("body,label\nhello world,sales\n")
    _cli_fails(capsys, s, "data.csv line 1 (header)", "no column 'text'", "field 'text'")


def test_jsonl_lone_surrogate_escape_names_line_and_field(tmp_path, capsys):
    # json reads "\ud800" as a lone surrogate, which no UTF-8 record can hold
    good = [json.dumps(r) for r in make_rows(2)]
    path = tmp_path / "s" / "data" / "rows.jsonl"
    path.parent.mkdir(parents=True)
    bad = '{"text": "price \\ud800 five", "label": "sales"}'
    path.write_text("\n".join([*good, bad, *good]) + "\n")
    s = make_study(tmp_path / "s", {"source": {"format": "jsonl", "path": "data/rows.jsonl"}})
    _cli_fails(capsys, s, "rows.jsonl line 3", "'text'", "surrogate", "\\ud800")


def test_csv_field_longer_than_the_csv_module_limit_is_read(tmp_path):
    rows = make_rows(30)
    rows[3]["text"] = "word " * 40_000  # 200,000 characters, over csv's 131,072 default
    p = tmp_path / "s" / "data.csv"
    p.parent.mkdir(parents=True)
    p.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    data = {
        "source": {"format": "csv", "path": "data.csv"},
        "cleaning": [{"rule": "drop_longer_than", "max_chars": 20000}],
        "splits": {"stratify": False},
    }
    m = data_stage.run(make_study(tmp_path / "s", data))
    assert m["counts"]["rows_read"] == 30
    assert m["counts"]["dropped_by_cleaning"] == 1


def test_csv_quoting_errors_name_the_line_the_record_starts(tmp_path, capsys):
    p = tmp_path / "s" / "data.csv"
    p.parent.mkdir(parents=True)
    s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "data.csv"}})
    p.write_text('text,label\nhello world,sales\n"unterminated,sales\nmore,sales\n')
    _cli_fails(capsys, s, "data.csv line 3: malformed CSV", "runs to line 4")


@pytest.mark.parametrize(("sep", "word"), [("\t", "tabs"), (";", "semicolons")])
def test_csv_with_another_separator_is_named(tmp_path, capsys, sep, word):
    p = tmp_path / "s" / "data.tsv"
    p.parent.mkdir(parents=True)
    p.write_text(f"text{sep}label\nhello world{sep}sales\n")
    s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "data.tsv"}})
    err = _cli_fails(capsys, s, "data.tsv line 1 (header)", f"separated by {word}", "to_parquet")
    assert "no column" not in err
    code, _, err = run_cli(capsys, "validate", "-s", s.root)
    assert code == 2 and f"separated by {word}" in err, err
    assert "data.fields.text" not in err, "one problem, not one per field"


def test_files_a_folder_source_skips_are_noted(tmp_path):
    folder = tmp_path / "s" / "data"
    write_jsonl(folder / "a.jsonl", make_rows(60))
    (folder / "more").mkdir()
    (folder / "more" / "b.tsv").write_text("text\tlabel\nhello\tsales\n")
    (folder / "C.JSONL").write_text("")
    (folder / ".DS_Store").write_text("")
    s = make_study(tmp_path / "s", {"source": {"format": "jsonl", "path": "data"}})
    notes = data_stage.run(s)["notes"]
    assert "skipped 2 file(s) in data not matching *.jsonl or *.json: C.JSONL, more/b.tsv" in notes


def test_empty_data_set(tmp_path, capsys):
    s = jsonl_study(tmp_path, [])
    _cli_fails(capsys, s, "empty")
    s = jsonl_study(
        tmp_path, make_rows(5), cleaning=[{"rule": "drop_shorter_than", "min_chars": 10_000}]
    )
    _cli_fails(capsys, s, "all 5 rows were dropped", "drop_shorter_than dropped 5")


def test_category_too_small_to_stratify(tmp_path, capsys):
    rows = make_rows(300) + [{"text": "a rare complaint about the colour", "label": "rare"}] * 2
    rows[-1] = {"text": "another rare complaint, about the smell", "label": "rare"}
    s = jsonl_study(tmp_path, rows)
    _cli_fails(capsys, s, "category 'rare' is too small to stratify", "2 row(s) for 3 splits")
    s = jsonl_study(tmp_path, rows, splits={"stratify": False})
    m = data_stage.run(s)
    assert any("'rare'" in n for n in m["notes"])


def test_small_category_gets_a_row_in_every_split(tmp_path):
    rows = make_rows(300) + [
        {"text": ticket(9000 + i, "rare", n_words=12), "label": "rare"} for i in range(4)
    ]
    s = jsonl_study(tmp_path, rows)
    m = data_stage.run(s)
    per = m["counts"]["per_category"]
    assert all(per[split].get("rare", 0) >= 1 for split in ("train", "validation", "test"))
    moved = m["splits"]["moved_to_cover_small_categories"]
    assert moved and all(mv["category"] == "rare" for mv in moved)
    # rows of the big categories are where the hash put them
    for label in LABELS:
        texts = [r["text"] for r in rows if r["label"] == label]
        by_hash = dict(zip(texts, split_by_hash(content_keys(texts), SplitConfig()), strict=True))
        snap = {r["text"]: sp for sp, rs in all_rows(s).items() for r in rs if r["label"] == label}
        assert snap == by_hash


def test_bad_user_split_value_and_bad_regex(tmp_path, capsys):
    rows = [{**r, "part": "train"} for r in make_rows(5)]
    rows[2]["part"] = "holdout"
    s = jsonl_study(tmp_path / "a", rows, fields={"split": "part"})
    _cli_fails(capsys, s, "rows.jsonl line 3", "'part'", "holdout")

    s = jsonl_study(
        tmp_path / "b", make_rows(5), cleaning=[{"rule": "regex_replace", "pattern": "(unclosed"}]
    )
    with pytest.raises(ConfigError, match=r"data.cleaning\[0\].pattern"):
        data_stage.run(s)


def test_no_partial_snapshot_when_writing_fails(tmp_path, monkeypatch):
    s = jsonl_study(tmp_path, make_rows(60))

    def boom(tmp, final):  # noqa: ANN001
        raise OSError("disk full")

    monkeypatch.setattr(data_stage, "publish_dir", boom)
    with pytest.raises(OSError, match="disk full"):
        data_stage.run(s)
    assert snapshot_dirs(s) == [], "the temporary folder is removed too"
    assert not [e for e in s.ledger.events() if e.kind == "data:snapshot"]


# ---------------------------------------------------------------- cleaning


def test_each_cleaning_rule_reports_what_it_touched():
    texts = [
        "Cafe\u0301  au   lait",  # NFC composes; whitespace collapses
        "\ufb01ne\u00a0print",  # NFKC: ligature and no-break space
        "   ",
        "x" * 50,
        "Call 555-1234 now\r\n\r\n\r\n\r\nbye  ",
        "ok",
    ]
    rules = [
        CleaningRule(rule="unicode_nfc"),
        CleaningRule(rule="unicode_nfkc"),
        CleaningRule(rule="normalize_whitespace"),
        CleaningRule(rule="strip"),
        CleaningRule(rule="drop_empty"),
        CleaningRule(rule="drop_longer_than", max_chars=40),
        CleaningRule(rule="regex_replace", pattern=r"\d{3}-\d{4}", replacement="<PHONE>"),
        CleaningRule(rule="drop_shorter_than", min_chars=3),
        CleaningRule(rule="lowercase"),
    ]
    res = clean_texts(texts, rules)
    eff = {e["rule"]: (e["changed"], e["dropped"]) for e in res.effects}
    assert eff == {
        "unicode_nfc": (1, 0),
        "unicode_nfkc": (1, 0),
        "normalize_whitespace": (3, 0),  # the three texts with runs of spaces or CRLF
        "strip": (2, 0),
        "drop_empty": (0, 1),
        "drop_longer_than": (0, 1),
        "regex_replace": (1, 0),
        "drop_shorter_than": (0, 1),
        "lowercase": (2, 0),
    }
    assert res.texts == ["caf\u00e9 au lait", "fine print", "call <phone> now\n\nbye"]
    assert res.kept == [0, 1, 4]
    assert [r for _, r in res.dropped] == ["drop_empty", "drop_longer_than", "drop_shorter_than"]


def test_rule_effects_are_in_the_manifest(tmp_path):
    rows = make_rows(60)
    rows[3]["text"] = "  " + rows[3]["text"].upper() + "  "
    s = jsonl_study(tmp_path, rows, cleaning=[{"rule": "strip"}, {"rule": "lowercase"}])
    m = data_stage.run(s)
    assert m["cleaning"]["rules"] == [
        {"rule": "strip", "changed": 1, "dropped": 0},
        {"rule": "lowercase", "changed": 1, "dropped": 0},
    ]
    assert len(m["cleaning"]["sha256"]) == 64


# ---------------------------------------------------------------- splits


def test_split_of_a_row_never_moves_when_rows_are_added(tmp_path):
    base = make_rows(300)
    cfg = SplitConfig(seed=3)
    texts = [r["text"] for r in base]
    before = dict(zip(texts, split_by_hash(texts, cfg), strict=True))
    more = base + make_rows(700, start=300) + [{"text": "new", "label": "x"}]
    random.Random(0).shuffle(more)
    texts = [r["text"] for r in more]
    after = dict(zip(texts, split_by_hash(texts, cfg), strict=True))
    assert all(after[t] == s for t, s in before.items())

    # the same property end to end, through cleaning, dedup and the snapshot
    s1 = jsonl_study(tmp_path / "a", base, dedup={"near": False})
    data_stage.run(s1)
    s2 = jsonl_study(tmp_path / "b", more, dedup={"near": False}, splits={"stratify": False})
    data_stage.run(s2)
    where1 = {r["id"]: s for s, rows in all_rows(s1).items() for r in rows}
    where2 = {r["id"]: s for s, rows in all_rows(s2).items() for r in rows}
    assert where1 and all(where2[i] == s for i, s in where1.items())


def test_splits_follow_fractions_per_category_and_seed(tmp_path):
    s = jsonl_study(tmp_path, make_rows(3000), dedup={"near": False})
    m = data_stage.run(s)
    per = m["counts"]["per_category"]
    for label in LABELS:
        n = sum(per[sp][label] for sp in per)
        assert abs(per["train"][label] / n - 0.8) < 0.04
        assert abs(per["validation"][label] / n - 0.1) < 0.03
        assert abs(per["test"][label] / n - 0.1) < 0.03
    texts = [r["text"] for r in make_rows(500)]
    assert split_by_hash(texts, SplitConfig(seed=0)) != split_by_hash(texts, SplitConfig(seed=1))
    assert split_by_hash(texts, SplitConfig(seed=1)) == split_by_hash(texts, SplitConfig(seed=1))


def test_user_split_column_is_respected(tmp_path):
    rows = [{**r, "part": ["train", "valid", "test"][i % 3]} for i, r in enumerate(make_rows(30))]
    s = jsonl_study(tmp_path, rows, fields={"split": "part"})
    m = data_stage.run(s)
    assert m["counts"]["final"] == {"train": 10, "validation": 10, "test": 10}
    assert m["splits"]["method"] == "column"


# ---------------------------------------------------------------- duplicates through the snapshot


def test_exact_and_near_duplicates_across_splits_drop_eval(tmp_path):
    rows = [{**r, "part": "train"} for r in make_rows(40)]
    long_text = ticket(999, "sales", n_words=80)
    edited = long_text.split()
    edited[40] = "changed"
    rows += [
        {"text": "  " + rows[0]["text"].upper() + " ", "label": "billing", "part": "test"},
        {"text": " ".join(edited), "label": "sales", "part": "validation"},
        {"text": long_text, "label": "sales", "part": "train"},
        {"text": ticket(1000, "outage"), "label": "outage", "part": "validation"},
        {"text": ticket(1001, "outage"), "label": "outage", "part": "test"},
    ]
    s = jsonl_study(tmp_path, rows, fields={"split": "part"})
    m = data_stage.run(s)
    snap = load_snapshot(s)
    dup = json.loads((snap.dir / "duplicates.json").read_text())
    kinds = {(p["split_a"], p["split_b"], p["kind"]) for p in dup["pairs"]}
    assert ("train", "test", "exact") in kinds or ("test", "train", "exact") in kinds
    near = [p for p in dup["pairs"] if p["kind"] == "near"]
    assert len(near) == 1 and 0.8 <= near[0]["similarity"] < 1.0
    removed = {r["split"]: r for r in dup["removed"]}
    assert set(removed) == {"test", "validation"}
    assert removed["test"]["kind"] == "exact" and removed["test"]["similarity"] == 1.0
    assert removed["validation"]["kind"] == "near"
    assert m["counts"]["final"] == {"train": 41, "validation": 1, "test": 1}
    assert m["duplicates"]["across_split_pairs"] == 2 and m["duplicates"]["removed"] == 2
    assert m["dedup"]["policy"] == "drop_eval"
    ids = {r["id"] for r in snap.rows("validation")}
    assert removed["validation"]["id"] not in ids


@pytest.mark.parametrize(
    ("policy", "final"),
    [
        ("report_only", {"train": 42, "validation": 2, "test": 1}),
        ("drop_all_but_one", {"train": 40, "validation": 1, "test": 1}),
    ],
)
def test_duplicate_policies(tmp_path, policy, final):
    rows = [{**r, "part": "train"} for r in make_rows(40)]
    rows += [
        {**rows[5], "part": "train"},  # a within-train exact duplicate
        {**rows[6], "part": "train"},
        {**rows[7], "part": "validation"},
        {"text": ticket(500, "sales"), "label": "sales", "part": "validation"},
        {"text": ticket(501, "sales"), "label": "sales", "part": "test"},
    ]
    s = jsonl_study(tmp_path, rows, fields={"split": "part"}, dedup={"policy": policy})
    m = data_stage.run(s)
    assert m["counts"]["final"] == final
    assert m["duplicates"]["exact_pairs"] == 3
    assert m["dedup"]["policy"] == policy


def test_exact_duplicates_share_a_hash_split(tmp_path):
    rows = make_rows(200)
    rows += [{**r, "text": r["text"].upper() + "  "} for r in rows[:50]]
    s = jsonl_study(tmp_path, rows, dedup={"policy": "report_only"})
    m = data_stage.run(s)
    assert m["duplicates"]["exact_pairs"] == 50
    assert m["duplicates"]["across_split_pairs"] == 0


# ---------------------------------------------------------------- snapshot identity, tamper, seal


def test_same_inputs_same_id_and_reuse(tmp_path, capsys):
    s = jsonl_study(tmp_path, make_rows(90))
    code, out, err = run_cli(capsys, "data", "-s", s.root)
    assert code == 0, err
    assert "examples per split and category" in out and "duplicates" in out
    first = latest_snapshot_id(s)
    code, out, _ = run_cli(capsys, "data", "-s", s.root)
    assert code == 0 and "unchanged" in out and snapshot_dirs(s) == [first]

    code, out, _ = run_cli(capsys, "data", "-s", s.root, "--set", "data.splits.seed=7", "--json")
    second = json.loads(out)["snapshot_id"]
    assert code == 0 and second != first and latest_snapshot_id(s) == second
    assert sorted(snapshot_dirs(s)) == sorted([first, second])
    events = [e for e in s.ledger.events() if e.kind == "data:snapshot"]
    assert [e.detail_object()["snapshot_id"] for e in events] == [first, first, second]

    # the id depends on the source content, not on where it lives
    other = jsonl_study(tmp_path / "moved", make_rows(90))
    assert data_stage.run(other)["snapshot_id"] == first


def test_manifest_records_inputs_rules_counts_and_hashes(tmp_path):
    s = jsonl_study(tmp_path, make_rows(90), cleaning=[{"rule": "strip"}])
    m = data_stage.run(s)
    snap = load_snapshot(s, m["snapshot_id"][:6])  # a unique prefix works
    assert snap.id == m["snapshot_id"] == snap.dir.name
    for key in ("created_at", "source", "fields", "cleaning", "transforms", "splits", "dedup"):
        assert key in snap.manifest, key
    assert set(snap.manifest["files"]) == {
        "train.jsonl",
        "validation.jsonl",
        "test.jsonl",
        "duplicates.json",
        "dropped.jsonl",
    }
    assert sum(m["counts"]["final"].values()) == 90
    assert snap.labels == LABELS
    assert (snap.dir / "DONE").exists()


@pytest.mark.parametrize("target", ["train.jsonl", "test.jsonl", "manifest.json", "extra"])
def test_tampering_is_refused(tmp_path, capsys, target):
    s = jsonl_study(tmp_path, make_rows(90))
    sid = data_stage.run(s)["snapshot_id"]
    folder = s.records / "data" / sid
    if target == "extra":
        (folder / "notes.txt").write_text("hi")
    elif target == "manifest.json":
        m = json.loads((folder / target).read_text())
        m["counts"]["final"]["train"] += 1
        (folder / target).write_text(json.dumps(m))
    else:
        text = (folder / target).read_text()
        (folder / target).write_text(text.replace("ticket", "tickets", 1))
    with pytest.raises(SnapshotError, match="modified after it was made"):
        load_snapshot(s, sid)
    code, _, err = run_cli(capsys, "data", "-s", s.root, "--verify")
    assert code == 2 and sid in err and "hint:" in err
    # building again with the same inputs refuses to reuse the damaged folder
    with pytest.raises(SnapshotError):
        data_stage.run(s)


def test_rows_reread_checks_hashes(tmp_path):
    s = jsonl_study(tmp_path, make_rows(90))
    snap = load_snapshot(s, data_stage.run(s)["snapshot_id"])
    assert snap.rows("validation")
    path = snap.dir / "validation.jsonl"
    path.write_text(path.read_text() + '{"id": "x", "text": "planted", "label": "sales"}\n')
    with pytest.raises(SnapshotError, match="validation.jsonl no longer matches"):
        snap.rows("validation")


def test_test_split_is_sealed_and_openings_are_logged(tmp_path):
    s = jsonl_study(tmp_path, make_rows(90))
    data_stage.run(s)
    snap = load_snapshot(s)
    with pytest.raises(EvaluationError, match="sealed") as exc:
        snap.rows("test")
    assert "--final" in (exc.value.hint or "")
    assert s.ledger.test_openings() == []
    with pytest.raises(EvaluationError, match="who opens it and why"):
        open_test_split(s, snap, who="", why="")
    rows = open_test_split(s, snap, who="eval --final", why="final check", run_id="run-1")
    assert len(rows) == snap.counts["test"] > 0
    assert set(rows[0]) == {"id", "text", "label", "target"}
    (opening,) = s.ledger.test_openings()
    assert opening.who == "eval --final" and opening.why == "final check"
    assert opening.snapshot == snap.id and opening.run_id == "run-1" and opening.at
    open_test_split(s, snap.id, who="eval --final", why="again")
    assert len(s.ledger.test_openings()) == 2


def test_no_snapshot_yet(tmp_path):
    s = jsonl_study(tmp_path, make_rows(5))
    assert latest_snapshot_id(s) is None
    with pytest.raises(SnapshotError, match="no data snapshot yet"):
        load_snapshot(s)
    with pytest.raises(SnapshotError, match="no data snapshot 'nope'"):
        load_snapshot(s, "nope")


def test_max_examples_is_a_seeded_sample(tmp_path):
    s = jsonl_study(tmp_path, make_rows(300), max_examples=120)
    m = data_stage.run(s)
    assert sum(m["counts"]["final"].values()) == 120 and m["counts"]["sampled_out"] == 180
    again = jsonl_study(tmp_path, make_rows(300), max_examples=120)
    assert data_stage.run(again)["snapshot_id"] == m["snapshot_id"]


# ---------------------------------------------------------------- label names, leftovers, file names


def folder_corpus(root: Path, labels: list[str], n: int = 12) -> Path:
    for k, label in enumerate(labels):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / label / f"{i:03d}.txt").write_text(ticket(100 * k + i, label.strip()))
    return root


ALIKE = {
    "case": ("sport", "Sport"),
    "spaces": ("sport", "sport "),
    "unicode form": ("caf\u00e9", "cafe\u0301"),
    "invisible": ("tech", "te\u200bch"),
}


@pytest.mark.parametrize("fmt", ["folder", "csv"])
@pytest.mark.parametrize("kind", sorted(ALIKE))
def test_labels_alike_by_name_are_refused_in_every_format(tmp_path, capsys, fmt, kind):
    one, other = ALIKE[kind]
    labels = ["billing", one, other]
    if fmt == "folder":
        folder_corpus(tmp_path / "s" / "corpus", labels)
        s = make_study(tmp_path / "s", {"source": {"format": "folder", "path": "corpus"}})
    else:
        import csv

        (tmp_path / "s").mkdir(parents=True)
        with open(tmp_path / "s" / "d.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            for i in range(36):
                w.writerow([ticket(i, "x"), labels[i % 3]])
        s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "d.csv"}})
    code, _, err = run_cli(capsys, "data", "-s", s.root)
    assert code == 2, err
    text = " ".join(err.split())
    assert "spelt in several ways" in text and ascii(other)[1:-1] in text, text
    assert snapshot_dirs(s) == []


def test_leftovers_of_systems_archivers_and_notebooks_are_skipped_with_a_note(tmp_path):
    root = folder_corpus(tmp_path / "s" / "corpus", LABELS)
    folder_corpus(root / "__MACOSX", ["billing"], n=2)
    (root / ".ipynb_checkpoints").mkdir()
    (root / "sales" / "._000.txt").write_bytes(b"\x00\x05\x16\x07 resource fork")
    (root / "sales" / "Thumbs.db").write_bytes(b"\xd0\xcf")
    (root / "sales" / "~$001.txt").write_text("an Office lock file")
    s = make_study(tmp_path / "s", {"source": {"format": "folder", "path": "corpus"}})
    m = data_stage.run(s)
    assert m["labels"] == LABELS
    (note,) = [n for n in m["notes"] if "leftover" in n]
    assert "__MACOSX/" in note and "sales/._000.txt" in note and "sales/~$001.txt" in note


def test_a_file_name_that_is_not_utf8_is_named_escaped_exit_2(tmp_path, capsys):
    root = folder_corpus(tmp_path / "s" / "corpus", LABELS)
    import os

    with open(os.path.join(os.fsencode(root / "sales"), b"caf\xe9.txt"), "w") as f:
        f.write("a ticket about sales")
    s = make_study(tmp_path / "s", {"source": {"format": "folder", "path": "corpus"}})
    err = _cli_fails(capsys, s, "not valid UTF-8", "sales/caf\\xe9.txt")
    assert "please report" not in err


def test_a_number_among_text_labels_is_noted(tmp_path):
    p = tmp_path / "s" / "d.csv"
    p.parent.mkdir(parents=True)
    rows = [f"{ticket(i, LABELS[i % 4] if i % 4 < 3 else '1')},{LABELS[i % 4] if i % 4 < 3 else 1}"
            for i in range(80)]  # fmt: skip
    p.write_text("text,label\n" + "\n".join(rows) + "\n")
    s = make_study(tmp_path / "s", {"source": {"format": "csv", "path": "d.csv"}})
    (note,) = [n for n in data_stage.run(s)["notes"] if "written as numbers" in n]
    assert "'1' (20 row(s): d.csv line 5" in note and "3 text label(s)" in note


def test_an_absurdly_long_label_is_refused(tmp_path, capsys):
    rows = make_rows(60) + [{"text": "x y z", "label": "word " * 60}]
    s = jsonl_study(tmp_path, rows)
    _cli_fails(capsys, s, "label of more than 200 characters", "rows.jsonl line 61")
