"""The checks on what a checkpoint call names: paths under the roots, and steps.

Every path a checkpoint call names must lie under one of the checkpoint roots.

A path is resolved (symlinks, ``..``) before the check; a sidecar started without any
root (``sidecar serve --checkpoint-root DIR``) refuses them all
(``PermissionDeniedError``). ``delete`` and ``abort`` remove only directories a
checkpoint wrote (:func:`is_checkpoint_dir`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from sidecar._src.ckptfmt import spec as spec_lib
from sidecar._src.core import env as env_lib, errors

MANIFEST = "sidecar_manifest.json"
ROOTS_FLAG = "--checkpoint-root"
ROOTS_ENV = env_lib.CHECKPOINT_ROOTS
# Orbax's files in a committed step or item: what marks a directory as a checkpoint's.
_MARKERS = ("_CHECKPOINT_METADATA", spec_lib.METADATA_FILE, spec_lib.COMMIT_SUCCESS_FILE, MANIFEST)


def as_int(value: Any, name: str) -> int:
  """``value`` if it is an int (not a bool), else InvalidArgumentError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise errors.InvalidArgumentError(f"{name} must be an int, got {value!r:.100}")
  return int(value)


def has_markers(path: pathlib.Path) -> bool:
  """Whether Orbax's markers or this format's manifest lie in ``path`` itself."""
  return any((path / m).is_file() for m in _MARKERS)


def is_checkpoint_dir(path: pathlib.Path) -> bool:
  """Whether ``path`` is a step (or item) directory a checkpoint wrote: Orbax's markers
  or this format's manifest in it or in one of its item directories."""
  if has_markers(path):
    return True
  return any(child.is_dir() and not child.is_symlink()
             and any((child / m).is_file() for m in _MARKERS) for child in path.iterdir())


class Roots:
  """The checkpoint roots of one sidecar (``host_id``, named in its refusals)."""

  def __init__(self, host_id: int, roots: tuple[str, ...] = ()):
    self._host_id = host_id
    self._roots = tuple(os.path.realpath(r) for r in roots)

  def root_of(self, resolved: str) -> str | None:
    """The root ``resolved`` (a resolved path) lies under, or None."""
    return next((r for r in self._roots
                 if resolved == r or resolved.startswith(r.rstrip(os.sep) + os.sep)), None)

  def resolve(self, path: Any, name: str) -> str:
    """``path`` resolved (symlinks, ``..``), if it lies under a checkpoint root.

    Raises InvalidArgumentError for a non-string and PermissionDeniedError for a path
    outside every root, or for any path where the sidecar has no roots.
    """
    if not isinstance(path, str) or not path or "\0" in path:
      raise errors.InvalidArgumentError(f"{name} must be a directory path, got {path!r:.100}")
    if not self._roots:
      raise errors.PermissionDeniedError(
          f"sidecar host {self._host_id} has no checkpoint root, so it refuses checkpoint "
          f"calls ({name} {path!r:.200}); start it with {ROOTS_FLAG} DIR (repeatable, or "
          f"{ROOTS_ENV}) naming the directory the checkpoints go to")
    resolved = os.path.realpath(path)
    if self.root_of(resolved) is None:
      raise errors.PermissionDeniedError(
          f"{name} {path!r:.200} (resolved: {resolved!r:.200}) is not under a checkpoint root "
          f"of sidecar host {self._host_id} ({', '.join(self._roots)}); checkpoint there, or "
          f"start the sidecar with {ROOTS_FLAG} naming its directory")
    return resolved
