"""Task kinds: rendering, parsing (forgiving wrappers, strict content), verdicts, labels."""

from __future__ import annotations

import json

import pytest
import yaml

from tunelab.core.config import validate_config
from tunelab.core.errors import ConfigError, DataError
from tunelab.lib.tasks import ClassificationTask, ExtractionTask, FormatTask, get_task
from tunelab.stages.hypothesis.template import render_study_yaml


def make_cfg(kind: str, **task):
    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    raw["task"].update(task)
    return validate_config(raw)


# ---------------------------------------------------------------- get_task and labels


def test_get_task_per_kind():
    assert isinstance(get_task(make_cfg("classification"), ["b", "a"]), ClassificationTask)
    assert isinstance(get_task(make_cfg("format")), FormatTask)
    assert isinstance(get_task(make_cfg("extraction")), ExtractionTask)


def test_labels_from_data_sorted_or_from_config_in_order():
    assert get_task(make_cfg("classification"), ["tech", "sport", "tech"]).labels == [
        "sport",
        "tech",
    ]
    cfg = make_cfg("classification", labels=["tech", "sport"])
    assert get_task(cfg, ["sport"]).labels == ["tech", "sport"]


def test_labels_problems_are_named():
    with pytest.raises(DataError, match="not in task.labels.*'ham'"):
        get_task(make_cfg("classification", labels=["spam", "eggs"]), ["spam", "ham"])
    with pytest.raises(ConfigError, match="at least 2 labels"):
        get_task(make_cfg("classification"), ["only"])
    with pytest.raises(ConfigError, match="duplicates"):
        get_task(make_cfg("classification", labels=["a", "a"]), None)


def test_metric_names():
    assert "macro_f1" in get_task(make_cfg("classification"), ["a", "b"]).metric_names
    assert "format_valid_rate" in get_task(make_cfg("format")).metric_names
    regex_task = get_task(make_cfg("format", json_schema=None, regex=r"\d+"))
    assert "json_valid_rate" not in regex_task.metric_names
    names = get_task(make_cfg("extraction")).metric_names
    for m in ("json_valid_rate", "schema_valid_rate", "field_presence_rate", "field_accuracy"):
        assert m in names


# ---------------------------------------------------------------- classification


@pytest.fixture
def clf():
    return get_task(make_cfg("classification", instruction="Pick a topic."), ["sport", "tech"])


def test_classification_render(clf):
    assert clf.render({"id": "1", "text": "goal!", "label": "sport"}) == ("goal!", "sport")
    assert "sport, tech" in clf.instruction and clf.instruction.startswith("Pick a topic.")
    with pytest.raises(DataError, match="'7'.*'golf' is not in the label set"):
        clf.render({"id": "7", "text": "x", "label": "golf"})
    with pytest.raises(DataError, match="field 'text'"):
        clf.render({"id": "8", "text": None, "label": "sport"})


@pytest.mark.parametrize(
    "raw,label",
    [
        ("sport", "sport"),
        ("  Tech.\n", "tech"),
        ('"sport"', "sport"),
        ("sport, because of the goal", "sport"),
        ("TECH\nexplanation", "tech"),
    ],
)
def test_classification_parse_maps_to_label(clf, raw, label):
    parsed = clf.parse(raw)
    assert parsed["valid"] and parsed["label"] == label and parsed["failure"] is None


@pytest.mark.parametrize(
    "raw,kind", [("", "empty"), ("sports", "not_a_label"), ("golf", "not_a_label")]
)
def test_classification_parse_failures(clf, raw, kind):
    parsed = clf.parse(raw)
    assert not parsed["valid"] and parsed["failure"] == kind and parsed["label"] is None


def test_classification_longest_label_wins():
    task = ClassificationTask(["tech", "tech news"], "")
    assert task.parse("tech news today")["label"] == "tech news"
    assert task.parse("tech today")["label"] == "tech"


def test_classification_verdicts(clf):
    ex = {"id": "1", "text": "x", "label": "tech"}
    assert clf.verdicts(clf.parse("tech"), ex)["correct"] is True
    assert clf.verdicts(clf.parse("sport"), ex)["correct"] is False


# ---------------------------------------------------------------- format


def test_format_json_schema_strict():
    task = get_task(make_cfg("format"))  # schema: object with required string 'answer'
    ok = task.parse(' {"answer": "yes"} \n')
    assert ok["valid"] and ok["value"] == {"answer": "yes"}
    assert task.parse('{"answer": 3}')["failure"] == "schema_error"
    assert "answer" in task.parse("{}")["error"]
    assert task.parse('{"answer": "yes"')["failure"] == "parse_error"
    # the format must be the whole answer: a code fence breaks it
    assert task.parse('```json\n{"answer": "yes"}\n```')["failure"] == "parse_error"
    assert task.parse("   ")["failure"] == "empty"
    ex = {"id": "1", "text": "q", "target": '{"answer": "yes"}'}
    assert task.render(ex) == ("q", '{"answer": "yes"}')
    assert task.verdicts(ok, ex)["exact_match"] is True
    assert task.verdicts(task.parse('{"answer": "no"}'), ex)["exact_match"] is False


def test_format_json_answer_is_read_as_strictly_as_the_gold():
    task = get_task(make_cfg("format", json_schema={"type": ["object", "number"]}))
    for raw, says in (
        ('{"answer": "a", "answer": "b"}', "key 'answer' given twice"),
        ("NaN", "NaN is not a JSON value"),
        ('{"answer": "a"', "at line 1, column 15"),
    ):
        parsed = task.parse(raw)
        assert parsed["failure"] == "parse_error" and says in parsed["error"], parsed


def test_format_exact_match_tells_true_from_1():
    task = get_task(make_cfg("format", json_schema={"type": "object"}))
    ex = {"id": "1", "text": "q", "target": '{"n": 1, "ok": true, "xs": [1, 2]}'}
    exact = {
        raw: task.verdicts(task.parse(raw), ex)["exact_match"]
        for raw in (
            '{"n": true, "ok": 1, "xs": [1, 2]}',
            '{"n": 1.0, "ok": true, "xs": [1, 2.0]}',
            '{"xs": [1, 2], "ok": true, "n": 1}',
            '{"n": 1, "ok": true, "xs": [2, 1]}',
            '{"n": 1, "ok": true, "xs": [1, 2], "extra": null}',
        )
    }
    assert list(exact.values()) == [False, True, True, False, False]


def test_format_regex_full_match():
    task = get_task(make_cfg("format", json_schema=None, regex=r"\d{4}-\d{2}-\d{2}"))
    assert task.parse("2002-08-22\n")["valid"]
    assert task.parse("on 2002-08-22")["failure"] == "no_match"
    assert task.parse("2002-08-22 12:00")["failure"] == "no_match"


def test_format_regex_failure_says_where_the_answer_leaves_the_format():
    task = get_task(make_cfg("format", json_schema=None, regex=r"From: \S+@\S+ \| Subject: .+"))
    error = {
        raw: task.parse(raw)["error"]
        for raw in (
            "From: a@b.c | Subject: Hi\nHope this helps!",
            "From: a@b.c | Subject",
            "Sure! From: a@b.c | Subject: Hi",
            "I cannot do that.",
        )
    }
    assert list(error.values()) == [
        "the first line matches task.regex, then 1 more line(s) follow",
        "does not match task.regex (starts 'From: a@b.c | Subject')",
        "holds a match of task.regex at character 7, but the whole answer must match",
        "does not match task.regex (starts 'I cannot do that.')",
    ]
    date = get_task(make_cfg("format", json_schema=None, regex=r"\d{4}-\d{2}-\d{2}"))
    assert date.parse("2002-08-22 12:00")["error"] == (
        "matches task.regex up to character 10 of 16; the rest does not (' 12:00')"
    )


def test_format_regex_dot_stops_at_a_newline_as_python_reads_it():
    # `.+` for a one-line answer must not accept a line of chatter after it
    one_line = get_task(make_cfg("format", json_schema=None, regex=r"Subject: .+"))
    assert one_line.parse("Subject: Hi")["valid"]
    assert one_line.parse("Subject: Hi\nLet me know if you need more.")["failure"] == "no_match"
    spans = get_task(make_cfg("format", json_schema=None, regex=r"(?s)Subject: .+"))
    assert spans.parse("Subject: Hi\nLet me know if you need more.")["valid"]


def test_format_bad_locked_spec_is_named():
    # a task section read from a record, past the config's checks, is still refused by name
    with pytest.raises(ConfigError, match="task.regex: not a valid"):
        FormatTask("i", None, "(unclosed")
    with pytest.raises(ConfigError, match="task.json_schema: not a valid"):
        FormatTask("i", {"type": "no-such-type"}, None)


@pytest.mark.parametrize(
    ("task", "where", "says"),
    [
        ({"json_schema": None, "regex": "(unclosed"}, "task.regex", "not a valid regular"),
        ({"json_schema": None, "regex": ""}, "task.regex", "empty"),
        ({"json_schema": None, "regex": "  "}, "task.regex", "empty"),
        ({"json_schema": {"properties": {"a": {"type": 3}}}}, "task.json_schema", "properties/a"),
    ],
)
def test_format_spec_that_cannot_work_is_refused_by_the_config(task, where, says):
    # validate and register read the config: a broken spec must stop there, not crash `data`
    with pytest.raises(ConfigError) as err:
        make_cfg("format", **task)
    assert f"{where}: " in str(err.value) and says in str(err.value)


def test_format_missing_target_names_example():
    task = get_task(make_cfg("format"))
    with pytest.raises(DataError, match="'9'.*no target"):
        task.render({"id": "9", "text": "q", "target": None})


# ---------------------------------------------------------------- extraction


@pytest.fixture
def ext():
    return get_task(make_cfg("extraction"))  # required: sender, subject (strings)


GOLD = {"id": "e1", "text": "mail", "target": '{"sender": "a@b.c", "subject": "Hi there"}'}


def test_extraction_code_fence_and_trailing_text(ext):
    parsed = ext.parse('Sure!\n```json\n{"sender": "a@b.c", "subject": "Hi there"}\n```\nDone.')
    assert parsed["valid"] and parsed["fields"] == {"sender": "a@b.c", "subject": "Hi there"}
    parsed = ext.parse('{"sender": "a@b.c", "subject": "Hi"} and some words {"x": 1}')
    assert parsed["valid"] and parsed["value"] == {"sender": "a@b.c", "subject": "Hi"}
    # an unclosed fence at the end of a generation still parses
    assert ext.parse('```json\n{"sender": "a", "subject": "b"}')["valid"]


@pytest.mark.parametrize(
    "raw,kind",
    [
        ("", "empty"),
        ("no json here", "parse_error"),
        ('{"sender": "a@b.c", "subject": ', "parse_error"),
        ("{'sender': 'a'}", "parse_error"),
        ("[1, 2]", "not_an_object"),
        ('{"sender": "a@b.c"}', "schema_error"),
        ('{"sender": "a@b.c", "subject": 42}', "schema_error"),
    ],
)
def test_extraction_failure_kinds(ext, raw, kind):
    parsed = ext.parse(raw)
    assert not parsed["valid"] and parsed["failure"] == kind
    assert set(parsed["present"]) == {"sender", "subject"}


def test_extraction_presence_per_field(ext):
    parsed = ext.parse('{"sender": "a@b.c", "subject": ""}')
    assert parsed["json_valid"] and parsed["present"] == {"sender": True, "subject": False}
    parsed = ext.parse('{"sender": "a@b.c"}')
    assert parsed["json_valid"] and not parsed["schema_valid"]
    assert parsed["present"] == {"sender": True, "subject": False}
    assert "subject" in parsed["error"]


def test_extraction_verdicts(ext):
    v = ext.verdicts(ext.parse('{"sender": "a@b.c", "subject": "Hi  there"}'), GOLD)
    # the subject matches after normalization, but is not exactly the gold text
    assert v["correct"] and not v["exact_match"]
    assert v["paths"]["subject"]["match"] == 1 and "exact" not in v["paths"]["subject"]
    v = ext.verdicts(ext.parse('{"sender": "x@y.z", "subject": "Hi there"}'), GOLD)
    assert v["paths"]["sender"]["wrong_value"] == 1 and v["paths"]["subject"]["exact"] == 1
    assert not v["correct"] and not v["exact_match"]
    v = ext.verdicts(ext.parse("garbage"), GOLD)
    assert not v["json_valid"] and v["json_failure"] == "no_json"
    assert v["paths"]["sender"] == {"slots": 1, "gold": 1, "not_json": 1}
    with pytest.raises(DataError, match="'bad'.*not a JSON object"):
        ext.verdicts(ext.parse("{}"), {"id": "bad", "text": "t", "target": "oops"})


def test_extraction_target_as_object_is_serialized(ext):
    ex = {"id": "o", "text": "t", "target": {"sender": "a", "subject": "é"}}
    assert json.loads(ext.render(ex)[1]) == {"sender": "a", "subject": "é"}


@pytest.mark.parametrize("kind", ["classification", "format", "extraction"])
def test_template_lists_every_text_field_mapping(kind):
    # a user with an id column finds data.fields.id in the study.yaml init writes
    from tunelab.core.config_sections import FieldsConfig

    raw = yaml.safe_load(render_study_yaml(kind, "t"))
    assert set(raw["data"]["fields"]) == set(FieldsConfig.model_fields) - {"image"}
    # a format task has no labels: stratifying by them would promise what it cannot do
    assert raw["data"]["splits"]["stratify"] is (kind != "format")
