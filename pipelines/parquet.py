"""Parquet files as a pipeline, streamed one row group at a time.

The work is split into units of (file, row group), dealt round-robin to the
shards: shard ``i`` of ``n`` reads units ``i, i + n, i + 2n, ...`` in file order
(or in an order shuffled by seed and epoch with ``shuffle=True``). Resuming at a
position skips whole row groups using the row counts in the files' footers, then
the first rows of one group; nothing skipped is read. Files are never read
whole: at most ``batch_rows`` rows of the projected columns are in memory.

Columns become numpy values: integer, floating and boolean columns give scalars,
``fixed_size_list`` columns (nested any depth) give arrays of fixed shape.
Strings, binary, variable-length lists and other types have no fixed-shape
numpy form: project them out with ``columns=[...]``.

Example::

  # sidecar serve --import pipelines.parquet
  feed = ctl.feed("parquet", global_batch_size=256, sharding=sharding,
                  kwargs={"paths": "/data/train-*.parquet", "columns": ["features", "label"]})
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

import sidecar
from pipelines._files import expand_paths

try:
  import pyarrow as pa
  import pyarrow.parquet as pq
except ImportError as e:  # Not in the core install: an extra.
  raise ImportError(
      "pipelines.parquet needs pyarrow: pip install 'colocated-sidecar[parquet]'") from e

Unit = tuple[sidecar.DataFile, int, int]  # (file, row group, rows in it)


@sidecar.pipeline
def parquet(ctx: sidecar.PipelineContext, *, paths: str | Sequence[str],
            columns: Sequence[str] | None = None, batch_rows: int = 1024,
            shuffle: bool = False) -> Iterator[dict[str, np.ndarray]]:
  """This shard's rows of ``paths``, from ``ctx.position`` on, one dict per row.

  Args:
    ctx: which shard to read, where to start in it, and where the files may be
      (``ctx.data_path``).
    paths: a file, a glob, or a list of them; read in the order given (each
      glob's matches sorted).
    columns: the columns to read (all of them if None).
    batch_rows: rows decoded at a time; bounds the memory a row group takes.
    shuffle: deal the row groups in an order drawn from ``(ctx.seed, ctx.epoch)``
      rather than file order; rows within a row group keep their order.

  Returns:
    An iterator of ``{column: numpy scalar or array}``, for this shard only.

  Raises:
    NotFoundError: a path or glob that names no file.
    PermissionDeniedError: in a pool, a path outside the feed's data roots.
    ValueError: a column that is missing, or differs in type between files.
    TypeError: a column whose type has no fixed-shape numpy form.
  """
  if not isinstance(batch_rows, int) or batch_rows < 1:
    raise ValueError(f"batch_rows must be a positive int, got {batch_rows!r}")
  columns = list(columns) if columns is not None else None
  units, schema = [], None
  for path in expand_paths(ctx, paths, "Parquet"):
    file = path.open()  # held by its units until the rows are read
    meta = pq.read_metadata(file.library_path)
    if ctx.data_roots.roots is not None:
      _check_own_data(file.name, meta)
    schema = _check_schema(file.name, meta.schema.to_arrow_schema(), columns, schema)
    units += [(file, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
              if meta.row_group(g).num_rows]
  if shuffle:
    order = np.random.default_rng([ctx.seed, ctx.epoch]).permutation(len(units))
    units = [units[i] for i in order]
  return _rows(units[ctx.shard_index::ctx.shard_count], columns, batch_rows, ctx.position)


def _rows(units: list[Unit], columns: list[str] | None, batch_rows: int,
          skip: int) -> Iterator[dict[str, np.ndarray]]:
  for file, file_units in itertools.groupby(units, key=lambda unit: unit[0]):
    path = file.name
    with pq.ParquetFile(file.library_path) as f:
      for _, group, num_rows in file_units:
        if skip >= num_rows:  # The whole row group is behind the position: not read.
          skip -= num_rows
          continue
        for batch in f.iter_batches(batch_size=batch_rows, row_groups=[group],
                                    columns=columns):
          if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
          batch, skip = batch.slice(skip), 0
          arrays = {name: _to_numpy(name, path, batch.column(name))
                    for name in batch.schema.names}
          for i in range(batch.num_rows):
            yield {name: array[i] for name, array in arrays.items()}


def _check_own_data(path: str, meta: pq.FileMetaData) -> None:
  """Refuses, in a pool, a file whose footer says its column data lies in another file
  (a column chunk's ``file_path``, as a dataset's ``_metadata`` summary has): the pipeline
  reads each file's own bytes only, and a reader that followed the name would open a
  file nobody checked was beneath the tenant's data roots.

  Raises:
    InvalidArgumentError: naming the file, the row group and the path it names.
  """
  for g in range(meta.num_row_groups):
    group = meta.row_group(g)
    for c in range(group.num_columns):
      if group.column(c).file_path:
        raise sidecar.InvalidArgumentError(
            f"{path}: row group {g} says its column data is in {group.column(c).file_path!r:.200}"
            ", another file (a dataset's _metadata summary?); a pool tenant's Parquet feed "
            "reads each file's own data: name the data files themselves")


def _check_schema(path: str, schema: pa.Schema, columns: list[str] | None,
                  first: tuple[str, pa.Schema] | None) -> tuple[str, pa.Schema]:
  """Checks the projected columns of one file; returns the first file's projection."""
  for name in columns or ():
    if schema.get_field_index(name) < 0:
      raise ValueError(f"column {name!r} is not in {path}; its columns are {schema.names}")
  projected = pa.schema([schema.field(name) for name in (columns or schema.names)])
  for field in projected:
    if not _has_numpy_form(field.type):
      raise TypeError(
          f"column {field.name!r} of {path} has type {field.type}, which has no fixed-shape "
          "numpy form; leave it out with columns=[...], or store it as numbers or a "
          "fixed_size_list")
  if first is None:
    return path, projected
  if projected.names != first[1].names:
    raise ValueError(f"{path} has columns {projected.names} but {first[0]} has "
                     f"{first[1].names}; pass columns=[...] that every file has")
  for field, expected in zip(projected, first[1]):
    if field.type != expected.type:
      raise ValueError(f"column {field.name!r} is {field.type} in {path} but "
                       f"{expected.type} in {first[0]}; every file needs the same types")
  return first


def _has_numpy_form(t: pa.DataType) -> bool:
  if pa.types.is_fixed_size_list(t):
    return _has_numpy_form(t.value_type)
  return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _to_numpy(name: str, path: str, array: pa.Array) -> np.ndarray:
  """One column of a batch as a numpy array with one leading row axis."""
  if array.null_count:
    raise ValueError(f"column {name!r} of {path} has {array.null_count} nulls in a batch; "
                     "fill them before writing, or leave the column out with columns=[...]")
  if pa.types.is_fixed_size_list(array.type):
    values = _to_numpy(name, path, array.flatten())
    return values.reshape(len(array), array.type.list_size, *values.shape[1:])
  return array.to_numpy(zero_copy_only=False)
