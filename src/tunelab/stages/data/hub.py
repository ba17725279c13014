"""`data.source.format: hub`: a data set named by repo id, read at its pinned commit.

`datasets.load_dataset("org/name")` offline does not read the hub cache: it falls back to its
own prepared Arrow cache, "the latest cached version", whatever the revision. So the repo's
files are fetched into the hub cache with `snapshot_download` at the commit registration pinned,
and `data.formats.read_hub` reads that snapshot folder (its README's configs and split files)
as a local data set: offline, and exactly that commit.

`fetch_dataset(source, commit=None) -> HubSnapshot`; `source_root(study)`: the folder the
readers read for a hub source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from tunelab.core.evidence import pinned_commit
from tunelab.core.hub import HubSnapshot, download

if TYPE_CHECKING:
    from tunelab.core.config_sections import SourceConfig
    from tunelab.core.study import Study

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
