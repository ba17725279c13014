"""Seeded train/validation/test splits that do not move when unrelated rows are added.

A row's split is a function of its content key (sha256 of its normalized text) and the seed
only: u = sha256(seed, key) read as a number in [0, 1), then train if u < f_train, validation
if u < f_train + f_validation, else test. Adding, removing or editing other rows never moves a
row, and rows with the same normalized text always share a split. Every category is split with
the same fractions (stratified in expectation). With `stratify: true`, a category so small that
the hash left one of the splits (fraction above zero) without any of its rows gets the row whose
hash lies nearest to that split moved into it, and the move is recorded: per-category metrics
on that split would otherwise silently miss the category. Only rows of such small categories
can move when rows are added; a category with fewer rows than splits is an error naming it.
For an extraction task, `stratify: target_kind` does the same for the kinds of target that
scoring treats apart (an empty list, a null field), and `kind_gaps` warns about a kind that a
split lacks whatever the setting.

Pure: keys in, split names out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from tunelab.core.config_sections import SplitConfig
from tunelab.core.errors import DataError
from tunelab.core.hashing import sha256_text, stable_u64

SPLITS = ("train", "validation", "test")


def unit_hash(key: str, seed: int, purpose: str = "split") -> float:
    """A number in [0, 1) from (purpose, seed, key); uniform and stable across runs."""
    return stable_u64(f"tunelab:{purpose}:{seed}:{key}") / 2.0**64


def content_keys(texts: Sequence[str]) -> list[str]:
    """The key each row is split by: sha256 of its normalized text (see dedup.normalize_texts)."""
    from tunelab.stages.data.dedup import normalize_texts

    return [sha256_text(t) for t in normalize_texts(texts).to_pylist()]


def split_by_hash(keys: Sequence[str], cfg: SplitConfig) -> list[str]:
    """The split of each row from its content key and the seed."""
    cut_train = cfg.train
    cut_val = cfg.train + cfg.validation
    out = []
    for key in keys:
        u = unit_hash(key, cfg.seed)
        out.append("train" if u < cut_train else "validation" if u < cut_val else "test")
    return out


def sample_by_hash(keys: Sequence[str], limit: int, seed: int) -> list[int]:
    """Indices (in input order) of the `limit` rows with the smallest seeded hash."""
    if limit >= len(keys):
        return list(range(len(keys)))
    ranked = sorted(range(len(keys)), key=lambda i: (unit_hash(keys[i], seed, "sample"), i))
    return sorted(ranked[:limit])


def counts_by_category(
    splits: Sequence[str], labels: Sequence[str | None]
) -> dict[str, dict[str, int]]:
    """{split: {label: count}} with every split present (label None shown as '(none)')."""
    table: dict[str, Counter[str]] = {s: Counter() for s in SPLITS}
    for split, label in zip(splits, labels, strict=True):
        table[split]["(none)" if label is None else label] += 1
    return {s: dict(sorted(c.items())) for s, c in table.items()}


def counts_by_kinds(
    splits: Sequence[str], kinds: Sequence[Collection[str]]
) -> dict[str, dict[str, int]]:
    """{split: {target kind: rows}} with every split present (a row counts for each kind)."""
    table: dict[str, Counter[str]] = {s: Counter() for s in SPLITS}
    for split, row_kinds in zip(splits, kinds, strict=True):
        table[split].update(row_kinds)
    return {s: dict(sorted(c.items())) for s, c in table.items()}


def _distance(u: float, lo: float, hi: float) -> float:
    """How far u lies outside [lo, hi) on the unit circle (0 inside)."""
    if lo <= u < hi:
        return 0.0
    gap = min(abs(u - lo), abs(u - hi))
    return min(gap, 1.0 - gap)


def _intervals(cfg: SplitConfig) -> dict[str, tuple[float, float]]:
    return {
        "train": (0.0, cfg.train),
        "validation": (cfg.train, cfg.train + cfg.validation),
        "test": (cfg.train + cfg.validation, 1.0),
    }


def _wanted(cfg: SplitConfig) -> list[str]:
    fractions = {"train": cfg.train, "validation": cfg.validation, "test": cfg.test}
    return [sp for sp in SPLITS if fractions[sp] > 0]


def _cover(
    out: list[str],
    keys: Sequence[str],
    groups: Mapping[str, list[int]],
    membership: Sequence[Collection[str]],
    cfg: SplitConfig,
) -> tuple[list[dict[str, object]], list[tuple[str, str]]]:
    """Move rows (in place in `out`) so that each group has a row in every wanted split: for a
    missing split, the group's row whose hash lies nearest to that split's interval, taken from
    a split where the group has more than one row and where each other group of that row keeps
    one. Returns (moved rows, (group, split) pairs no row could fill)."""
    wanted, intervals = _wanted(cfg), _intervals(cfg)
    have = {g: Counter(out[i] for i in rows) for g, rows in groups.items()}
    moved: list[dict[str, object]] = []
    left: list[tuple[str, str]] = []
    for group, rows in sorted(groups.items()):
        for sp in [sp for sp in wanted if not have[group].get(sp)]:
            lo, hi = intervals[sp]
            donors = [
                i for i in rows if all(have[g][out[i]] > 1 for g in membership[i] if g in have)
            ]
            if not donors:
                left.append((group, sp))
                continue
            pick = min(donors, key=lambda i: (_distance(unit_hash(keys[i], cfg.seed), lo, hi), i))
            moved.append({"row": pick, "category": group, "from": out[pick], "to": sp})
            for g in membership[pick]:
                if g in have:
                    have[g][out[pick]] -= 1
                    have[g][sp] += 1
            out[pick] = sp
    return moved, left


def ensure_coverage(
    splits: Sequence[str],
    keys: Sequence[str],
    labels: Sequence[str | None],
    cfg: SplitConfig,
    *,
    strict: bool,
) -> tuple[list[str], list[dict[str, object]], list[str]]:
    """Give every category a row in every split whose fraction is above zero.

    strict (stratify: true): a category that the hash left without a row in such a split gets
    the row whose hash lies nearest to that split's interval, taken from a split where the
    category has more than one row; a category with fewer rows than non-empty splits is a
    DataError naming it. Not strict: nothing moves and the gaps come back as warnings.
    Returns (splits, moved rows, warnings).
    """
    wanted = _wanted(cfg)
    out = list(splits)
    by_label: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault("(none)" if lab is None else lab, []).append(i)
    warnings: list[str] = []
    for label, rows in sorted(by_label.items()):
        have = Counter(out[i] for i in rows)
        missing = [sp for sp in wanted if not have.get(sp)]
        if not missing:
            continue
        if not strict:
            warnings += [
                f"category {label!r} ({len(rows)} rows) has no row in the {sp} split"
                for sp in missing
            ]
        elif len(rows) < len(wanted):
            raise DataError(
                f"category {label!r} is too small to stratify: {len(rows)} row(s) for "
                f"{len(wanted)} splits ({', '.join(wanted)})",
                hint="give the category more rows, merge it with another, give your own split "
                "column (data.fields.split), or set data.splits.stratify: false to accept a "
                "category missing from a split",
            )
    if not strict:
        return out, [], warnings
    membership = [{"(none)" if lab is None else lab} for lab in labels]
    moved, _ = _cover(out, keys, by_label, membership, cfg)
    return out, moved, warnings


def _by_kind(kinds: Sequence[Collection[str]]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, row_kinds in enumerate(kinds):
        for k in row_kinds:
            groups.setdefault(k, []).append(i)
    return groups


def ensure_kind_coverage(
    splits: Sequence[str],
    keys: Sequence[str],
    kinds: Sequence[Collection[str]],
    cfg: SplitConfig,
) -> tuple[list[str], list[dict[str, object]]]:
    """stratify: target_kind. Give every kind of target (an extraction task's `PATH empty`,
    `PATH null`, `PATH filled`; a row has several) a row in every split whose fraction is
    above zero, moving rows as `ensure_coverage` does without emptying another kind of the
    moved row in its split. Kinds too rare to cover stay as they are (`kind_gaps` names them).
    Returns (splits, moved rows)."""
    out = list(splits)
    moved, _ = _cover(out, keys, _by_kind(kinds), kinds, cfg)
    for m in moved:
        m["kind"] = m.pop("category")
    return out, moved


def kind_gaps(
    splits: Sequence[str], kinds: Sequence[Collection[str]], cfg: SplitConfig
) -> list[str]:
    """Warnings for target kinds missing from a split whose fraction is above zero: that
    split's scores say nothing about them (e.g. every empty list in train)."""
    wanted = _wanted(cfg)
    out = []
    for kind, rows in sorted(_by_kind(kinds).items()):
        have = Counter(splits[i] for i in rows)
        missing = [sp for sp in wanted if not have.get(sp)]
        if missing:
            where = ", ".join(f"{have[sp]} in {sp}" for sp in wanted if have.get(sp))
            out.append(
                f"target kind {kind!r} ({len(rows)} rows: {where}) has no row in the "
                f"{' or '.join(missing)} split: scores there say nothing about it "
                "(data.splits.stratify: target_kind moves rows to cover each kind)"
            )
    return out


def check_user_splits(splits: Sequence[str]) -> list[str]:
    present = Counter(splits)
    return [f"your split column gives no {s} rows" for s in SPLITS if not present.get(s)]
