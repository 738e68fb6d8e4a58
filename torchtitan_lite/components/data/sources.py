"""Where documents come from: every source is opened through Hugging Face ``datasets``.

``data.dataset`` names one of four kinds of source:

- ``"embedded"``: the standard-library corpus (see ``corpus.py``), loaded as local JSON-lines files;
- a local file or glob (``data/*.jsonl``): the ``json`` / ``parquet`` / ``text`` / ``csv`` builder
  over those files, the format taken from ``data.data_format`` or the file extension;
- a local directory: a dataset folder, opened exactly like a hub repository
  (``load_dataset(path)``: splits come from file names such as ``train-*.parquet`` /
  ``validation.jsonl``), or a folder written by ``Dataset(Dict).save_to_disk``;
- anything else: a Hugging Face hub dataset name, ``load_dataset(name, dataset_config, split=...)``.
  Without network access it must already be in the Hugging Face cache (``HF_DATASETS_OFFLINE=1``).

``data.validation_files`` (a file or glob) replaces the validation split of any source. The result is
a map-style ``Dataset`` or, with ``data.streaming``, an ``IterableDataset``, reduced to the text
column and checked for the problems that otherwise surface deep inside training.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from torchtitan_lite.components.data import prescan, records
from torchtitan_lite.components.data.corpus import embedded_corpus
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.record_formats import MissingCodec, check_codec
from torchtitan_lite.components.data.records import BadRecordPolicy

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

# ``datasets`` (~1 s to import) is imported inside the functions that read a source, so that inspection
# commands (--help, --list-configs, --print-config) never load it.

Role = Literal["train", "validation"]
DataFormat = Literal["auto", "json", "jsonl", "parquet", "text", "csv"]
SourceKind = Literal["embedded", "directory", "files", "hub"]

_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text", "csv": "csv"}
_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
               ".csv": "csv"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_STRING_DTYPES = ("string", "large_string")


class SourceConfig(Protocol):
    """The ``data`` settings that say where the documents come from (``TextDataLoader.Config`` holds them)."""

    dataset: str
    dataset_config: str | None
    data_format: DataFormat
    text_field: str
    train_split: str
    validation_split: str
    validation_files: str | None
    streaming: bool
    on_bad_record: BadRecordPolicy


def load_split(cfg: SourceConfig, role: Role) -> Dataset | IterableDataset:
    """The documents of ``role`` as a dataset holding only ``cfg.text_field``, checked for usability."""
    import datasets

    split = cfg.train_split if role == "train" else cfg.validation_split
    kind = source_kind(cfg.dataset)
    check_options(cfg, validation=role == "validation")
    if role == "validation" and cfg.validation_files is not None:
        check_held_out(cfg)
        # data.dataset_config selects a configuration of data.dataset; it says nothing about these files.
        where = f"data.validation_files={cfg.validation_files!r}"
        ds = _load_files(cfg.validation_files, cfg, split, where)
    else:
        where = _where(cfg.dataset)
        if kind == "embedded":
            ds = _load_builder("json", {split: embedded_corpus().data_files(role)}, cfg, split, where)
        elif kind == "directory":
            ds = _load_directory(cfg, split, where)
        elif kind == "files":
            ds = _load_files(cfg.dataset, cfg, split, where)
        else:
            ds = _call_datasets(
                lambda: datasets.load_dataset(cfg.dataset, name=cfg.dataset_config, split=split,
                                              streaming=cfg.streaming),
                where, split, hint="check the name, data.dataset_config and the split names; without network "
                                   "access (HF_HUB_OFFLINE=1) a dataset must already be in the Hugging Face cache "
                                   "and cannot stream; for a smoke run use --data.dataset embedded")
    return _text_column(ds, cfg.text_field, where, split)


def check_options(cfg: SourceConfig, *, validation: bool) -> None:
    """What ``load_split`` refuses from the options alone, before any file is read: an option the source's
    kind has no use for, and validation of a file source without data.validation_files."""
    kind = source_kind(cfg.dataset)
    where = _where(cfg.dataset)
    if kind in ("embedded", "files"):
        _reject_dataset_config(cfg, where)
    if kind == "embedded" and cfg.data_format != "auto":
        raise DataSourceError(f"data.data_format={cfg.data_format!r} does not apply to the embedded corpus "
                              f"(it is JSON lines); leave data.data_format='auto'")
    if kind == "hub" and cfg.data_format != "auto":
        raise DataSourceError(f"data.data_format={cfg.data_format!r} applies to local files; {where} "
                              f"declares its own format, so leave data.data_format='auto'")
    if validation and kind == "files" and cfg.validation_files is None:
        raise DataSourceError(
            f"{where} is a file or glob, which has no validation split (validation.enable is on); set "
            f"--data.validation_files FILE to held-out documents (a file or glob, e.g. 'data/val-*.jsonl'), "
            f"or --validation.enable false"
        )


def check_held_out(cfg: SourceConfig) -> None:
    """Validation files must be held out: a validation file the training source also names would make the
    validation loss a training loss (it falls as the model memorises it), so such a run is refused."""
    if cfg.validation_files is None or source_kind(cfg.dataset) != "files":
        return
    train = {os.path.realpath(f): f for f in resolve_files(cfg.dataset, _where(cfg.dataset))}
    held_out = resolve_files(cfg.validation_files, f"data.validation_files={cfg.validation_files!r}")
    shared = [f for f in held_out if os.path.realpath(f) in train]
    if shared:
        named = ", ".join(shared[:5]) + (f" and {len(shared) - 5} more" if len(shared) > 5 else "")
        raise DataSourceError(
            f"data.validation_files={cfg.validation_files!r} and data.dataset={cfg.dataset!r} both name {named}: "
            f"the run would validate on documents it trains on; narrow data.dataset to the training files "
            f"(e.g. 'data/train-*.jsonl') or move the validation files out of its glob")


def source_kind(dataset: str) -> SourceKind:
    """Which kind of source ``data.dataset`` names, decided in the order load_split tries them."""
    if dataset == "embedded":
        return "embedded"
    if _is_directory(dataset):
        return "directory"
    if _is_local_files(dataset):
        return "files"
    return "hub"


def resolve_files(pattern: str, what: str) -> list[str]:
    """The sorted files a path or glob names (``**`` recurses), or an error saying what matched nothing."""
    expanded = os.path.expanduser(pattern)
    if _has_glob(expanded):
        files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    else:
        files = [expanded] if os.path.isfile(expanded) else []
    if not files:
        raise DataSourceError(f"{what} matches no files (relative paths resolve from {os.getcwd()}); "
                              f"check the path or glob")
    return files


def resolve_data_files(pattern: str, what: str) -> list[str]:
    """``resolve_files``, refusing an empty (0-byte) file by name: datasets' builders fail on one with a bare
    StopIteration."""
    files = resolve_files(pattern, what)
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        named = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise DataSourceError(f"{what}: {named} is empty (0 bytes), so it holds no documents; write the data into "
                              f"it or leave it out of the path or glob")
    return files


def infer_format(files: list[str], data_format: DataFormat, what: str) -> str:
    """The ``datasets`` builder for ``files``: the configured format, or the one their extension names."""
    if data_format != "auto":
        return _BUILDERS[data_format]
    found = {_format_of(f) for f in files}
    if len(found) != 1 or None in found:
        extensions = sorted({"".join(Path(f).suffixes[-2:]) for f in files})
        raise DataSourceError(
            f"cannot infer the format of {what} from its file extensions {extensions}; set data.data_format "
            f"to one of json, jsonl, parquet, text, csv (files of one format per source)"
        )
    builder = found.pop()
    assert builder is not None
    return builder


# --------------------------------------------------------------------------------------------------
# Source kinds


def local_files(pattern: str, cfg: SourceConfig, where: str) -> tuple[list[str], str, str]:
    """The files ``pattern`` names, the ``datasets`` builder that reads them and the field holding the text."""
    files = resolve_data_files(pattern, where)
    builder = infer_format(files, cfg.data_format, where)
    for file in files:
        try:
            check_codec(file)
        except MissingCodec as error:
            raise DataSourceError(f"{error} ({where})") from None
    return files, builder, "text" if builder == "text" else cfg.text_field


def _load_files(pattern: str, cfg: SourceConfig, split: str, where: str) -> Any:
    from datasets import Dataset, IterableDataset

    files, builder, field = local_files(pattern, cfg, where)
    bad = prescan.scan(files, builder, field, cfg.on_bad_record, where)
    if bad.count:
        kwargs = {"files": files, "builder": builder, "text_field": field, "stamps": records.file_stamps(files)}
        make = IterableDataset.from_generator if cfg.streaming else Dataset.from_generator
        return make(records.good_records, gen_kwargs=kwargs)
    return _load_builder(builder, {split: files}, cfg, split, f"{where} ({len(files)} file(s))",
                         **_reader_options(builder, field))


def _reader_options(builder: str, field: str) -> dict[str, Any]:
    """Read only the text column; every CSV cell of it as text (no type guessing, 'NA' is a document)."""
    import datasets

    if builder == "parquet":
        return {"columns": [field]}
    if builder == "csv":
        return {"usecols": [field], "features": datasets.Features({field: datasets.Value("string")}),
                "keep_default_na": False}
    return {}


def _load_builder(builder: str, data_files: dict[str, list[str]], cfg: SourceConfig, split: str, where: str,
                  **options: Any) -> Any:
    import datasets

    return _call_datasets(
        lambda: datasets.load_dataset(builder, data_files=data_files, split=split, streaming=cfg.streaming, **options),
        where, split, hint=f"the files must be valid {builder} with one document per "
                           f"{'line' if builder == 'text' else 'record'}")


def _load_directory(cfg: SourceConfig, split: str, where: str) -> Any:
    import datasets

    path = os.path.expanduser(cfg.dataset)
    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
        return _load_saved(path, cfg, split, where)
    if cfg.data_format != "auto":
        builder = _BUILDERS[cfg.data_format]
        load = lambda: datasets.load_dataset(builder, data_dir=path, split=split, streaming=cfg.streaming)  # noqa: E731
    else:
        load = lambda: datasets.load_dataset(path, name=cfg.dataset_config, split=split,  # noqa: E731
                                             streaming=cfg.streaming)
    return _call_datasets(load, where, split, hint="a dataset folder names its splits by file name "
                                                   "(train.jsonl, validation-00000.parquet, ...)")


def _load_saved(path: str, cfg: SourceConfig, split: str, where: str) -> Any:
    """A folder written by ``save_to_disk``: a DatasetDict is indexed by split name."""
    import datasets

    _reject_dataset_config(cfg, where)
    saved = _call_datasets(lambda: datasets.load_from_disk(path), where, split, hint="the folder must be "
                           "written by Dataset.save_to_disk or DatasetDict.save_to_disk")
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataSourceError(f"{where} has splits {sorted(saved)}, not {split!r}; set "
                                  f"data.train_split / data.validation_split to one of them")
        saved = saved[split]
    elif split != cfg.train_split:
        raise DataSourceError(f"{where} holds a single dataset without splits, used for training; save a "
                              f"DatasetDict with a {split!r} split or set data.validation_files")
    # Several shards let split_dataset_by_node hand whole shards to data-parallel ranks.
    return saved.to_iterable_dataset(num_shards=min(len(saved), 64) or 1) if cfg.streaming else saved


# --------------------------------------------------------------------------------------------------
# Checks


def _text_column(ds: Any, field: str, where: str, split: str) -> Any:
    from datasets import Dataset, IterableDataset

    columns = ds.column_names
    if columns is None:  # a streaming source whose schema is only known from its records
        first = _first_record(ds, where, split)
        columns = list(first)
    if field not in columns:
        raise DataSourceError(f"{where} (split {split!r}) has no field {field!r} (fields: {columns}); set "
                              f"data.text_field to the field that holds the document text")
    feature = ds.features[field] if ds.features is not None else None
    # A Json feature holds values of mixed types (strings among others): each record is checked as it is
    # read, and a non-string one is a bad record (data.on_bad_record) named by its row.
    mixed = type(feature).__name__ == "Json"  # what datasets infers for a JSON field of mixed types
    if feature is not None and not mixed and getattr(feature, "dtype", None) not in _STRING_DTYPES:
        raise DataSourceError(f"{where} (split {split!r}) field {field!r} holds {feature}, not strings; set "
                              f"data.text_field to the field that holds the document text")
    if isinstance(ds, IterableDataset) and ds.features is None:
        # Records of unknown schema are checked as they are read: one without the field is a bad record
        # (data.on_bad_record), where selecting the column would fail with a bare KeyError.
        return ds
    ds = ds.select_columns([field])
    if isinstance(ds, Dataset) and len(ds) == 0:
        raise DataSourceError(f"{where} (split {split!r}) has no documents; add data or point data.dataset "
                              f"at a non-empty source")
    if isinstance(ds, IterableDataset):
        _first_record(ds, where, split)
    return ds


def _first_record(ds: IterableDataset, where: str, split: str) -> dict:
    try:
        return next(iter(ds))
    except StopIteration:
        raise DataSourceError(f"{where} (split {split!r}) has no documents; add data or point data.dataset "
                              f"at a non-empty source") from None


def _call_datasets(load: Callable[[], Any], where: str, split: str, *, hint: str) -> Any:
    try:
        return load()
    except DataSourceError:
        raise
    except Exception as error:  # datasets raises many types; all mean "this source does not load"
        if "corresponds to no data" in str(error):  # how datasets reports a split without records
            raise DataSourceError(f"{where} (split {split!r}) has no documents; add data or point "
                                  f"data.dataset at a non-empty source") from error
        raise DataSourceError(f"could not load {where} (split {split!r}): {type(error).__name__}: {error}. "
                              f"{hint}") from error


def _where(dataset: str) -> str:
    kind = source_kind(dataset)
    if kind == "embedded":
        return "the embedded corpus"
    return f"data.dataset={dataset!r}" if kind != "hub" else f"hub dataset data.dataset={dataset!r}"


def _reject_dataset_config(cfg: SourceConfig, where: str) -> None:
    if cfg.dataset_config is not None:
        raise DataSourceError(f"data.dataset_config={cfg.dataset_config!r} selects a configuration of a hub "
                              f"dataset or dataset folder; {where} has none, so leave it unset")


def _format_of(path: str) -> str | None:
    name = path.lower()
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _is_directory(dataset: str) -> bool:
    return os.path.isdir(os.path.expanduser(dataset))


def _is_local_files(dataset: str) -> bool:
    """A glob, an existing file, or something that can only be meant as a path (so a typo is reported
    as a missing file rather than sent to the hub)."""
    path = os.path.expanduser(dataset)
    return (_has_glob(path) or os.path.exists(path) or path.startswith(("/", "./", "../"))
            or _format_of(path) is not None)

