"""The directories ``sidecar slurm`` makes and removes: its own, and nothing else.

A batch job's rendezvous directory (``$SIDECAR_SLURM_DIR``, by default
``$SIDECAR_HOME/slurm/JOB_ID``) and a service's directory (``$SIDECAR_HOME/NAME``) get a
marker file, ``.sidecar-slurm``, when the tool takes them: who holds the directory
(``job 1234``, ``service lab``) and whether the tool made it. The tool

- takes a path that does not exist (it makes it, mode 0700), or an empty directory of
  this user's (it keeps it, and its mode: what it writes there is private on its own: the
  token files 0600, the subdirectories 0700);
- takes again a directory whose marker names the same holder (a requeued job's earlier
  run, a service started again), after removing its own entries there;
- refuses anything else, naming the path: a file, a non-empty directory without its
  marker, one another job or service holds, another user's;
- at the end removes only its own entries (the names the caller lists) and the marker,
  then the directory itself if it made it and nothing else is left in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable

from sidecar._src.core import errors

MARKER = ".sidecar-slurm"


def holder(directory: str) -> dict | None:
  """The marker of ``directory`` (``{"holder": ..., "made": ...}``), or None."""
  try:
    with open(os.path.join(directory, MARKER)) as f:
      found = json.load(f)
  except (OSError, ValueError):
    return None
  return found if isinstance(found, dict) and isinstance(found.get("holder"), str) else None


def _write_marker(directory: str, name: str, made: bool, *, new: bool) -> None:
  path = os.path.join(directory, MARKER)
  flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC)
  try:
    fd = os.open(path, flags, 0o600)
  except FileExistsError:  # another job or service took it in the meantime
    raise errors.InvalidArgumentError(
        f"{directory} was taken by another sidecar slurm job or service just now") from None
  with os.fdopen(fd, "w") as f:
    json.dump({"holder": name, "made": made}, f)


def _remove(directory: str, entries: Iterable[str]) -> None:
  for entry in entries:
    path = os.path.join(directory, entry)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def claim(directory: str, name: str, entries: Iterable[str], *, what: str) -> None:
  """Takes ``directory`` for ``name`` (``"job 1234"``), or refuses it (module docstring).

  ``entries`` are the names the holder writes there; ``what`` says in an error where the
  path came from (``"SIDECAR_SLURM_DIR"``, ``"--name lab"``).

  Raises:
    InvalidArgumentError: the path is not this tool's to take, naming it and why.
  """
  parent = os.path.dirname(directory)
  if parent:
    os.makedirs(parent, mode=0o700, exist_ok=True)
  try:
    os.mkdir(directory, 0o700)
  except FileExistsError:
    pass
  else:
    _write_marker(directory, name, True, new=True)
    return
  if not os.path.isdir(directory) or os.path.islink(directory):
    raise errors.InvalidArgumentError(
        f"{directory} ({what}) exists and is not a plain directory (a file, a link); "
        "sidecar slurm makes its own directory there: pick a path that does not exist")
  mark = holder(directory)
  if mark is not None:
    if mark["holder"] != name:
      raise errors.InvalidArgumentError(
          f"{directory} ({what}) holds the files of sidecar slurm {mark['holder']}; left "
          "as it is. Pick another path, or remove it once that one has ended")
    _remove(directory, entries)  # this holder's earlier run (a requeued job, say)
    _write_marker(directory, name, bool(mark.get("made")), new=False)
    return
  if os.stat(directory).st_uid != os.getuid():
    raise errors.InvalidArgumentError(
        f"{directory} ({what}) belongs to another user; sidecar slurm uses only a new "
        "directory or an empty one of your own")
  found = sorted(os.listdir(directory))
  if found:
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    raise errors.InvalidArgumentError(
        f"{directory} ({what}) is not empty ({shown}) and was not made by sidecar slurm; "
        "it uses only a new directory or an empty one, and never removes what it did not "
        "make: pick another path")
  _write_marker(directory, name, False, new=True)


def release(directory: str, name: str, entries: Iterable[str]) -> bool:
  """Removes what ``name`` made in ``directory``: ``entries`` and the marker, then the
  directory if ``name`` made it and it is empty. Returns whether the directory is gone.
  Does nothing where the marker names someone else, or there is none."""
  mark = holder(directory)
  if mark is None or mark["holder"] != name:
    return False
  _remove(directory, entries)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(directory, MARKER))
  if not mark.get("made"):
    return False
  try:
    os.rmdir(directory)
  except OSError:
    return False  # someone else's file inside: left, with it
  return True
