"""Seeded train/validation/test splits that do not move when unrelated rows are added.

A row's split is a function of its content key (sha256 of its normalized text) and the seed
only: u = sha256(seed, key) read as a number in [0, 1), then train if u < f_train, validation
if u < f_train + f_validation, else test. Adding, removing or editing other rows never moves a
row, and rows with the same normalized text always share a split. Every category is split with
the same fractions (stratification in expectation); with `stratify: true` a category that ends
up with no row in a split whose fraction is above zero is an error naming the category, since
per-category metrics on that split would silently miss it.

Pure: keys in, split names out.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from tunelab.config import SplitConfig
from tunelab.errors import DataError

SPLITS = ("train", "validation", "test")


def unit_hash(key: str, seed: int, purpose: str = "split") -> float:
    """A number in [0, 1) from (purpose, seed, key); uniform and stable across runs."""
    digest = hashlib.sha256(f"tunelab:{purpose}:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


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


def check_coverage(
    splits: Sequence[str], labels: Sequence[str | None], cfg: SplitConfig, *, strict: bool
) -> list[str]:
    """Every category must have a row in every split whose fraction is above zero.

    strict (stratify: true): raise DataError naming the first category that misses a split.
    Otherwise: return the problems as warnings.
    """
    fractions = {"train": cfg.train, "validation": cfg.validation, "test": cfg.test}
    table = counts_by_category(splits, labels)
    totals = Counter("(none)" if lab is None else lab for lab in labels)
    problems = []
    for label, n in sorted(totals.items()):
        for split in SPLITS:
            if fractions[split] > 0 and table[split].get(label, 0) == 0:
                problems.append((label, n, split))
    if problems and strict:
        label, n, split = problems[0]
        need = max(1, round(3 / min(f for f in fractions.values() if f > 0)))
        others = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DataError(
            f"category {label!r} is too small to stratify: {n} row(s), none in the {split} "
            f"split (fractions train {cfg.train:g} / validation {cfg.validation:g} / test "
            f"{cfg.test:g}, seed {cfg.seed}){others}",
            hint=f"give the category more rows (about {need} or more), merge it with another, "
            "give your own split column (data.fields.split), or set data.splits.stratify: false "
            "to accept a category missing from a split",
        )
    return [
        f"category {label!r} ({n} rows) has no row in the {split} split"
        for label, n, split in problems
    ]


def check_user_splits(splits: Sequence[str]) -> list[str]:
    present = Counter(splits)
    return [f"your split column gives no {s} rows" for s in SPLITS if not present.get(s)]
