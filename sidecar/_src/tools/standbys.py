"""The launcher's standby processes (``sidecar launch --standby``): each rank's next process,
started while the job trains, handed the next start's environment at a restart.

``tools/standby.py`` is the process itself; this is the launcher's side of it: one per rank,
its output relayed as the trainer's, and the check before it takes over that the files it
imported are still those on disk, and still those a fresh import finds first (an operator's
fix between two lives must run: where one changed, or a new file now shadows a module it
imported, a fresh process is started instead, with one line that names it). At a restart
that check runs while the old trainers stop (:meth:`Standbys.check_ahead`: on an accelerator
host a killed trainer takes seconds to give its device back, and a standby's imports are
thousands of files to look at), not after: a change made in the moments between that check
and the take is the next restart's to find.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Collection, Sequence

from sidecar._src.core import errors
from sidecar._src.tools import standby as standby_lib, trainers


@dataclasses.dataclass(frozen=True, slots=True)
class Standby:
  """A rank's next process, imported and waiting; the thread that pumps its output; the
  file it reports its imports to (``standby.write_report``)."""
  proc: subprocess.Popen
  pump: threading.Thread
  report: str


def check(command: Sequence[str]) -> None:
  """Raises InvalidArgumentError where a standby cannot run ``command`` (not Python's)."""
  if standby_lib.command(command, ()) is None:
    raise errors.InvalidArgumentError(
        f"a standby process runs a Python trainer: the command must be `python SCRIPT ...` "
        f"or `python -m MODULE ...` (after `env NAME=VALUE...` if you like), got "
        f"{' '.join(command)!r:.200}; leave out --standby")


class Standbys:
  """The standby processes of one launch, by rank; owns them and their output threads.

  Args:
    command: the trainer's command (``python SCRIPT ...`` or ``python -m MODULE ...``).
    preload: the modules each standby imports ahead (JAX's too, where installed).
    directory: where the standbys write their reports, called when the first starts.
    lock: the lock of the output the standbys' lines go to (``trainers.pump``).
    say: the launcher's messages.

  Raises:
    InvalidArgumentError: ``command`` is not Python's.
  """

  def __init__(self, command: Sequence[str], preload: Sequence[str], *,
               directory: Callable[[], str], lock: threading.Lock,
               say: Callable[[str], None]):
    check(command)
    self._command, self._preload = list(command), list(preload)
    self._directory = directory
    self._lock, self._say = lock, say
    self._by_rank: dict[int, Standby] = {}
    self._ahead: dict[int, tuple[list[str] | None, list]] = {}  # rank -> its checks' answers
    self._checking: threading.Thread | None = None

  def start(self, rank: int, environ: dict[str, str], *, start: int, prefix: str,
            out: trainers.Out) -> None:
    """Starts ``rank``'s process for start number ``start``: it imports, then waits; its
    output goes to ``out``, each line behind ``prefix``, as the trainer's would."""
    report = os.path.join(self._directory(), f"rank{rank}-start{start}.json")
    command = standby_lib.command(self._command, self._preload, report=report)
    assert command is not None  # launch.run checked the command
    proc = subprocess.Popen(
        command, env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    pump = threading.Thread(target=trainers.pump, daemon=True, name="sidecar-launch-pump",
                            args=(proc.stdout, prefix.encode(), out, self._lock))
    pump.start()
    self._by_rank[rank] = Standby(proc, pump, report)

  def check_ahead(self) -> None:
    """Checks every standby's files now, in a thread of its own (the caller meanwhile stops
    the trainers); :meth:`take` joins it and uses its answers."""
    self._join_check()
    standbys = dict(self._by_rank)
    self._checking = threading.Thread(target=self._check_all, args=(standbys,), daemon=True,
                                      name="sidecar-launch-standby-check")
    self._checking.start()

  def _check_all(self, standbys: dict[int, Standby]) -> None:
    for rank, standby in standbys.items():
      self._ahead[rank] = (standby_lib.changed_files(standby.report),
                           standby_lib.shadowed(standby.report))

  def _join_check(self) -> None:
    if self._checking is not None:
      self._checking.join()
      self._checking = None

  def take(self, rank: int, environ: dict[str, str]
           ) -> tuple[subprocess.Popen, threading.Thread] | None:
    """``rank``'s standby, told to run with ``environ``, and its output's thread (the
    caller joins it); None where there is none, or it is gone, or a file it imported
    changed since: the caller starts a fresh process."""
    standby = self._by_rank.pop(rank, None)
    self._join_check()
    ahead = self._ahead.pop(rank, None)
    if standby is None:
      return None
    changed, moved = ahead or (standby_lib.changed_files(standby.report),
                               standby_lib.shadowed(standby.report))
    if changed:
      more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
      self._say(f"rank {rank}'s standby process imported {changed[0]}{more}, changed since; "
                "starting a new one, which runs the new code")
      _end(standby)
      return None
    if moved:
      name, was, now = moved[0]
      more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
      self._say(f"rank {rank}'s standby process imported module {name!r} from {was}, but a "
                f"new process would import {now or 'another'}{more}; starting a new one, "
                "which runs the new code")
      _end(standby)
      return None
    proc = standby.proc
    try:
      if proc.poll() is not None:
        raise BrokenPipeError(f"it exited ({trainers.how(proc.returncode)})")
      assert proc.stdin is not None
      proc.stdin.write(json.dumps({"env": environ}).encode() + b"\n")
      proc.stdin.close()
    except OSError as e:
      self._say(f"rank {rank}'s standby process could not take over ({e}); starting a new one")
      _end(standby)
      return None
    return proc, standby.pump

  def stop(self, keep: Collection[int] = ()) -> None:
    """Ends the standby processes of ranks not in ``keep``: they only wait, so at once
    (and joins a check under way)."""
    self._join_check()
    self._ahead.clear()
    for rank in [r for r in self._by_rank if r not in keep]:
      _end(self._by_rank.pop(rank))


def _end(standby: Standby) -> None:
  """Kills a standby process (it only waits), reaps it and ends its output's thread."""
  trainers.signal_group(standby.proc.pid, signal.SIGKILL)
  standby.proc.wait()
  standby.pump.join(timeout=2.0)
