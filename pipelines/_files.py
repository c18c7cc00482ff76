"""Naming input files: what the file-reading pipelines share.

Every path a pipeline opens goes through ``ctx.data_path`` (``sidecar.DataPath``): in a
pool, a tenant's feed reads only beneath its data roots (docs/pool.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import sidecar


def expand_paths(ctx: sidecar.PipelineContext, paths: str | os.PathLike | Sequence[str],
                 kind: str) -> list[sidecar.DataPath]:
  """The files named by ``paths`` (a path, a glob or a list of them), in order, each glob's
  matches sorted; each one checked to be a file (in a pool: beneath the feed's data roots).

  ``kind`` names the format in the error, e.g. ``"Parquet"``.

  Raises:
    NotFoundError: a path or glob that names no file.
    PermissionDeniedError: in a pool, one outside the feed's data roots.
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [os.fspath(paths)]
  if not paths:
    raise ValueError("paths must name at least one file, got an empty list")
  files = []
  for pattern in paths:
    files.extend(ctx.data_path(pattern).expand(what=f"{kind} file"))
  return files


class Holding:
  """A random-access data source that keeps open what its reads need (the ``DataFile``\\ s
  or ``DataView`` whose paths a library was handed): they close when it goes."""

  def __init__(self, source: Any, keep: Any):
    self._source = source
    self._keep = keep

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: Any) -> Any:
    return self._source[i]
