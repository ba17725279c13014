"""Extraction scoring rule by rule, against hand-computed counts: the JSON reader, values
(numbers, strings, booleans, null), lists as multisets (partial, reordered, extra items, empty
gold with every kind of answer), lists of objects with their sub-fields, nested objects, the
alignment and its tie rule, options, aggregates and guardrails per path, target kinds and the
splits that keep them."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tunelab.core.config_sections import SplitConfig
from tunelab.core.errors import ConfigError, DataError
from tunelab.lib import metrics as M
from tunelab.lib.tasks import ExtractionTask, find_json_object
from tunelab.lib.tasks.alignment import align
from tunelab.lib.tasks.schema_scoring import SchemaScorer
from tunelab.stages.compare.guardrails import check_guardrails
from tunelab.stages.data.splits import (
    _distance,
    counts_by_kinds,
    ensure_kind_coverage,
    kind_gaps,
    split_by_hash,
    unit_hash,
)

# ---------------------------------------------------------------- the JSON reader


@pytest.mark.parametrize(
    "raw,failure,value",
    [
        ('{"a": 1}', None, {"a": 1}),
        ('```json\n{"a": 1}\n```', None, {"a": 1}),  # a full fence
        ('{"a": 1}\n```', None, {"a": 1}),  # a stray closing fence
        ('{"a": 1}```', None, {"a": 1}),
        ('```\n{"a": 1}', None, {"a": 1}),  # an opening fence never closed
        ('Here it is:\n{"a": 1}\nHope this helps.', None, {"a": 1}),  # prose around
        ('Fill {name}: {"a": "}"}', None, {"a": "}"}),  # braces in prose and in a string
        ('{"a": 1} then {"b": 2}', None, {"a": 1}),  # the first object is the answer
        ('{"a": {"b": 1}, "c": "cut', "truncated", None),  # not the inner object
        ("```json\n{'a': 1}\n```", "invalid_json", None),
        ('{"a": NaN}', "invalid_json", None),
        # a key given twice: neither value is taken, nor the object after it
        ('{"a": 1, "a": 2}', "invalid_json", None),
        ('{"a": {"b": 1, "b": 2}} then {"a": 3}', "invalid_json", None),
        ('[{"a": 1, "a": 2}]', "invalid_json", None),
        ('[{"a": 1}]', "not_an_object", [{"a": 1}]),  # a list holding the object
        ("```json\n[1, 2]\n```", "not_an_object", [1, 2]),
        ("42", "not_an_object", 42),
        ("null", "not_an_object", None),
        ("I cannot find it.", "no_json", None),
        ("", "empty", None),
        ("  \n", "empty", None),
    ],
)
def test_reader(raw, failure, value):
    found = find_json_object(raw)
    assert (found.failure, found.value) == (failure, value)
    assert (found.error is None) == (failure is None)


def test_a_key_given_twice_is_named_and_ends_the_generation():
    from tunelab.lib.tasks.json_text import answer_complete

    found = find_json_object('{"list_id": null, "list_id": "x.org"}')
    assert "key 'list_id' given twice" in found.error
    assert answer_complete('{"a": 1, "a": 2}')  # no continuation can make it readable
    assert not answer_complete('{"a": 1, "a": ')


def test_a_gold_target_is_read_strictly():
    """A gold object is exactly one JSON object: a key given twice does not take its last
    value, and prose or a fence around it (which answers may have) is refused."""
    task = ExtractionTask("x", {"type": "object", "required": ["a"]})
    for target, problem in [
        ('{"a": 1, "a": 2}', "key 'a' given twice"),
        ('{"a": {"b": 1, "b": 1}}', "key 'b' given twice"),
        ('Gold: {"a": 1}', "Expecting value at line 1, column 1"),
        ('```json\n{"a": 1}\n```', "Expecting value"),
        ('{"a": NaN}', "NaN"),
        ('["a"]', "a JSON array, not an object"),
    ]:
        with pytest.raises(DataError, match="'g1': the target is not a JSON object") as err:
            task.gold({"id": "g1", "target": target})
        assert problem in err.value.message, target
        (p,) = task.target_problems([{"id": "g1", "target": target}])
        assert p["kind"] == "target_not_json" and problem in p["message"]
    assert task.gold({"id": "g2", "target": ' {"a": "2"}\n'}) == {"a": "2"}  # no coercion


def test_stray_fence_parses_as_the_full_fence_does():
    """The same answer wrapped three ways is one parse: valid JSON, every field right."""
    task = ExtractionTask("x", {"type": "object", "required": ["a"]})
    ex = {"id": "1", "target": '{"a": "x"}'}
    for raw in ('{"a": "x"}', '```json\n{"a": "x"}\n```', '{"a": "x"}\n```'):
        v = task.verdicts(task.parse(raw), ex)
        assert v["json_valid"] and v["correct"] and v["exact_match"], raw


# ---------------------------------------------------------------- values


def _one(schema_node, gold, answer, **options):
    """Counts of the single field `v` (answer MISSING when `answer` is ...)."""
    scorer = SchemaScorer(
        {"type": "object", "required": ["v"], "properties": {"v": schema_node}}, **options
    )
    given = {} if answer is ... else {"v": answer}
    return scorer.score({"v": gold}, given)["v"]


NUM = {"type": "number"}
ANY: dict = {}
# (schema, gold, answer, options, counts): hand-computed; zero counts are left out
VALUE_CASES = [
    # numbers: by value, not by text; a string is another type
    (NUM, 2, 2, {}, dict(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
    (NUM, 2, 2.0, {}, dict(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
    (NUM, 2, "2", {}, dict(slots=1, present=1, pred=1, gold=1, wrong_type=1)),
    (NUM, 2.5, 2.51, {}, dict(slots=1, present=1, pred=1, gold=1, wrong_value=1)),
    (
        NUM,
        2.5,
        2.51,
        {"tolerance": {"v": 0.01}},
        dict(slots=1, present=1, match=1, tp=1, pred=1, gold=1),
    ),
    (NUM, 2.5, 2.52, {"tolerance": {"v": 0.01}}, dict(slots=1, present=1, pred=1, gold=1, wrong_value=1)),
    # booleans and null: exactly (true is not 1)
    (ANY, True, 1, {}, dict(slots=1, present=1, pred=1, gold=1, wrong_type=1)),
    (ANY, True, True, {}, dict(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
    # a null gold answered null: not present, but answered (presence rates count it)
    (ANY, None, None, {}, dict(slots=1, empty_match=1, exact=1, match=1)),
    (ANY, None, "", {}, dict(slots=1, wrong_type=1)),
    (ANY, None, ..., {}, dict(slots=1, missing=1)),
    (ANY, "x", None, {}, dict(slots=1, gold=1, wrong_type=1)),
    # strings: the normalization (case, width, spaces, quotes, brackets, final stop)
    (ANY, "Hi there", " hi  THERE.", {}, dict(slots=1, present=1, match=1, tp=1, pred=1, gold=1)),
    (ANY, "ｆｕｌｌ", "full", {}, dict(slots=1, present=1, match=1, tp=1, pred=1, gold=1)),
    (ANY, "<bob@x.org>", "bob@x.org", {}, dict(slots=1, present=1, match=1, tp=1, pred=1, gold=1)),
    (ANY, "alice", "alicia", {}, dict(slots=1, present=1, pred=1, gold=1, wrong_value=1)),
    (ANY, "a", ..., {}, dict(slots=1, gold=1, missing=1)),
]  # fmt: skip


@pytest.mark.parametrize("node,gold,answer,options,counts", VALUE_CASES)
def test_values(node, gold, answer, options, counts):
    assert _one(node, gold, answer, **options) == counts


# ---------------------------------------------------------------- lists of objects

QUANTITIES = {
    "type": "object",
    "required": ["quantities"],
    "properties": {
        "quantities": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["value", "unit"],
                "properties": {"value": {"type": "number"}, "unit": {"type": "string"}},
            },
        }
    },
}
A, B, C = {"value": 2, "unit": "kg"}, {"value": 5, "unit": "m"}, {"value": 7, "unit": "s"}
MISSING_KEY = object()


def _lists(gold, answer, **options):
    """(list counts, value counts, unit counts) of one example."""
    scorer = SchemaScorer(QUANTITIES, **options)
    if answer == "garbage":
        out = scorer.score({"quantities": gold}, None, "not_json")
    else:
        given = {} if answer is MISSING_KEY else {"quantities": answer}
        out = scorer.score({"quantities": gold}, given)
    return (
        out["quantities"],
        out.get("quantities[].value", {}),
        out.get("quantities[].unit", {}),
    )


def c(**kw):
    return kw


LIST_CASES = [
    # name, answer, list counts, value counts, unit counts; gold is [A, B]
    ("exact", [A, B], c(slots=1, present=1, exact=1, match=1, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2)),
    # a multiset: another order matches, though not exactly
    ("reordered", [B, A], c(slots=1, present=1, match=1, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2)),
    # one of two items: item recall 1/2, and the paired item's fields are right
    ("partial", [A], c(slots=1, present=1, tp=1, pred=1, gold=2, wrong_value=1),
     c(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1),
     c(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
    # an extra item costs precision only; C shares nothing with A or B and stays unpaired
    ("extra", [A, B, C], c(slots=1, present=1, tp=2, pred=3, gold=2, wrong_value=1),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2)),
    # half the items right: B's value is wrong; B is still paired by its unit
    ("half right", [A, {"value": 6, "unit": "m"}],
     c(slots=1, present=1, tp=1, pred=2, gold=2, wrong_value=1),
     c(slots=2, present=2, exact=1, match=1, tp=1, pred=2, gold=2, wrong_value=1),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2)),
    # a unit in capitals matches by normalization
    ("normalized", [A, {"value": 5.0, "unit": "M"}],
     c(slots=1, present=1, match=1, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2),
     c(slots=2, present=2, exact=1, match=2, tp=2, pred=2, gold=2)),
    # a number written as a string: the item is wrong, its value a wrong type
    ("string number", [{"value": "2", "unit": "kg"}, B],
     c(slots=1, present=1, tp=1, pred=2, gold=2, wrong_value=1),
     c(slots=2, present=2, exact=1, match=1, tp=1, pred=2, gold=2, wrong_type=1),
     c(slots=2, present=2, exact=2, match=2, tp=2, pred=2, gold=2)),
    # a duplicate pairs once; the second copy agrees with B on nothing
    ("duplicate", [A, A], c(slots=1, present=1, tp=1, pred=2, gold=2, wrong_value=1),
     c(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1),
     c(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
    ("null", None, c(slots=1, gold=2, wrong_type=1), {}, {}),
    ("missing key", MISSING_KEY, c(slots=1, gold=2, missing=1), {}, {}),
    ("not JSON", "garbage", c(slots=1, gold=2, not_json=1), {}, {}),
]  # fmt: skip


@pytest.mark.parametrize("name,answer,lst,value,unit", LIST_CASES, ids=[x[0] for x in LIST_CASES])
def test_list_of_objects(name, answer, lst, value, unit):
    assert _lists([A, B], answer) == (lst, value, unit)


def test_order_matters_only_when_asked():
    """`ordered` pairs items by position: [B, A] against [A, B] has no item right."""
    assert _lists([A, B], [B, A], ordered=["quantities"]) == (
        c(slots=1, present=1, pred=2, gold=2, wrong_value=1),
        c(slots=2, present=2, pred=2, gold=2, wrong_value=2),
        c(slots=2, present=2, pred=2, gold=2, wrong_value=2),
    )


@pytest.mark.parametrize(
    "coords",
    [
        {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]},
        {"type": "array", "items": [{"type": "number"}, {"type": "number"}]},  # draft 7
    ],
)
def test_a_tuple_is_compared_position_by_position(coords):
    """[lat, lon] answered [lon, lat] is wrong: a tuple's positions are not a multiset."""
    schema = {"type": "object", "required": ["at"], "properties": {"at": coords}}
    if isinstance(coords["items"] if "items" in coords else None, list):
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    task = ExtractionTask("x", schema)
    gold = {"id": "1", "target": '{"at": [48.8, 2.3]}'}
    swapped = task.verdicts(task.parse('{"at": [2.3, 48.8]}'), gold)
    assert not swapped["correct"] and swapped["paths"]["at"]["wrong_value"] == 1
    assert task.verdicts(task.parse('{"at": [48.8, 2.3]}'), gold)["correct"]


def test_a_map_with_an_invented_entry_does_not_match():
    """An object schema naming no fields is a map: its keys are data, so an extra key is wrong
    (an object with named fields ignores keys it does not score)."""
    schema = {
        "type": "object",
        "required": ["headers", "sender"],
        "properties": {
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
            "sender": {"type": "object", "required": ["address"]},
        },
    }
    task = ExtractionTask("x", schema)
    gold = {"id": "1", "target": '{"headers": {"X-A": "1"}, "sender": {"address": "a@x.org"}}'}
    extra = '{"headers": {"X-A": "1", "X-B": "2"}, "sender": {"address": "a@x.org", "n": 1}}'
    paths = task.verdicts(task.parse(extra), gold)["paths"]
    assert paths["headers"].get("match", 0) == 0 and paths["headers"]["wrong_value"] == 1
    assert paths["sender"]["match"] == 1  # named fields: the extra key is not scored
    same = '{"headers": {"X-A": "1"}, "sender": {"address": "a@x.org"}}'
    assert task.verdicts(task.parse(same), gold)["correct"]


EMPTY_CASES = [
    # gold is []: only [] is right, and each wrong answer is its own kind
    ("[]", [], c(slots=1, empty_match=1, exact=1, match=1)),
    ("null", None, c(slots=1, wrong_type=1)),
    ("missing key", MISSING_KEY, c(slots=1, missing=1)),
    ("not JSON", "garbage", c(slots=1, not_json=1)),
    ("an invented item", [A], c(slots=1, present=1, pred=1, wrong_value=1)),
    ("a string", "[]", c(slots=1, present=1, wrong_type=1)),
]  # fmt: skip


@pytest.mark.parametrize("name,answer,counts", EMPTY_CASES, ids=[x[0] for x in EMPTY_CASES])
def test_empty_gold(name, answer, counts):
    assert _lists([], answer) == (counts, {}, {})


def test_a_right_null_is_a_present_field():
    """A nullable field whose gold is null, answered null, is answered: a perfect answer has
    presence 1, so a variant that stops inventing values does not lose presence."""
    schema = {
        "type": "object",
        "required": ["list_id", "name"],
        "properties": {"list_id": {"type": ["string", "null"]}, "name": {"type": "string"}},
    }
    task = ExtractionTask("x", schema)
    golds = ['{"list_id": null, "name": "a"}', '{"list_id": "l.org", "name": "b"}']

    def metrics(answers):
        verdicts = [
            task.verdicts(task.parse(a), {"id": str(i), "target": g})
            for i, (g, a) in enumerate(zip(golds, answers, strict=True))
        ]
        return M.extraction_metrics(verdicts, task.fields, task.paths)

    perfect = metrics(golds)
    assert perfect["field_presence_rate"] == 1.0
    assert perfect["per_field"]["list_id"]["presence_rate"] == 1.0
    assert perfect["per_field"]["list_id"]["precision"] == 1.0  # a null is no prediction
    invented = metrics(['{"list_id": "x.org", "name": "a"}', golds[1]])
    assert invented["per_field"]["list_id"]["presence_rate"] == 1.0  # given, though wrong
    assert invented["per_field"]["list_id"]["precision"] == 0.5
    dropped = metrics(['{"list_id": null, "name": "a"}', '{"list_id": null, "name": "b"}'])
    assert dropped["per_field"]["list_id"]["presence_rate"] == 0.5


def test_empty_gold_in_every_metric():
    """Over the six answers above, the list path is right once (the []), exact once, and each
    failure kind is counted; no metric credits null, a missing key or garbage."""
    task = ExtractionTask("x", QUANTITIES)
    raws = [
        '{"quantities": []}',
        '{"quantities": null}',
        "{}",
        "garbage",
        json.dumps({"quantities": [A]}),
        '{"quantities": "[]"}',
    ]
    ex = {"id": "e", "target": '{"quantities": []}'}
    verdicts = [task.verdicts(task.parse(r), ex) for r in raws]
    assert [v["correct"] for v in verdicts] == [True, False, False, False, False, False]
    m = M.extraction_metrics(verdicts, task.fields, task.paths)
    row = m["per_field"]["quantities"]
    assert row["normalized_match"] == pytest.approx(1 / 6)
    assert row["exact_match"] == pytest.approx(1 / 6)
    assert row["failures"] == {"missing": 1, "wrong_type": 2, "wrong_value": 1, "not_json": 1}
    # the invented item is the one predicted item, wrong: precision 0, nothing to recall
    assert (row["precision"], row["recall"], row["support"]) == (0.0, 0.0, 0)
    assert m["exact_match"] == m["all_fields_match_rate"] == pytest.approx(1 / 6)


# ---------------------------------------------------------------- lists of scalars, objects


@pytest.mark.parametrize(
    "answer,counts",
    [
        (["b", "a", "b"], c(slots=1, present=1, match=1, tp=3, pred=3, gold=3)),
        (["a", "b"], c(slots=1, present=1, tp=2, pred=2, gold=3, wrong_value=1)),
        (["A", "b", "c", "b"], c(slots=1, present=1, tp=3, pred=4, gold=3, wrong_value=1)),
        ([], c(slots=1, gold=3, wrong_value=1)),
    ],
)
def test_list_of_strings_is_a_multiset(answer, counts):
    node = {"type": "array", "items": {"type": "string"}}
    assert _one(node, ["a", "b", "b"], answer) == counts


def test_list_of_numbers_takes_its_tolerance_at_the_list():
    node = {"type": "array", "items": {"type": "number"}}
    got = _one(node, [1.0, 2.0], [2.004, 0.996], tolerance={"v": 0.01})
    assert got == c(slots=1, present=1, match=1, tp=2, pred=2, gold=2)


ADDRESS = {
    "type": "object",
    "required": ["address"],
    "properties": {
        "address": {
            "type": ["object", "null"],
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
        }
    },
}
GOLD_ADDRESS = {"address": {"city": "Paris", "zip": "75001"}}


@pytest.mark.parametrize(
    "answer,failure,address,city,zip_",
    [
        ({"address": {"city": "paris", "zip": "75001"}}, None,
         c(slots=1, present=1, match=1, tp=1, pred=1, gold=1),
         c(slots=1, present=1, match=1, tp=1, pred=1, gold=1),
         c(slots=1, present=1, exact=1, match=1, tp=1, pred=1, gold=1)),
        ({"address": {"city": "paris"}}, None,
         c(slots=1, present=1, pred=1, gold=1, wrong_value=1),
         c(slots=1, present=1, match=1, tp=1, pred=1, gold=1),
         c(slots=1, gold=1, missing=1)),
        # fields inside a null, missing or unread object inherit its failure kind
        ({"address": None}, None, c(slots=1, gold=1, wrong_type=1),
         c(slots=1, gold=1, wrong_type=1), c(slots=1, gold=1, wrong_type=1)),
        ({}, None, c(slots=1, gold=1, missing=1), c(slots=1, gold=1, missing=1),
         c(slots=1, gold=1, missing=1)),
        (None, "not_json", c(slots=1, gold=1, not_json=1), c(slots=1, gold=1, not_json=1),
         c(slots=1, gold=1, not_json=1)),
    ],
)  # fmt: skip
def test_nested_object(answer, failure, address, city, zip_):
    out = SchemaScorer(ADDRESS).score(GOLD_ADDRESS, answer, failure)
    assert (out["address"], out["address.city"], out["address.zip"]) == (address, city, zip_)


def test_paths_of_a_schema_with_refs_and_nullable_lists():
    schema = {
        "type": "object",
        "required": ["items", "note"],
        "properties": {
            "items": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/item"}}, {"type": "null"}]},
            "note": {"type": ["string", "null"]},
        },
        "$defs": {"item": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }  # fmt: skip
    scorer = SchemaScorer(schema)
    assert {p: s.kind for p, s in scorer.paths.items()} == {
        "items": "list_of_objects",
        "items[].name": "value",
        "note": "value",
    }
    assert scorer.target_kinds({"items": None, "note": "x"}) == ["items null", "note filled"]
    assert scorer.target_kinds({"items": [], "note": None}) == ["items empty", "note null"]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"ordered": ["quantities[].unit"]}, "not a list path"),
        ({"ordered": ["nope"]}, "not a list path"),
        ({"tolerance": {"quantities[].unit": 0.1}}, "not a number path"),
        ({"tolerance": {"quantities": 0.1}}, "not a number path"),
        ({"tolerance": {"quantities[].value": -1.0}}, "expected >= 0"),
    ],
)
def test_options_name_paths_of_the_schema(options, message):
    with pytest.raises(ConfigError, match=message) as err:
        SchemaScorer(QUANTITIES, **options)
    assert "quantities[].value (value)" in err.value.hint


# ---------------------------------------------------------------- alignment


def test_alignment_is_optimal_and_keeps_its_tie_rule():
    """Against every injective pairing: the largest total weight; among those, the first gold
    item takes the earliest answer item it can (an unpaired gold item counts as latest)."""
    rng = random.Random(0)
    for _ in range(400):
        n, m = rng.randint(1, 4), rng.randint(1, 4)
        w = [[rng.choice([0, 0, 1, 2, 3]) for _ in range(m)] for _ in range(n)]
        best = None
        for cols in itertools.product([None, *range(m)], repeat=n):
            used = [j for j in cols if j is not None]
            if len(used) != len(set(used)):
                continue
            key = (
                sum(w[i][j] for i, j in enumerate(cols) if j is not None),
                tuple(m - j if j is not None else 0 for j in cols),
            )
            best = max(best or key, key)
            if key == best:
                chosen = cols
        want = sorted((i, j) for i, j in enumerate(chosen) if j is not None and w[i][j] > 0)
        assert align(w) == want, w


def test_tie_between_pairings_goes_to_the_answer_order():
    """Each pairing agrees on one field per item: the first gold item takes answer item 0."""
    gold = [{"value": 1, "unit": "a"}, {"value": 2, "unit": "b"}]
    answer = [{"value": 2, "unit": "a"}, {"value": 1, "unit": "b"}]
    _, value, unit = _lists(gold, answer)
    assert (unit["match"], value.get("match", 0)) == (2, 0)


def test_whole_matches_come_before_agreement():
    """Pairing P with A (a whole match) and Q with B agrees on as many fields as pairing P with
    B and Q with A; the whole match wins although Q comes first in the answer."""
    schema = {
        "type": "object",
        "required": ["xs"],
        "properties": {
            "xs": {
                "type": "array",
                "items": {"type": "object", "required": ["x", "y", "z"], "properties": {}},
            }
        },
    }
    a, b = {"x": 1, "y": 1, "z": 1}, {"x": 1, "y": 1, "z": 2}
    p, q = dict(a), {"x": 1, "y": 2, "z": 1}
    out = SchemaScorer(schema).score({"xs": [a, b]}, {"xs": [q, p]})
    assert out["xs"]["tp"] == 1


# ---------------------------------------------------------------- aggregates and guardrails


def _metrics(gold_answer_pairs):
    task = ExtractionTask("x", QUANTITIES)
    verdicts = []
    for i, (gold, answer) in enumerate(gold_answer_pairs):
        ex = {"id": str(i), "target": json.dumps({"quantities": gold})}
        verdicts.append(task.verdicts(task.parse(json.dumps({"quantities": answer})), ex))
    return M.extraction_metrics(verdicts, task.fields, task.paths)


def test_per_path_metrics_move_with_half_the_items():
    """[A, B'] for [A, B] and [C] for [C]: one list of two matches; items P = R = 2/3; the
    value is right on 2 of 3 paired items, the unit on all 3."""
    half = _metrics([([A, B], [A, {"value": 6, "unit": "m"}]), ([C], [C])])
    pf = half["per_field"]
    assert pf["quantities"]["normalized_match"] == 0.5
    assert pf["quantities"]["precision"] == pf["quantities"]["recall"] == pytest.approx(2 / 3)
    assert pf["quantities"]["f1"] == pytest.approx(2 / 3) and pf["quantities"]["support"] == 3
    assert pf["quantities[].value"]["normalized_match"] == pytest.approx(2 / 3)
    assert pf["quantities[].unit"]["normalized_match"] == 1.0
    assert pf["quantities[].value"]["slots"] == 3
    assert half["field_micro_f1"] == pytest.approx(2 / 3)
    whole = _metrics([([A, B], [A, B]), ([C], [C])])
    assert whole["per_field"]["quantities"]["f1"] == 1.0


def test_guardrails_every_field_cover_nested_paths():
    base = _metrics([([A, B], [A, B]), ([C], [C])])
    run = _metrics([([A, B], [A, {"value": 5, "unit": "km"}]), ([C], [C])])
    rule = {"metric": "normalized_match", "scope": "every_field", "op": ">=", "value": -0.02}
    verdicts = check_guardrails([{**rule, "relative_to": "baseline"}], base, run)
    by_item = {v["item"]: v["pass"] for v in verdicts}
    assert by_item == {
        "quantities": False,
        "quantities[].value": True,
        "quantities[].unit": False,
    }


# ---------------------------------------------------------------- target kinds and splits

CFG = SplitConfig(train=0.8, validation=0.1, test=0.1, seed=0)


def _keys_in(split: str, count: int, prefix: str) -> list[str]:
    """`count` keys that the seeded hash puts in `split`."""
    out, i = [], 0
    while len(out) < count:
        key = f"{prefix}-{i}"
        if split_by_hash([key], CFG)[0] == split:
            out.append(key)
        i += 1
    return out


def test_a_kind_in_one_split_is_warned_and_stratification_covers_it():
    # 3 rows with an empty list, all hashed into train, among 60 rows with items
    empties = _keys_in("train", 3, "empty")
    keys = [f"row-{i}" for i in range(60)] + empties
    kinds = [["quantities filled"]] * 60 + [["quantities empty"]] * 3
    splits = split_by_hash(keys, CFG)
    assert counts_by_kinds(splits, kinds)["validation"].get("quantities empty") is None
    (warning,) = [w for w in kind_gaps(splits, kinds, CFG) if "empty" in w]
    assert "'quantities empty' (3 rows: 3 in train)" in warning
    assert "validation or test split" in warning
    covered, moved = ensure_kind_coverage(splits, keys, kinds, CFG)
    assert not kind_gaps(covered, kinds, CFG)
    assert sorted(m["to"] for m in moved) == ["test", "validation"]
    assert all(m["kind"] == "quantities empty" and m["from"] == "train" for m in moved)

    # validation first: the empty row whose hash lies nearest to [0.8, 0.9) on the circle,
    # then the nearest of the other two to [0.9, 1.0)
    def near(rows, lo, hi):
        return min(rows, key=lambda k: _distance(unit_hash(k, CFG.seed), lo, hi))

    to_val = near(empties, 0.8, 0.9)
    to_test = near([k for k in empties if k != to_val], 0.9, 1.0)
    assert covered[keys.index(to_val)] == "validation"
    assert covered[keys.index(to_test)] == "test"
    # only those two rows moved
    assert sum(a != b for a, b in zip(splits, covered, strict=True)) == 2


def test_kind_coverage_keeps_each_moved_rows_other_kinds():
    """A row that is its kind's last in its split is not taken to cover another kind."""
    keys = _keys_in("train", 2, "a") + _keys_in("validation", 1, "b") + _keys_in("test", 1, "c")
    kinds = [["x empty", "y null"], ["x empty"], ["y null"], ["x filled"]]
    covered, moved = ensure_kind_coverage(
        ["train", "train", "validation", "test"], keys, kinds, CFG
    )
    # 'x empty' needs validation and test rows: only row 1 may go (row 0 is train's y null)
    assert [m["row"] for m in moved] == [1]
    assert any("'x empty'" in w for w in kind_gaps(covered, kinds, CFG))


# ---------------------------------------------------------------- the stages, end to end


def _q(value, unit):
    return {"value": value, "unit": unit}


def _write_nested_study(root, model_dir):
    """Targets are lists of {value, unit}. Training rows and validation rows share their texts
    (the user's split column, no dedup), but each validation gold has its second item's value
    changed: a model that learned the training answers gets half the items right."""
    from helpers.study import build_study

    rows = [
        ("a", "Buy 2 kg of flour and 5 m of rope.", [_q(2, "kg"), _q(5, "m")], "train"),
        ("b", "Pour 3 l of milk, add 4 g of salt.", [_q(3, "l"), _q(4, "g")], "train"),
        ("c", "Nothing to measure here.", [], "train"),
        ("a2", "Buy 2 kg of flour and 5 m of rope.", [_q(2, "kg"), _q(9, "m")], "validation"),
        ("b2", "Pour 3 l of milk, add 4 g of salt.", [_q(3, "l"), _q(8, "g")], "validation"),
        ("c2", "Nothing to measure here.", [], "validation"),
        ("t", "Take 1 s.", [_q(1, "s")], "test"),
    ]
    fields = {"id": "id", "text": "text", "label": None, "target": "target", "split": "split"}
    training = {
        "max_steps": 120, "lr": 0.02, "micro_batch_size": 3, "warmup_steps": 0,
        "schedule": "constant", "eval_every_steps": 1000, "checkpoint_every_steps": 1000,
        "num_threads": 1,
    }  # fmt: skip
    guardrail = {
        "metric": "normalized_match", "scope": "every_field", "op": ">=", "value": 0.9,
        "test": "point",
    }  # fmt: skip
    return build_study(
        root,
        "extraction",
        name="nested",
        model_dir=model_dir,
        rows=[
            {"id": i, "text": t, "target": json.dumps({"quantities": q}), "split": s}
            for i, t, q, s in rows
        ],
        hypothesis={
            "behaviour": "list every amount of a sentence with its unit",
            "rationale": "the base model does not answer in JSON",
            "expected_effect": "field_micro_f1 +0.5",
            "primary_metric": "field_micro_f1",
            "min_improvement": 0.0,
        },
        set={
            "task.json_schema": QUANTITIES,
            "data.fields": fields,
            "data.cleaning": [],
            "data.dedup": {"exact": False, "near": False, "policy": "report_only"},
            "adaptation": {"method": "full"},
            "preprocess.max_seq_len": 160,
            "evaluation.max_new_tokens": 64,
            "evaluation.batch_size": 3,
        }
        | {f"training.{k}": v for k, v in training.items()},
        guardrails=[guardrail],
        register=True,
        snapshot=False,
    )


@pytest.mark.slow
def test_stage_nested_lists_with_half_the_items_right(tmp_path, capsys, tiny_llama_dir):
    """data -> inspect -> baseline -> train -> eval -> compare -> report on nested list targets:
    the item-level and sub-field metrics move from the base model's nothing to half the items
    right, the guardrail per path judges the nested paths, and the dossier has their bars."""
    from helpers import run_cli
    from tunelab.core.records import read_json, read_jsonl

    root = _write_nested_study(tmp_path / "s", tiny_llama_dir)
    code, out, err = run_cli(capsys, "data", "-s", root)
    assert code == 0, err
    # the test split holds no empty list: the data stage says so
    assert "target kind 'quantities empty'" in out + err and "test split" in out + err
    code, out, err = run_cli(capsys, "inspect", "-s", root, "--json")
    assert code == 0, err
    ins = json.loads(out)
    assert ins["ok"] and {e["category"] for e in ins["examples"]} == {
        "quantities empty",
        "quantities filled",
    }
    assert run_cli(capsys, "baseline", "-s", root)[0] == 0
    code, out, err = run_cli(capsys, "train", "-s", root, "--name", "v1")
    assert code == 0, err
    runs = root / "records" / "runs"
    (train,) = [p.name for p in runs.iterdir() if p.name.startswith("train-")]
    code, out, err = run_cli(capsys, "eval", train, "-s", root)
    assert code == 0, err
    assert "quantities[].value" in out  # the per-path table, readable at 80 columns
    (ev,) = [p for p in runs.iterdir() if p.name.startswith("eval-")]
    # the model learned the training answers: on validation half of each list is right
    raws = [json.loads(p["raw_output"]) for p in read_jsonl(ev / "predictions-validation.jsonl")]
    assert raws == [
        {"quantities": [_q(2, "kg"), _q(5, "m")]},
        {"quantities": [_q(3, "l"), _q(4, "g")]},
        {"quantities": []},
    ]
    pf = read_json(ev / "metrics-validation.json")["metrics"]["per_field"]
    assert pf["quantities"]["normalized_match"] == pytest.approx(1 / 3)  # only the []
    assert (pf["quantities"]["precision"], pf["quantities"]["recall"]) == (0.5, 0.5)
    assert pf["quantities[].value"]["normalized_match"] == 0.5  # 2 of 4 paired items
    assert pf["quantities[].unit"]["normalized_match"] == 1.0
    assert pf["quantities[].value"]["failures"]["wrong_value"] == 2

    code, out, err = run_cli(capsys, "compare", "-s", root, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["runs"]
    base_pf = row["per_field"]
    assert set(base_pf) == {"quantities", "quantities[].value", "quantities[].unit"}
    unit = base_pf["quantities[].unit"]["normalized_match"]
    assert (unit["baseline"], unit["variant"]) == (0.0, 1.0)
    f1 = base_pf["quantities"]["f1"]
    assert f1["delta"] == 0.5 and f1["ci_low"] <= 0.5 <= f1["ci_high"]
    verdicts = {g["item"]: g["pass"] for g in row["guardrails"]}
    assert verdicts == {
        "quantities": False,
        "quantities[].value": False,
        "quantities[].unit": True,
    }
    assert run_cli(capsys, "report", "-s", root)[0] == 0
    md = (root / "report" / "dossier.md").read_text()
    assert "## Extraction scores per path" in md and "plots/paths_match.png" in md
    assert (root / "report" / "plots" / "paths_f1.png").exists()


# the extraction template's fields: no id, label or split column
TEXT_TARGET = {"id": None, "text": "text", "label": None, "target": "target", "split": None}


def _kind_study(root, stratify):
    """40 sentences with amounts and 3 without (all three hashed into train)."""
    from helpers import register_study
    from helpers.study import build_study
    from tunelab.stages.data.splits import content_keys

    empties, i = [], 0
    while len(empties) < 3:
        text = f"Nothing to measure in note {i}."
        if split_by_hash(content_keys([text]), CFG)[0] == "train":
            empties.append(text)
        i += 1
    rows = [{"text": f"Take {i} kg of item {i}.", "target": {"quantities": [_q(i, "kg")]}}
            for i in range(40)] + [{"text": t, "target": {"quantities": []}} for t in empties]  # fmt: skip
    splits = {"train": 0.8, "validation": 0.1, "test": 0.1, "seed": 0, "stratify": stratify}
    build_study(
        root,
        "extraction",
        name="kinds",
        rows=[{**r, "target": json.dumps(r["target"])} for r in rows],
        hypothesis={
            "behaviour": "b",
            "rationale": "r",
            "expected_effect": "e",
            "primary_metric": "field_micro_f1",
        },  # fmt: skip
        set={"task.json_schema": QUANTITIES, "data.splits": splits, "data.fields": TEXT_TARGET},
    )
    return register_study(root)


def test_data_stratifies_by_target_kind(tmp_path):
    from tunelab.stages.data import load_snapshot

    plain = load_snapshot(_kind_study(tmp_path / "plain", False))
    counts = plain.manifest["counts"]["target_kinds"]
    assert counts["train"]["quantities empty"] == 3 and "quantities empty" not in counts["test"]
    assert any("'quantities empty'" in n for n in plain.manifest["notes"])

    study = _kind_study(tmp_path / "kinds", "target_kind")
    snap = load_snapshot(study)
    counts = snap.manifest["counts"]["target_kinds"]
    assert [counts[s].get("quantities empty") for s in ("train", "validation", "test")] == [1, 1, 1]
    moved = snap.manifest["splits"]["moved_to_cover_small_categories"]
    assert sorted(m["to"] for m in moved) == ["test", "validation"]
    assert not any("'quantities empty'" in n for n in snap.manifest["notes"])
    assert snap.id != plain.id


def test_stratify_by_target_kind_is_for_extraction_only():
    import yaml

    from tunelab.core.config import validate_config
    from tunelab.stages.hypothesis.template import render_study_yaml

    raw = yaml.safe_load(render_study_yaml("format", "f"))
    raw["data"]["splits"]["stratify"] = "target_kind"
    with pytest.raises(ConfigError, match="target_kind needs task.kind: extraction"):
        validate_config(raw)


def test_targets_inspect_refuses():
    """Targets the scorer can never match are inspect problems: not an object, off-schema."""
    task = ExtractionTask("x", QUANTITIES)
    rows = [
        {"id": "ok", "target": '{"quantities": []}'},
        {"id": "list", "target": "[1, 2]"},
        {"id": "cut", "target": '{"quantities": ['},
        {"id": "off", "target": '{"quantities": [{"value": "2", "unit": "kg"}]}'},
    ]
    problems = {p["example_id"]: p for p in task.target_problems(rows)}
    assert {k: p["kind"] for k, p in problems.items()} == {
        "list": "target_not_json",
        "cut": "target_not_json",
        "off": "target_schema_error",
    }
    assert "a JSON array, not an object" in problems["list"]["message"]
    assert "line 1, column 17" in problems["cut"]["message"]
    assert "quantities/0/value" in problems["off"]["message"]
    assert task.categories(rows[:1] + rows[3:]) == ["quantities empty", "quantities filled"]
    # never "all", the name of inspect's overall row
    assert task.categories(rows[:2] + [{"id": "none", "target": "{}"}]) == [
        "quantities empty",
        "(target not a JSON object)",
        "(no list or nullable field)",
    ]
