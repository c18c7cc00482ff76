"""Whether one path lies in another, by whole components (``/a/bc`` is not in ``/a/b``).

The paths are compared as given: resolve them first (``os.path.realpath``) wherever a
symlink or ``..`` could make two spellings of one place.
"""

from __future__ import annotations

import os


def inside(path: str, directory: str) -> bool:
  """Whether ``path`` is ``directory`` or lies beneath it."""
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def beneath(path: str, directory: str) -> bool:
  """Whether ``path`` lies strictly beneath ``directory`` (not ``directory`` itself)."""
  return path != directory and inside(path, directory)


def overlap(a: str, b: str) -> bool:
  """Whether ``a`` and ``b`` are one directory, or one holds the other."""
  return inside(a, b) or inside(b, a)
