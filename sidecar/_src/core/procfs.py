"""What the kernel says of a process: its ``/proc/PID/stat`` line, read by one parser.

A pid alone does not name a process: the kernel gives a freed pid to the next process
that needs one, within seconds on a busy machine (``kernel.pid_max`` is 32768 on many).
A pid and its process's **start** (clock ticks after boot, ``stat``'s field 22) do, for as
long as the machine runs: :func:`same` says whether the process that had ``start`` then
still has ``pid`` now. Its state, its process group and the CPU time all its threads used
(``utime + stime``, :attr:`Stat.cpu_s`) come from the same line: the kernel's count, which
no process can claim for another (issue 76: the kernel counts; issue 77: busy is not hung).

Where ``/proc`` has no such entry (the process is gone, another PID namespace, not Linux)
the answer is None: never a guess.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
PID_MAX = 1 << 22  # above any pid a Linux kernel gives (PID_MAX_LIMIT)


@dataclasses.dataclass(frozen=True, slots=True)
class Stat:
  """One process, as its ``/proc/PID/stat`` line said when it was read."""
  pid: int
  state: str  # R running or runnable, S sleeping, D disk wait, Z zombie, ... (proc(5))
  pgrp: int  # its process group
  cpu_ticks: int  # utime + stime: every thread's, those ended included
  start: int  # clock ticks after boot: with pid, the process's identity

  @property
  def cpu_s(self) -> float:
    return self.cpu_ticks * _TICK_S

  @property
  def alive(self) -> bool:
    """Whether it still runs (a zombie ended: it only waits to be reaped)."""
    return self.state not in ("Z", "X", "x")


def valid_pid(pid: object) -> bool:
  """Whether ``pid`` is an int some process may have (1 .. :data:`PID_MAX`)."""
  return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= PID_MAX


def read(pid: int) -> Stat | None:
  """Process ``pid``'s line now; None where there is none (gone, not a valid pid)."""
  if not valid_pid(pid):
    return None
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      line = f.read()
  except OSError:
    return None
  return _parse(pid, line)


def _parse(pid: int, line: bytes) -> Stat | None:
  # The name (field 2) is in parentheses and may hold spaces and ")": split after the last.
  fields = line[line.rfind(b")") + 2:].split()
  try:  # proc(5)'s fields 3 (state), 5 (pgrp), 14 (utime), 15 (stime), 22 (starttime)
    return Stat(pid, fields[0].decode(), int(fields[2]), int(fields[11]) + int(fields[12]),
                int(fields[19]))
  except (IndexError, ValueError, UnicodeDecodeError):
    return None


def start(pid: int) -> int | None:
  """Process ``pid``'s start (clock ticks after boot); None where it is gone."""
  stat = read(pid)
  return None if stat is None else stat.start


def same(pid: int, started: int | None) -> bool:
  """Whether ``pid`` is still the live process that started at ``started`` (a pid freed
  and given to another process since is not; None: never known, so never the same)."""
  stat = None if started is None else read(pid)
  return stat is not None and stat.alive and stat.start == started


def every() -> Iterator[Stat]:
  """Every process this ``/proc`` shows (those that end while it is read are left out)."""
  try:
    names = os.listdir("/proc")
  except OSError:
    return
  for name in names:
    if name.isdigit() and (stat := read(int(name))) is not None:
      yield stat


def in_groups(groups: Iterable[int]) -> dict[int, list[Stat]]:
  """The live processes of each process group of ``groups``, as one read of ``/proc``
  finds them (a group with none: an empty list)."""
  out: dict[int, list[Stat]] = {g: [] for g in groups}
  if out:
    for stat in every():
      if stat.pgrp in out and stat.alive:
        out[stat.pgrp].append(stat)
  return out
