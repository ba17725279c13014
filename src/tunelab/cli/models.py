"""models, hub-cache: the bases and data sets in the hub cache; a local folder laid into it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tunelab.cli.common import JsonOpt, app, console, emit_json, table


def draw_downloads() -> None:
    """Hub downloads draw a bar on stderr (hidden when stderr is not a terminal)."""
    import sys

    from tqdm.auto import tqdm

    from tunelab.core import hub

    class DownloadBar(tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("file", sys.stderr)
            kwargs.setdefault("disable", None)  # None: only on a terminal
            kwargs.setdefault("desc", "downloading")
            super().__init__(*args, **kwargs)

    hub.progress_class = DownloadBar


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


@app.command()
def models(
    datasets: Annotated[
        bool, typer.Option("--datasets", help="List the data sets instead of the models.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """The models (or data sets) in the hub cache, each commit with the refs that point at it."""
    from tunelab.core.hub import hub_cache_dir
    from tunelab.core.hub_cache import cached_repos

    kind = "dataset" if datasets else "model"
    repos = cached_repos(kind)
    if json_out:
        emit_json({"cache": str(hub_cache_dir()), "repos": repos})
        return
    console.print(f"{kind}s in {hub_cache_dir()}", soft_wrap=True)
    for repo in repos:  # the id on a line of its own: never cut, whatever its length
        rows = [
            [
                rev["commit"][:12],
                ", ".join(rev["refs"]) or "-",
                rev["files"],
                _size(rev["size_bytes"]),
            ]
            for rev in repo["revisions"]
        ]
        console.print(f"[bold]{repo['repo_id']}[/]", soft_wrap=True)
        console.print(table(None, ["commit", "refs", "files", "size"], rows))
    if not repos:
        console.print(f"no {kind}s cached (HF_HUB_CACHE or HF_HOME choose the folder)")


@app.command("hub-cache")
def hub_cache(
    folder: Annotated[Path, typer.Argument(help="A model or data set folder to lay in.")],
    repo_id: Annotated[str, typer.Argument(help="The repo id it is served as (org/name).")],
    repo_type: Annotated[str, typer.Option(help="model or dataset.")] = "model",
    ref: Annotated[
        list[str] | None, typer.Option("--ref", help="Branch or tag to point at it (repeatable).")
    ] = None,
    commit: Annotated[
        str | None, typer.Option(help="40-hex commit (default: a sha1 of the files).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Put a local folder into the hub cache as repo_id at a commit, as huggingface_hub lays it
    out, for machines that cannot reach the hub (studies then name it by repo id)."""
    from tunelab.core.config_sections import HUB_ID
    from tunelab.core.errors import ConfigError
    from tunelab.core.hub_cache import write_snapshot

    if repo_type not in ("model", "dataset"):
        raise ConfigError(f"--repo-type {repo_type!r}", hint="use --repo-type model or dataset")
    if not HUB_ID.fullmatch(repo_id) or "/" not in repo_id:
        raise ConfigError(f"{repo_id!r} is not a repo id", hint="write it as org/name")
    snap = write_snapshot(
        folder, repo_id, repo_type=repo_type, refs=tuple(ref or ["main"]), commit=commit
    )
    if json_out:
        emit_json({**snap.record(), "path": str(snap.path), "refs": ref or ["main"]})
        return
    console.print(f"[green]cached[/] {repo_id} commit {snap.commit}", soft_wrap=True)
    console.print(f"  {snap.path}", soft_wrap=True)
    field = "data.source.name" if repo_type == "dataset" else "model.name"
    console.print(f"next: set {field}: {repo_id} in study.yaml")
