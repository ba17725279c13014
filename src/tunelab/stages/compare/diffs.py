"""What differs between two runs, apart from their metrics (pure: values in, values out): the
examples that flipped (`flips`, `flips_by_category`) and the config diff, grouped, with a
warning when a variant changes more than one thing (`config_diff`, `group_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunelab.core.run_parts import Prediction, TrainingSettings
from tunelab.stages.hypothesis.stage import diff_dicts

# ---------------------------------------------------------------- flips


def flips_by_category(
    rows: Sequence[Prediction],
    baseline_correct: Sequence[bool],
    variant_correct: Sequence[bool],
    labels: Sequence[str],
) -> dict[str, dict[str, int]]:
    """{category: {"improved": wrong -> right, "regressed": right -> wrong}} by gold label."""
    out = {label: {"improved": 0, "regressed": 0} for label in labels}
    for row, a, b in zip(rows, baseline_correct, variant_correct, strict=True):
        if a != b and row.gold in out:
            out[row.gold]["improved" if b else "regressed"] += 1
    return out


def flips(
    ids: Sequence[str], baseline_correct: Sequence[bool], variant_correct: Sequence[bool]
) -> dict[str, Any]:
    """The examples whose verdict changed: improved (wrong -> right) and regressed."""
    improved = [i for i, a, b in zip(ids, baseline_correct, variant_correct, strict=True) if b > a]
    regressed = [i for i, a, b in zip(ids, baseline_correct, variant_correct, strict=True) if a > b]
    return {
        "improved": improved,
        "regressed": regressed,
        "num_improved": len(improved),
        "num_regressed": len(regressed),
    }


# ---------------------------------------------------------------- config diff

# Parameter groups, matched on the dotted config path (first match wins).
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("adaptation", ("adaptation.",)),
    (
        "precision and memory",
        (
            "training.precision",
            "training.activation_checkpointing",
            "training.packing",
            "model.dtype",
        ),
    ),
    (
        "optimizer and schedule",
        (
            "training.optimizer",
            "training.lr",
            "training.weight_decay",
            "training.betas",
            "training.schedule",
            "training.warmup_steps",
            "training.grad_clip",
            "training.max_steps",
            "training.num_epochs",
            "training.seed",
            "training.micro_batch_size",
            "training.grad_accum_steps",
        ),
    ),
    ("data", ("data.", "data_snapshot", "preprocess.")),
    ("evaluation", ("evaluation.", "task.")),
    (
        "bookkeeping",
        (
            "name",
            "budget.",
            "training.eval_every_steps",
            "training.checkpoint_every_steps",
            "training.keep_last_checkpoints",
            "training.update_check_steps",
            "training.num_threads",
            "training.log_to",
        ),
    ),
]
# Groups that do not change what is learned or measured: never counted as "a change".
NEUTRAL_GROUPS = {"bookkeeping"}
SEED_PATHS = ("training.seed", "data.splits.seed", "evaluation.seed")
BUDGET_PATHS = ("training.max_steps", "training.num_epochs")


def _matches(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p.rstrip(".") or path.startswith(p) for p in prefixes) or any(
        path.startswith(p + "[") for p in prefixes
    )


def group_of(path: str) -> str:
    for name, prefixes in GROUPS:
        if _matches(path, prefixes):
            return name
    return "other"


def _effective_batch(config: Mapping[str, Any], whose: str) -> int:
    """Micro-batch size times accumulation steps of a saved config (1 for each it lacks)."""
    settings = TrainingSettings.of(f"{whose} config", config.get("training") or {}, "training")
    return (settings.micro_batch_size or 1) * (settings.grad_accum_steps or 1)


def config_diff(
    parent: Mapping[str, Any],
    child: Mapping[str, Any],
    *,
    why: str | None = None,
    parent_snapshot: str | None = None,
    child_snapshot: str | None = None,
) -> dict[str, Any]:
    """The grouped config changes of a variant against its parent, and the warnings they earn.

    Micro-batch size and accumulation steps count as "precision and memory" when their product
    (the effective batch) is unchanged, else as "optimizer and schedule". Flags: more than one
    group changed; a seed, the training budget (max_steps, num_epochs) or the data (including
    the data snapshot) changed without a `--why`.
    Returns {"changes": [{path, old, new, group}], "groups": [...], "flags": [...], "why"}.
    """
    changes = diff_dicts(dict(parent), dict(child))
    if parent_snapshot != child_snapshot:
        changes.append({"path": "data_snapshot", "old": parent_snapshot, "new": child_snapshot})
    same_batch = _effective_batch(parent, "the parent's") == _effective_batch(child, "the run's")
    for change in changes:
        group = group_of(change["path"])
        if same_batch and change["path"] in (
            "training.micro_batch_size",
            "training.grad_accum_steps",
        ):
            group = "precision and memory"
        change["group"] = group
    groups = sorted({c["group"] for c in changes if c["group"] not in NEUTRAL_GROUPS})
    flags = []
    if len(groups) > 1:
        flags.append(
            f"changes {len(groups)} parameter groups ({', '.join(groups)}): "
            "the effect cannot be attributed to one change"
        )
    has_why = bool(why and why.strip())
    paths = [c["path"] for c in changes]
    for what, hit in (
        ("seed", [p for p in paths if p in SEED_PATHS]),
        ("training budget", [p for p in paths if p in BUDGET_PATHS]),
        ("data", [p for p in paths if group_of(p) == "data"]),
    ):
        if hit and not has_why:
            flags.append(f"{what} changed ({', '.join(hit)}) without a --why")
    return {"changes": changes, "groups": groups, "flags": flags, "why": why}
