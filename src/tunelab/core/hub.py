"""Hugging Face hub repos (base models and data sets) resolved to an exact commit in the cache.

Everything goes through `huggingface_hub.snapshot_download`, so the cache is the one every HF
tool shares (`HF_HUB_CACHE`, else `HF_HOME/hub`), `HF_TOKEN` authenticates and
`HF_HUB_OFFLINE=1` reads the cache only. The environment is read at each call, not at import.
Imports no torch.

- `hub_cache_dir()`, `hub_offline()`: the environment at call time (HF_HUB_CACHE / HF_HOME,
  HF_HUB_OFFLINE).
- `download(repo_id, revision, repo_type=, allow_patterns=) -> HubSnapshot(repo_id, repo_type,
  revision, commit, path)`; ModelError / DataError with hints. Offline, the hint starts with
  `cached_instead(repo_id, revision, repo_type, field)`: the repo's cached refs and commits, or
  cached repos of a close id.
- `current_commit`, `cached_commit`, `fill_command`; `progress_class` is the tqdm class the CLI
  sets for downloads.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.errors import DataError, ModelError, TunelabError

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "on", "yes", "true"}

# The tqdm class downloads draw with; the CLI sets one, the library alone draws nothing.
progress_class: Any = None


@dataclass(frozen=True)
class HubSnapshot:
    """A repo at one commit, present in the cache at `path` (`snapshots/<commit>/`)."""

    repo_id: str
    repo_type: str  # "model" | "dataset"
    revision: str  # what was asked: a branch, a tag or a commit
    commit: str
    path: Path

    def record(self) -> dict[str, str]:
        """What records keep: repo, type, the revision asked for and the commit it resolved to."""
        return {
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "revision": self.revision,
            "commit": self.commit,
        }


def hub_cache_dir() -> Path:
    """The hub cache folder, as huggingface_hub finds it from the environment now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: only the cache is read."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def repo_folder(repo_id: str, repo_type: str = "model") -> Path:
    """`<cache>/models--org--name` (or `datasets--org--name`)."""
    return hub_cache_dir() / "--".join([f"{repo_type}s", *repo_id.split("/")])


def cached_commit(repo_id: str, revision: str, repo_type: str = "model") -> str | None:
    """The commit `revision` points at in the cache (its refs file), or None."""
    if COMMIT_RE.fullmatch(revision):
        return revision
    ref = repo_folder(repo_id, repo_type) / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return commit if COMMIT_RE.fullmatch(commit) else None


def current_commit(repo_id: str, revision: str, repo_type: str = "model") -> tuple[str | None, str]:
    """(commit, where) that `revision` resolves to now: asked of the hub unless offline, else
    read from the cache's refs. `where` is "hub" or "cache"; commit None when unknown."""
    if COMMIT_RE.fullmatch(revision):
        return revision, "hub" if not hub_offline() else "cache"
    if not hub_offline():
        try:
            from huggingface_hub import HfApi

            info = HfApi(endpoint=_endpoint()).repo_info(
                repo_id, repo_type=repo_type, revision=revision
            )
            return info.sha, "hub"
        except Exception:  # unreachable hub, no access: fall back to what the cache knows
            pass
    return cached_commit(repo_id, revision, repo_type), "cache"


def _error(repo_type: str) -> type[TunelabError]:
    return DataError if repo_type == "dataset" else ModelError


def _field(repo_type: str) -> str:
    return "data.source.name" if repo_type == "dataset" else "model.name"


def fill_command(repo_id: str, revision: str, repo_type: str = "model") -> str:
    """The command that puts `repo_id` at `revision` into the cache."""
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return f"hf download {repo_id}{kind} --revision {revision} --cache-dir {hub_cache_dir()}"


def download(
    repo_id: str,
    revision: str | None = None,
    *,
    repo_type: str = "model",
    allow_patterns: list[str] | None = None,
    local_only: bool | None = None,
    field: str | None = None,
) -> HubSnapshot:
    """`repo_id` at `revision` (default main) in the cache, downloading what is missing unless
    offline (or `local_only`). Raises ModelError / DataError with the fix for a missing repo,
    revision, token or cache entry; hints name `field` (default: the study.yaml field that
    names the repo; a command-line option such as `--base` for a repo given there)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = revision or "main"
    offline = hub_offline() if local_only is None else local_only
    err, field = _error(repo_type), field or _field(repo_type)
    where = f"{repo_type} {repo_id}@{revision}"
    try:
        path = snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            cache_dir=hub_cache_dir(),
            allow_patterns=allow_patterns,
            local_files_only=offline,
            tqdm_class=progress_class or _silent_tqdm(),
            endpoint=_endpoint(),
        )
    except GatedRepoError:
        raise err(
            f"{where}: a gated repo; this token has no access to it",
            hint=f"accept its terms at https://huggingface.co/{_url(repo_id, repo_type)}, then "
            "`hf auth login` (`huggingface-cli login` in older versions) or set HF_TOKEN",
        ) from None
    except RevisionNotFoundError:
        raise err(
            f"{where}: the repo has no revision {revision!r}",
            hint=f"set the revision in study.yaml to a branch, tag or 40-hex commit of {repo_id}",
        ) from None
    except RepositoryNotFoundError:
        token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
        raise err(
            f"{where}: no such repo on the hub, or it is private ({token})",
            hint=f"check {field}; for a private repo `hf auth login` (`huggingface-cli login`) "
            "or set HF_TOKEN",
        ) from None
    except LocalEntryNotFoundError:
        reason = "offline (HF_HUB_OFFLINE=1)" if offline else "the hub cannot be reached"
        raise err(
            f"{where}: {reason} and not in the cache {hub_cache_dir()}",
            hint=cached_instead(repo_id, revision, repo_type, field)
            + f"fill the cache where the hub is reachable: `{fill_command(repo_id, revision, repo_type)}` "
            "(or unset HF_HUB_OFFLINE); HF_HUB_CACHE / HF_HOME choose the cache folder",
        ) from None
    except HfHubHTTPError as exc:
        raise err(
            f"{where}: the hub answered {exc.response.status_code if exc.response else '?'}: "
            f"{str(exc).splitlines()[0]}",
            hint="retry later, or set HF_HUB_OFFLINE=1 to use the cache only",
        ) from None
    path = Path(path)
    return HubSnapshot(repo_id, repo_type, revision, path.name, path)


def cached_instead(repo_id: str, revision: str, repo_type: str, field: str) -> str:
    """What the cache holds in place of `repo_id@revision`, as the start of a hint: the repo's
    cached refs and commits (a revision not in the cache), or cached repos whose id is close
    (a typo in the id); empty when there is nothing near."""
    folder = repo_folder(repo_id, repo_type)
    if folder.is_dir():
        refs = sorted(p.relative_to(folder / "refs").as_posix() for p in folder.glob("refs/**/*"))
        commits = sorted(p.name for p in folder.glob("snapshots/*") if p.is_dir())
        held = ", ".join(refs + commits) or "no revision"
        if field.startswith("--"):  # a repo given on the command line, as org/name@REV
            return f"the cache holds {repo_id} at {held} (pass {field} {repo_id}@REV, REV one of them); or "
        revision_field = "data.source.revision" if repo_type == "dataset" else "model.revision"
        return f"the cache holds {repo_id} at {held} (set {revision_field} to one of them); or "
    prefix = f"{repo_type}s--"
    cached = [
        p.name[len(prefix) :].replace("--", "/", 1)
        for p in hub_cache_dir().glob(f"{prefix}*")
        if p.is_dir()
    ]
    near = difflib.get_close_matches(repo_id, cached, n=3, cutoff=0.8)
    if not near:
        return ""
    return f"{field}: the cache holds {', '.join(near)}; or "


def listed_files(snapshot: HubSnapshot) -> list[str] | None:
    """Every file of the repo at the snapshot's commit, from the tree listing snapshot_download
    caches (`trees/<commit>.json`); None when it is not cached."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        tree = get_cached_repo_tree(
            snapshot.repo_id,
            repo_type=snapshot.repo_type,
            revision=snapshot.commit,
            cache_dir=hub_cache_dir(),
        )
    except CachedRepoTreeNotFoundError:
        return None
    return sorted(f.path for f in tree)


def _endpoint() -> str | None:
    """HF_ENDPOINT now (a mirror, a private hub), else huggingface_hub's default."""
    return os.environ.get("HF_ENDPOINT") or None


def _url(repo_id: str, repo_type: str) -> str:
    return f"datasets/{repo_id}" if repo_type == "dataset" else repo_id


def _silent_tqdm():
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
