"""A directory leaving a checkpoint directory: removed in one step (:func:`remove_dir`: a
step deleted, an uncommitted one aborted or swept), or a committed step moved out of the
directory's steps and kept (:func:`set_aside`).

A removal renames the directory away first, to ``.<name>.sidecar-deleting-<id>``
(:data:`DELETING`), then removes its files: the next open sweeps one whose removal was cut
short.

``Checkpointer.set_aside(step)`` asks for it (over the Delete RPC, ``set_aside``): a
trainer that goes on from an older step than the latest (a damaged latest step skipped by
``restore(fallback=True)``, or an older one it named) saves the later step numbers anew,
and a save never replaces a committed step. The step's directory is renamed, whole and in
one step, to ``set-aside-<step>`` beside it (``set-aside-<step>-2`` and so on where that is
taken): no listing takes that name for a step (neither the sidecar's, which lists
numbered directories, nor stock Orbax's or DCP's), no retention deletes it and no sweep
removes it, so what was there stays for the user to look at or remove.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import stat
import uuid

log = logging.getLogger(__name__)

DELETING = ".sidecar-deleting-"
PREFIX = "set-aside-"
MAX_TRIES = 1000  # names tried past set-aside-<step> before giving up


def set_aside(step_dir: pathlib.Path) -> str:
  """Renames the committed step directory ``step_dir`` to a free ``set-aside-<step>[-n]``
  beside it; returns the new path ("": ``step_dir`` was gone already).

  Raises:
    FileExistsError: every name tried is taken.
  """
  for n in range(1, MAX_TRIES + 1):
    name = f"{PREFIX}{step_dir.name}" + (f"-{n}" if n > 1 else "")
    dest = step_dir.with_name(name)
    if os.path.lexists(dest):
      continue
    try:
      os.rename(step_dir, dest)
    except FileNotFoundError:
      return ""  # gone meanwhile (another host's retention): nothing to set aside
    except OSError as e:
      if os.path.lexists(dest):  # taken meanwhile (an empty directory made there)
        continue
      raise e
    log.warning("step %s of %s set aside as %s: it is no step of the directory any more "
                "(its number is saved anew); remove it once you are done with it",
                step_dir.name, step_dir.parent, dest)
    return str(dest)
  raise FileExistsError(f"no free name to set {step_dir} aside as ({PREFIX}{step_dir.name} "
                        f"and {MAX_TRIES - 1} more are taken)")


def remove_dir(path: pathlib.Path) -> None:
  """Removes the directory ``path`` in one step for whoever looks at it meanwhile:
  renamed away first (:data:`DELETING`), then its files. Nobody finds it half removed
  (a step with no marker, a DCP save's uncommitted directory with no mark of a save,
  which another host's abort would refuse), and a removal cut short leaves nothing under
  its name. Gone already, or taken by another process's removal meanwhile, is no error;
  what is no directory (a file, a symlink) is left as it is."""
  try:
    if not stat.S_ISDIR(os.lstat(path).st_mode):
      return
    gone = path.with_name(f".{path.name}{DELETING}{uuid.uuid4().hex[:8]}")
    os.rename(path, gone)
  except (FileNotFoundError, NotADirectoryError):
    return
  shutil.rmtree(gone, ignore_errors=True)
