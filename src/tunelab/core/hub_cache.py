"""Lay a local folder into the hub cache as a repo at a commit, the way huggingface_hub writes it.

`<cache>/models--org--name/` gets `blobs/<id>` (the sha256 of a large file, the git blob sha1
of a small one), `snapshots/<commit>/<path>` as relative symlinks to the blobs, `refs/<ref>`
holding the commit, and `trees/<commit>.json` (the tree listing snapshot_download keeps), so
that `snapshot_download(..., local_files_only=True)` and `scan_cache_dir` read it back. It serves
machines without hub access (the demo, the tests, an air-gapped GPU host) and lists the cache.

`write_snapshot(folder, repo_id, repo_type=, refs=, commit=, cache_dir=)`: refs are checked
against `REF_RE` before anything is written; only a `.cache/` inside the folder is skipped.
`cached_repos(repo_type=None)` lists the cache (from `scan_cache_dir`). Commands: `tunelab
models [--datasets]`, `tunelab hub-cache FOLDER REPO_ID` (`tunelab.cli.models`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from tunelab.core.errors import ConfigError
from tunelab.core.hashing import sha256_file
from tunelab.core.hub import COMMIT_RE, HubSnapshot, hub_cache_dir

# stored with git-lfs on the hub (its default .gitattributes), so their blob is named by sha256
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".parquet", ".arrow", ".model")
LFS_MIN_BYTES = 10 * 2**20
TREE_FORMAT = 1
# a branch or tag as git allows it, in the part that names a file under refs/
REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    """The tree listing entry of one file (size, blob_id, and the LFS sha256 where LFS)."""
    size = path.stat().st_size
    if path.name.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES:
        sha = sha256_file(path)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n"
        return {
            "size": size,
            "blob_id": _git_blob_sha1(pointer.encode()),
            "lfs_sha256": sha,
            "lfs_size": size,
        }
    return {"size": size, "blob_id": _git_blob_sha1(path.read_bytes())}


def _place_blob(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + ".incomplete")
    try:
        os.link(src, tmp)  # same file system: no copy of a large weight file
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_snapshot(
    folder: Path,
    repo_id: str,
    *,
    repo_type: str = "model",
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
    cache_dir: Path | None = None,
) -> HubSnapshot:
    """Put every file under `folder` into the cache as `repo_id` at `commit` and point `refs`
    at it. `commit` defaults to a sha1 of the tree listing (the same files give the same commit).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder", hint="give the model or data set folder")
    if commit is not None and not COMMIT_RE.fullmatch(commit):
        raise ConfigError(
            f"commit {commit!r} is not 40 hex digits in lowercase", hint="e.g. --commit 0123abcd..."
        )
    for ref in refs:  # checked before anything is written: a ref names a file under refs/
        if not REF_RE.fullmatch(ref) or ".." in ref or ref.endswith(".lock"):
            raise ConfigError(
                f"--ref {ref!r} is not a branch or tag name",
                hint="use letters, digits, '.', '_', '-' and '/' between parts, e.g. --ref main "
                "--ref v1.0 --ref release/2024",
            )
    # `.cache/` inside the folder is what `hf download --local-dir` keeps: not part of the repo;
    # a folder that itself lies under some `.cache` (a conversion cache) is laid in whole
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts
    )
    if not files:
        raise ConfigError(f"{folder}: no files", hint="give the model or data set folder")
    tree = {p.relative_to(folder).as_posix(): _entry(p) for p in files}
    commit = commit or hashlib.sha1(json.dumps(tree, sort_keys=True).encode()).hexdigest()
    cache = Path(cache_dir) if cache_dir else hub_cache_dir()
    storage = cache / "--".join([f"{repo_type}s", *repo_id.split("/")])
    for sub in ("blobs", "refs", "trees", f"snapshots/{commit}"):
        (storage / sub).mkdir(parents=True, exist_ok=True)
    for src in files:
        rel = src.relative_to(folder).as_posix()
        entry = tree[rel]
        blob = entry.get("lfs_sha256") or entry["blob_id"]
        _place_blob(src, storage / "blobs" / blob)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        up = "../" * (rel.count("/") + 2)  # from snapshots/<commit>/<dirs> back to the repo
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f"{up}blobs/{blob}")
    listing = {"format_version": TREE_FORMAT, "files": tree}
    (storage / "trees" / f"{commit}.json").write_text(json.dumps(listing, indent=2))
    for ref in refs:
        ref_file = storage / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)  # huggingface_hub writes the bare commit, no newline
    return HubSnapshot(
        repo_id, repo_type, refs[0] if refs else commit, commit, storage / "snapshots" / commit
    )


def cached_repos(repo_type: str | None = None) -> list[dict[str, Any]]:
    """Repos in the hub cache (`scan_cache_dir`): `repo_id`, `repo_type`, `size_bytes`, and
    `revisions` [{commit, refs, files, size_bytes}], newest first. Empty when there is no cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    repos = []
    for repo in sorted(info.repos, key=lambda r: (r.repo_type, r.repo_id)):
        if repo_type and repo.repo_type != repo_type:
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        repos.append(
            {
                "repo_id": repo.repo_id,
                "repo_type": repo.repo_type,
                "size_bytes": repo.size_on_disk,
                "path": str(repo.repo_path),
                "revisions": [
                    {
                        "commit": r.commit_hash,
                        "refs": sorted(r.refs),
                        "files": r.nb_files,
                        "size_bytes": r.size_on_disk,
                    }
                    for r in revisions
                ],
            }
        )
    return repos
