"""The trainer processes ``sidecar launch`` starts, as processes: each in a process group of
its own, its output relayed line by line behind a prefix, stopped as a group, and how it
ended. When to start, restart or give up is the launch's (``launch.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import BinaryIO, Protocol


class Out(Protocol):
  """Where a trainer's output goes: a binary stream, or what wraps one."""

  def write(self, data: bytes, /) -> int: ...

  def flush(self) -> None: ...

READ_CHUNK = 1 << 16


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
