"""The trainer processes ``sidecar launch`` starts, as processes: each in a process group of
its own, its output relayed line by line behind a prefix, stopped as a group, and how it
ended. When to start, restart or give up is the launch's (``supervisor.py``)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO, Protocol

from sidecar._src.core import procfs

# Python's options that take a value as the next argument (``python -X dev SCRIPT``).
_PYTHON_VALUE_OPTIONS = frozenset({"-W", "-X", "--check-hash-based-pycs"})
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


class Out(Protocol):
  """Where a trainer's output goes: a binary stream, or what wraps one."""

  def write(self, data: bytes, /) -> int: ...

  def flush(self) -> None: ...

READ_CHUNK = 1 << 16


def cannot_start(command: Sequence[str]) -> str | None:
  """Why ``command`` cannot start, told before anything runs (a restart would fail the
  same way): its program is not found, or it is ``python SCRIPT ...`` (after ``env
  NAME=VALUE...``, if any) and SCRIPT is not a file; else None. ``-m``/``-c`` and other
  programs' arguments are their own to check."""
  args, path = list(command), None
  if args and os.path.basename(args[0]) == "env":
    args.pop(0)
    while args and _ASSIGNMENT.fullmatch(args[0]):
      path = args[0][len("PATH="):] if args[0].startswith("PATH=") else path
      args.pop(0)
  if not args:
    return None
  program = args[0]
  if shutil.which(program, path=path) is None:
    return (f"cannot run {program!r}: no such program (not a path to an executable, nor "
            "found on PATH)")
  if not re.fullmatch(r"python[\d.]*", os.path.basename(program)):
    return None
  rest = args[1:]
  while rest and rest[0].startswith("-") and rest[0] != "-":
    if rest[0] in ("-m", "-c") or rest[0].startswith(("-m", "-c")) or rest[0] == "--":
      return None if rest[0] != "--" or len(rest) < 2 or os.path.isfile(rest[1]) else (
          _no_script(rest[1]))
    rest = rest[2:] if rest[0] in _PYTHON_VALUE_OPTIONS else rest[1:]
  if rest and rest[0] != "-" and not os.path.isfile(rest[0]):
    return _no_script(rest[0])
  return None


def _no_script(path: str) -> str:
  return (f"cannot run the trainer: its script {os.path.abspath(path)} is not a file "
          f"(python would exit 2: can't open file {path!r}); check the path")


def pump(pipe: BinaryIO, prefix: bytes, out: Out, lock: threading.Lock) -> None:
  """Copies ``pipe`` to ``out`` line by line, each line prefixed; ends a partial last line.

  A chunk that ends mid-line (a line longer than a chunk, or the last one) is held until
  the next read: the last line and its added newline go out in one write, so another
  trainer's line never lands between them.
  """
  at_start, held = True, b""
  with pipe:
    for chunk in iter(lambda: pipe.readline(READ_CHUNK), b""):
      if held:  # more of its line came: it was not the last
        write(out, held, lock)
      data = prefix + chunk if at_start else chunk
      at_start = chunk.endswith(b"\n")
      held = b"" if at_start else data
      if at_start:
        write(out, data, lock)
  if held:
    write(out, held + b"\n", lock)


def write(out: Out, data: bytes, lock: threading.Lock) -> None:
  with lock:
    try:
      out.write(data)
      out.flush()
    except (OSError, ValueError):
      pass  # Our stdout is gone; keep draining so the trainer never blocks on a full pipe.


def exit_status(returncode: int) -> int:
  """A Popen return code as a shell reports it: 128+N for a process killed by signal N."""
  return 128 - returncode if returncode < 0 else returncode


def how(returncode: int) -> str:
  """How a process with ``returncode`` ended, in words."""
  if returncode < 0:
    return f"was killed by {signal.Signals(-returncode).name}"
  return f"exited with code {returncode}"


PID_MAX = procfs.PID_MAX  # the kernel's largest pid_max (PID_MAX_LIMIT, 64-bit)


def in_group(pid: int, group: int) -> bool:
  """Whether ``pid`` is a live process in process group ``group`` (a trainer this launcher
  started leads its own), as the kernel says (``/proc/<pid>/stat``'s pgrp), never as a
  client claims: a pid that is not an int in 1..:data:`PID_MAX`, not alive, a zombie, or
  in another group (another user's process, the launcher's own) is not."""
  stat = procfs.read(pid) if procfs.valid_pid(group) else None
  return stat is not None and stat.alive and stat.pgrp == group


def signal_group(pgid: int, signum: int) -> None:
  try:
    os.killpg(pgid, signum)
  except (ProcessLookupError, PermissionError):
    pass  # The group is empty (or its last member a zombie being reaped).


def group_alive(pgid: int) -> bool:
  try:
    os.killpg(pgid, 0)
  except (ProcessLookupError, PermissionError):
    return False
  return True


def stop_groups(groups: Mapping[int, int], grace: float, say: Callable[[str], None]) -> None:
  """SIGTERM to each trainer's process group (``{rank: pgid}``), SIGKILL to those left after
  ``grace`` seconds, each one named: a trainer that catches SIGTERM costs every stop the grace."""
  for g in groups.values():
    signal_group(g, signal.SIGTERM)
  deadline = time.monotonic() + grace
  while any(group_alive(g) for g in groups.values()) and time.monotonic() < deadline:
    time.sleep(0.01)
  for rank, g in groups.items():
    if group_alive(g):
      say(f"trainer {rank} still ran {grace:g} s after SIGTERM; killing it (SIGKILL). "
          "Does it catch SIGTERM?")
    signal_group(g, signal.SIGKILL)
