"""The shard store: where a full fine-tune under FSDP on several nodes writes its checkpoint
shards (`training.shard_store`).

On one node every rank writes its shards into the checkpoint's `dcp/` folder in the run. Nodes
without a shared disk cannot: rank 1 has no path to node 0's run folder. Their ranks write to a
store every node reaches, a folder every node mounts (`/mnt/shared/ckpt`, `file:///...`) or an
fsspec URL (`s3://bucket/prefix`, `gs://...`), at `<store>/<study name>/<run id>/step-<n>/`,
through torch.distributed.checkpoint (its file-system writer for a folder, FsspecWriter for a
URL). Node 0's checkpoint records the location (`state.json`'s `shards`), so resume, verify and
export find it from node 0's records alone.

`needs_store(cfg, strategy, nnodes)`, `store_problems(cfg, strategy, nnodes)`,
`location(store, study, run_id, step)`, `writer(location)`, `reader(location)`,
`has_shards(location)`, `remove(location)`.
"""

from __future__ import annotations

from typing import Any

STORE_FIELD = "training.shard_store"


def needs_store(cfg: Any, strategy: str, nnodes: int) -> bool:
    """A full fine-tune under FSDP on several nodes: its shards go to the store."""
    return strategy == "fsdp" and nnodes > 1 and cfg.adaptation.method == "full"


def store_problems(cfg: Any, strategy: str, nnodes: int) -> list[str]:
    """Why the study cannot train under `strategy` on `nnodes` nodes for want of a store
    (`field: why` lines; empty when it can)."""
    if not needs_store(cfg, strategy, nnodes):
        return []
    store = cfg.training.shard_store
    if not store:
        return [
            f"{STORE_FIELD}: a full fine-tune under --strategy fsdp on {nnodes} nodes writes "
            "each rank's checkpoint shards where every node can reach them; set "
            f"{STORE_FIELD} to a folder every node mounts (/mnt/shared/ckpt) or a bucket URL "
            "(s3://bucket/prefix, gs://bucket/prefix), or train LoRA (its checkpoint is "
            "gathered to node 0)"
        ]
    scheme = store.split("://", 1)[0] if "://" in store else "file"
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        return [f"{STORE_FIELD}: {store!r} needs fsspec's {scheme} file system here: {exc}"]
    return []


def location(store: str, study_name: str, run_id: str, step: int) -> str:
    """`<store>/<study name>/<run id>/step-<n>` (a folder, or a URL under the store's)."""
    from tunelab.stages.train.layout import step_dir_name

    return f"{store.rstrip('/')}/{study_name}/{run_id}/{step_dir_name(step)}"


def _is_url(where: str) -> bool:
    return "://" in where and not where.startswith("file://")


def _folder(where: str) -> str:
    return where.removeprefix("file://")


def _fsspec_classes() -> tuple[Any, Any]:
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    except ImportError:  # torch releases that keep them in their private module only
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


def writer(where: str) -> Any:
    """torch.distributed.checkpoint's writer of a folder or an fsspec URL."""
    if _is_url(where):
        return _fsspec_classes()[0](where)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(_folder(where))


def reader(where: str) -> Any:
    if _is_url(where):
        return _fsspec_classes()[1](where)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(_folder(where))


def has_shards(where: str) -> bool:
    """Whether a complete torch.distributed.checkpoint is at `where` (its .metadata, which
    rank 0 writes last)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(where)
    return fs.exists(f"{path.rstrip('/')}/.metadata")


def remove(where: str) -> None:
    """Remove the shards at `where` (a pruned checkpoint's); a store that refuses is left."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(where)
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except OSError:
        return
