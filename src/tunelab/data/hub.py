"""`data.source.format: hub`: a data set named by repo id, read at its pinned commit.

`datasets.load_dataset("org/name")` offline does not read the hub cache: it falls back to its
own prepared Arrow cache, "the latest cached version", whatever the revision. So the repo's
files are fetched into the hub cache with `snapshot_download` at the commit registration pinned,
and `load_dataset` reads that snapshot folder (its README's configs and split files) as a local
data set: offline, and exactly that commit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.data.readers import HF_SPLIT_COLUMN, FieldMapper, SourceData, add_dataset_rows
from tunelab.errors import DataError
from tunelab.hub import HubSnapshot, download
from tunelab.pins import pinned_commit
from tunelab.records import sha256_file

if TYPE_CHECKING:
    from tunelab.config import DataConfig, SourceConfig
    from tunelab.study import Study

# data files `datasets` reads, and the card whose YAML names the configs and their splits
DATA_PATTERNS = [
    "README.md",
    "*.parquet",
    "*.arrow",
    "*.jsonl",
    "*.json",
    "*.csv",
    "*.tsv",
    "*.txt",
    "*.jsonl.gz",
    "*.csv.gz",
]


def fetch_dataset(source: SourceConfig, commit: str | None = None) -> HubSnapshot:
    """`data.source.name` at `commit` (a pin) or at its revision (default main), in the cache."""
    assert source.name, "fetch_dataset is for format hub"
    asked = source.revision or "main"
    snap = download(source.name, commit or asked, repo_type="dataset", allow_patterns=DATA_PATTERNS)
    return dataclasses.replace(snap, revision=asked)


def source_root(study: Study) -> Path:
    """The folder the data stage reads: data.source.path, or for format hub the data set's
    snapshot folder at the commit the registered hypothesis pinned."""
    source = study.config.data.source
    if source.format != "hub":
        return study.resolve(source.path)
    return fetch_dataset(source, pinned_commit(study.root, "data", source.name)).path


def datasets_cache_dir() -> Path:
    """Where `datasets` keeps its Arrow files, from the environment now."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "datasets"


def read_hub(src: SourceData, cfg: DataConfig, mapper: FieldMapper, progress: Any) -> None:
    """Rows of the data set in the snapshot folder `src.root` (every file listed with its
    sha256); `src.hub` gets repo, commit, config, splits and the `datasets` fingerprints."""
    import datasets

    source, root = cfg.source, src.root
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        src.files.append({"path": rel, "sha256": sha256_file(path), "bytes": path.stat().st_size})
    where = f"data set {source.name}@{root.name[:12]}"
    try:
        loaded = datasets.load_dataset(
            str(root), name=source.config, cache_dir=str(datasets_cache_dir())
        )
    except ValueError as exc:  # an unknown config names the ones there are
        raise DataError(
            f"{where}: {str(exc).splitlines()[0]}",
            hint="set data.source.config to one of the data set's configs (or remove it)",
        ) from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise DataError(
            f"{where}: no data files `datasets` can read ({exc})",
            hint="a hub data set needs Parquet, JSON Lines or CSV files (scripts are not run)",
        ) from None
    if source.splits:
        missing = [s for s in source.splits if s not in loaded]
        if missing:
            raise DataError(
                f"{where}: no split {missing[0]!r} (splits: {', '.join(loaded)})",
                hint="set data.source.splits to some of those, or remove it to read them all",
            )
        loaded = datasets.DatasetDict({s: loaded[s] for s in source.splits})
    src.hub = {
        "repo_id": source.name,
        "repo_type": "dataset",
        "revision": source.revision or "main",
        "commit": root.name,
        "config": source.config,
        "splits": {name: ds.num_rows for name, ds in loaded.items()},
        "fingerprints": {name: ds._fingerprint for name, ds in loaded.items()},
        "datasets": datasets.__version__,
    }
    if len(loaded) > 1 and cfg.fields.split != HF_SPLIT_COLUMN:
        src.notes.append(
            f"{source.name} has splits {', '.join(loaded)}: they are pooled and split again; "
            f"set data.fields.split: {HF_SPLIT_COLUMN} to keep them"
        )
    add_dataset_rows(src, mapper, loaded, source.name, progress)
