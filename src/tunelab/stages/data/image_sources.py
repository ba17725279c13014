"""The sources of image_classification: a folder per label, JSONL / CSV / Parquet with a column
of paths (both read by `data.images`), and `datasets` data sets: the `Image` column of a Dataset
(or DatasetDict) saved with `save_to_disk` (format hf_disk), or of a hub data set at its pinned
commit (format hub).

A `datasets` Image value's stored bytes (or, when it holds only a path, the file at that path inside the
data set's folder) are the image's bytes: decoded in full, hashed and stored in the snapshot like
a file of a label folder. Labels come from a ClassLabel column (its names) or a string column; a
column of numbers without names is refused rather than read as categories "0", "1", ...

`read_image_source(root, cfg) -> (SourceData, ImageSource)` reads every image source; for a
`datasets` source an example's `text` is `<name>[<split>] row <i>`.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from tunelab.core.config_sections import DataConfig
from tunelab.core.errors import DataError
from tunelab.stages.data.formats import load_hf_disk, load_hub
from tunelab.stages.data.images import (
    ImageSource,
    add_image_bytes,
    attach_images,
    finish,
    read_image_folder,
)
from tunelab.stages.data.readers import read_source, require_text_names
from tunelab.stages.data.source_files import HF_SPLIT_COLUMN, FieldMapper, SourceData, column_list

DATASET_FORMATS = ("hf_disk", "hub")  # `datasets` data sets: an Image column
# the row's text (a place for people to read) under a name no data set column can take
IMAGE_TEXT = "\x00image-row"


def read_image_source(root: Path, cfg: DataConfig) -> tuple[SourceData, ImageSource]:
    """The rows and images of an image_classification source at `root`; DataError naming every
    file that cannot be used (`images.finish`)."""
    src, images = _read(root, cfg)
    return src, finish(src, images)


def _read(root: Path, cfg: DataConfig) -> tuple[SourceData, ImageSource]:
    if cfg.source.format != "hub":
        require_text_names(root)
    if cfg.source.format == "folder":
        src = SourceData(rows=[], files=[], root=root)
        return src, read_image_folder(src, cfg)
    if not cfg.fields.image:
        column = "a datasets Image column" if cfg.source.format in DATASET_FORMATS else "path"
        raise DataError(
            f"data.source.format {cfg.source.format} with task.kind image_classification needs "
            "data.fields.image",
            hint=f"set data.fields.image to the column holding each image ({column})",
        )
    if cfg.source.format in DATASET_FORMATS:
        return read_image_dataset(root, cfg)
    as_text = cfg.fields.model_copy(update={"text": cfg.fields.image})
    src = read_source(root, cfg.model_copy(update={"fields": as_text}))
    return src, attach_images(src, cfg)


def read_image_dataset(root: Path, cfg: DataConfig) -> tuple[SourceData, ImageSource]:
    """The rows and images of a `datasets` source whose `data.fields.image` is an Image column.

    Raises DataError naming the data set (and split), the column and the row: no such column,
    a column that is not an Image, an image that cannot be decoded, a label without a name."""
    import datasets

    src = SourceData(rows=[], files=[], root=root)
    if cfg.source.format == "hf_disk":
        loaded, name = load_hf_disk(src), root.name
    else:
        loaded, name = load_hub(src, cfg), str(cfg.source.name)
    images = ImageSource([], {})
    parts = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split_name, ds in parts:
        where_ds = name + (f"[{split_name}]" if split_name else "")
        _add_split(src, images, cfg, ds, where_ds, split_name)
    return src, images


def _add_split(
    src: SourceData,
    images: ImageSource,
    cfg: DataConfig,
    ds: Any,
    where_ds: str,
    split_name: str | None,
) -> None:
    import datasets

    column = str(cfg.fields.image)
    _check_image_column(ds, column, where_ds)
    mapper = FieldMapper(cfg.fields.model_copy(update={"text": IMAGE_TEXT}), cfg.source.format)
    columns = list(ds.column_names)
    mapper.check_columns(
        columns + [IMAGE_TEXT] + ([HF_SPLIT_COLUMN] if split_name else []), where_ds
    )
    label = cfg.fields.label
    names = _label_feature(ds, label, where_ds) if label else None
    needed = sorted({c for c in mapper.mapped().values() if c in columns} | {column})
    view = ds.select_columns(needed).cast_column(column, datasets.Image(decode=False))
    for i, rec in enumerate(view):
        where = f"{where_ds} row {i}"
        place = f"{where} (column {column!r}, image)"
        add_image_bytes(images, _image_bytes(rec.get(column), src, place), place)
        rec[IMAGE_TEXT] = where
        if split_name:
            rec[HF_SPLIT_COLUMN] = split_name
        if names is not None:
            rec[label] = _label_name(rec.get(label), names, f"{where} (column {label!r}, label)")
        src.rows.append(mapper.row(rec, where))


def _check_image_column(ds: Any, column: str, where_ds: str) -> None:
    import datasets

    image_columns = [c for c, f in ds.features.items() if isinstance(f, datasets.Image)]
    fix = (
        f"set data.fields.image to {' or '.join(repr(c) for c in image_columns)}"
        if image_columns
        else "the data set has no Image column: cast one with "
        "`ds.cast_column(name, datasets.Image())` and save it again"
    )
    if column not in ds.column_names:
        raise DataError(
            f"{where_ds}: no column {column!r} for field 'image' "
            f"(columns: {column_list(list(ds.column_names))})",
            hint=fix,
        )
    feature = ds.features[column]
    if not isinstance(feature, datasets.Image):
        raise DataError(
            f"{where_ds}: column {column!r} (field image) is {_describe(feature)}, "
            "not a datasets Image column",
            hint=fix,
        )


def _describe(feature: Any) -> str:
    dtype = getattr(feature, "dtype", None)
    return f"{type(feature).__name__}({dtype})" if dtype else type(feature).__name__


def _label_feature(ds: Any, column: str, where_ds: str) -> Any:
    """The column's ClassLabel, None for strings; numbers without names are refused."""
    import datasets

    feature = ds.features.get(column)
    if isinstance(feature, datasets.ClassLabel):
        return feature
    dtype = getattr(feature, "dtype", None)
    if isinstance(feature, datasets.Value) and dtype not in ("string", "large_string"):
        raise DataError(
            f"{where_ds}: column {column!r} (field label) holds {dtype} values without names: "
            "the categories would be called '0', '1', ...",
            hint=f"cast it to named labels, `ds.cast_column({column!r}, "
            "datasets.ClassLabel(names=[...]))`, and save it again, or map data.fields.label "
            "to a column of strings",
        )
    return None


def _label_name(value: Any, names: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < names.num_classes:
        return names.int2str(value)
    raise DataError(
        f"{where}: {value!r} is not one of the ClassLabel's {names.num_classes} labels "
        f"(0..{names.num_classes - 1}: {column_list(list(names.names), 5)})",
        hint="give the row a label, or remove the unlabelled rows from the data set",
    )


def _image_bytes(value: Any, src: SourceData, where: str) -> bytes:
    """The Image value's bytes, else the file its relative path names inside the data set."""
    value = value or {}
    if value.get("bytes"):
        return value["bytes"]
    path = value.get("path")
    if not path:
        raise DataError(
            f"{where}: no image (neither bytes nor a path)", hint="fix or remove the row"
        )
    rel = PurePosixPath(path)
    file = src.root / rel
    if rel.is_absolute() or ".." in rel.parts or not file.is_file():
        raise DataError(
            f"{where}: the Image holds no bytes, only the path {path!r}, and no such file is in "
            f"the data set's folder {src.root}",
            hint="store the images' bytes in the data set: load it with the files present and "
            "save it again with `save_to_disk` (it embeds them)",
        )
    return file.read_bytes()  # listed with the data set's files already
