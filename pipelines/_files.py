"""Naming input files: what the file-reading pipelines share."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence


def expand_paths(paths: str | os.PathLike | Sequence[str], kind: str) -> list[str]:
  """Files named by ``paths`` (a path, a glob or a list), each one checked to exist.

  ``kind`` names the format in the error, e.g. ``"Parquet"``.
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [os.fspath(paths)]
  if not paths:
    raise ValueError("paths must name at least one file, got an empty list")
  files = []
  for pattern in map(os.fspath, paths):
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    missing = [m for m in matches if not os.path.isfile(m)]
    if not matches or missing:
      raise FileNotFoundError(f"no {kind} file at {(missing or [pattern])[0]!r}; "
                              "check the path, or the glob if it is one")
    files.extend(matches)
  return files
