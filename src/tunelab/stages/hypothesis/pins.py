"""Moving hub refs (a branch, a tag) pinned to commits when the hypothesis is registered.

`tunelab register` resolves each hub repo the study names (the base model, a hub data set) and
locks `{repo_id, repo_type, revision, commit}` into the hypothesis record under `pins`; every
later stage loads exactly that commit (`core.evidence.pinned_commit` reads it back). Registering
again keeps a pin whose repo and revision are unchanged (`repin=True` resolves it again, a new
hypothesis version).

`resolve_pins(cfg, previous, repin=) -> (pins, notes)` (a base: `tunelab.lib.models.hub.pin_base`,
config.json alone; a data set: fetched whole); `drift(root, cfg) -> notes` (a moved ref, for
`tunelab validate`); `cache_problems(cfg)`: offline, a repo or revision the cache does not hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.core.evidence import pins_of
from tunelab.core.hub import (
    cached_commit,
    cached_instead,
    current_commit,
    fill_command,
    hub_cache_dir,
    hub_offline,
    repo_folder,
)

if TYPE_CHECKING:
    from tunelab.core.config import StudyConfig


def fetch_ref(cfg: StudyConfig, key: str) -> dict[str, Any]:
    """Resolve what `key` names to its commit and return its pin record: a base's config.json
    alone is fetched (its weights with the first stage that loads it), a data set whole."""
    if key == "model":
        from tunelab.lib.models.hub import pin_base

        return pin_base(cfg.model).record()
    from tunelab.stages.data.hub import fetch_dataset

    return fetch_dataset(cfg.data.source).record()


def resolve_pins(
    cfg: StudyConfig, previous: dict[str, dict[str, Any]], *, repin: bool = False
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(pins, notes) for the hub refs of `cfg`; a previous pin of the same repo and revision is
    kept unless `repin`, with a note when the ref now resolves to another commit."""
    pins, notes = {}, []
    for key, ref in cfg.hub_refs().items():
        old = previous.get(key)
        same = old and all(old.get(k) == ref[k] for k in ("repo_id", "repo_type", "revision"))
        if same and not repin:
            pins[key] = old
            now, _where = current_commit(ref["repo_id"], ref["revision"], ref["repo_type"])
            if now and now != old["commit"]:
                notes.append(drift_note(key, old, now))
            continue
        pins[key] = fetch_ref(cfg, key)
    return pins, notes


def drift_note(key: str, pin: dict[str, Any], now: str) -> str:
    return (
        f"{key} {pin['repo_id']}: {pin['revision']} now resolves to {now[:12]}, the study stays "
        f"pinned to {pin['commit'][:12]} (`tunelab register --repin` moves the pin)"
    )


def drift(study_root: Path, cfg: StudyConfig) -> list[str]:
    """Notes for every pin whose ref now resolves to another commit (hub, else the cache)."""
    notes = []
    for key, pin in pins_of(study_root).items():
        ref = cfg.hub_refs().get(key)
        if not ref or ref["repo_id"] != pin["repo_id"]:
            continue
        now, _where = current_commit(pin["repo_id"], pin["revision"], pin["repo_type"])
        if now and now != pin["commit"]:
            notes.append(drift_note(key, pin, now))
    return notes


def cache_problems(cfg: StudyConfig) -> list[str]:
    """Offline (HF_HUB_OFFLINE), every hub repo the study names whose revision is not in the
    cache: what `tunelab register` would refuse, told by `tunelab validate` with what the
    cache holds instead. Online, nothing (the hub answers at register)."""
    if not hub_offline():
        return []
    out = []
    for key, ref in cfg.hub_refs().items():
        repo, rev, kind = ref["repo_id"], ref["revision"], ref["repo_type"]
        commit = cached_commit(repo, rev, kind)
        if commit and (repo_folder(repo, kind) / "snapshots" / commit).is_dir():
            continue
        field = "data.source.name" if key == "data" else "model.name"
        out.append(
            f"{field}: {repo}@{rev} is not in the hub cache {hub_cache_dir()} and HF_HUB_OFFLINE "
            f"is set; {cached_instead(repo, rev, kind, field).removeprefix(f'{field}: ')}fill it: "
            f"`{fill_command(repo, rev, kind)}`"
        )
    return out
