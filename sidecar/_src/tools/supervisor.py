"""A launch's supervisor: starts the trainers, reads their exits, restarts or ends the job.

``sidecar launch`` (``launch.py``) checks its arguments, starts the sidecars and hands the
job to a :class:`Supervisor`: it starts one trainer per rank beside them, reads each
trainer's exit, a dead sidecar or a stalled trainer as a loss, and decides by the job's
rules (``--max-restarts``, ``--elastic``, ``--in-place``, ``--min-hosts``) whether to
restart the trainers (on the hosts left, or in place) or to end the job with the
failure's exit code. Once the trainers are stopped it waits for the steps the sidecars
accepted to be written (``drain.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import BinaryIO, TextIO

from sidecar._src.core import env as env_lib, errors, stacks, stall as stall_lib
from sidecar._src.tools import (
  c10d_store,
  drain,
  standbys as standbys_lib,
  trainers,
  watchdog as watchdog_lib,
)
from sidecar._src.tools.launch_env import free_port, trainer_env
from sidecar._src.tools.local import LocalCluster

_POLL = 0.1
_PUMP_DRAIN_S = 2.0  # the most an exit waits for the rest of the trainer's output
_LOG_TAIL_LINES = 40


@dataclasses.dataclass(frozen=True, slots=True)
class _Exit:
  """An event for the supervisor: trainer ``rank`` (beside ``host``) of start ``restart``
  exited, signal ``signum`` arrived, or the watchdog found a stalled trainer (``wake``)."""
  host: int = -1
  code: int = 0
  signum: int = 0
  restart: int = -1
  rank: int = -1
  wake: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Loss:
  """Host ``host`` failed: its trainer or its sidecar (``what``) ended with ``code``."""
  host: int
  what: str
  code: int
  exit_code: int  # what the launcher exits with if it gives up here
  rank: int = -1  # the trainer's, where it is one of several beside the host
  process: int = -1  # a failed trainer's SIDECAR_PROCESS_ID (the watchdog's key)
  why: str = ""  # what happened, where the exit code does not say it (a stall)
  found: float | None = None  # a stall's: when it was found (monotonic)
  late_s: float = 0.0  # a stall's: how long after its timeout it was found

  def __str__(self) -> str:
    rank = f" (rank {self.rank})" if self.rank >= 0 else ""
    return f"host {self.host}'s {self.what}{rank} {self.why or trainers.how(self.code)}"


class Supervisor:
  """One launch's job: owns the trainers, their output threads and the events of their
  exits and of the launcher's signals (``on_signal``)."""

  def __init__(self, command: Sequence[str], cluster: LocalCluster, *, grace: float,
               stdout: BinaryIO, stderr: TextIO, elastic: bool = False, min_hosts: int = 1,
               in_place: bool = False, max_restarts: int = 0,
               procs_per_host: int = 1, torch: bool = False,
               standby: Sequence[str] | None = None, stall_timeout: float = 0.0):
    self.command = list(command)
    self.lock = threading.Lock()
    # Stalled trainers, and what the rule for failures that recur is told (tools/watchdog.py;
    # the rule: tools/recurring.py).
    # Each trainer's process group (this start's): the only CPU it reads, and signals.
    self.watchdog = watchdog_lib.Watchdog(
        lambda: {h: cluster.addresses[h] for h in self.hosts}, token=cluster.token,
        say=self.say, enabled=stall_timeout > 0,
        groups=lambda: {r: p.pid for r, p in dict(self.trainers).items()},
        wake=lambda: self.events.put(_Exit(wake=True)))
    # With standby (the modules to preload): each rank's next process, imported and
    # waiting (tools/standbys.py).
    self.standbys = None if standby is None else standbys_lib.Standbys(
        command, standby, directory=lambda: cluster.scratch("standby"), lock=self.lock,
        say=self.say)
    self.procs_per_host, self.torch = procs_per_host, torch
    self.in_place, self.max_restarts = in_place, max_restarts
    self.cluster = cluster
    self.grace = grace
    self.stdout = stdout
    self.stderr = stderr
    self.elastic = elastic
    self.min_hosts = min_hosts
    self.events: queue.SimpleQueue[_Exit] = queue.SimpleQueue()  # put() is signal-safe
    self.hosts = list(range(cluster.num_hosts))  # the hosts that remain, in order
    self.restart = 0  # how often the job was restarted; tags its trainers' events
    self.trainers: dict[int, subprocess.Popen] = {}  # rank -> trainer of this start
    self.store: c10d_store.LoopbackStore | None = None  # with torch: this start's store
    self.threads: list[threading.Thread] = []
    self.hurried = False  # a second signal came while the sidecars finished their saves
    self.drained = drain.Drained()  # what the sidecars were writing when the job ended
    self.fails_again = False  # it ended because a restart would fail the same way

  def say(self, text: str) -> None:
    self.print_line(f"sidecar launch: {text}")

  def print_line(self, line: str) -> None:
    """One line of the launcher's output (stderr), whole among the trainers' lines."""
    with self.lock:
      try:
        print(line, file=self.stderr, flush=True)
      except (OSError, ValueError):
        pass  # our stderr is gone: the job goes on, its logs are in their files

  def start_trainers(self) -> None:
    if self.restart:  # the step its trainers resume from: the restart rule's (watchdog.py)
      self.watchdog.life(self.restart)
    # One process needs no coordinator: no TCP port (a TPU host may allow none).
    one = len(self.hosts) * self.procs_per_host == 1
    coordinator = None if one else f"127.0.0.1:{free_port()}"
    master = None
    if self.torch:  # the job's c10d store, on loopback: a fresh one for each start
      self.store = c10d_store.LoopbackStore()
      master = self.store.address
    for h in self.hosts:
      for local in range(self.procs_per_host):
        environ = trainer_env(self.cluster, h, coordinator, os.environ, hosts=self.hosts,
                              restart=self.restart, procs_per_host=self.procs_per_host,
                              local_rank=local, torch_master=master,
                              max_restarts=self._max_restarts())
        rank = int(environ[env_lib.PROCESS_ID])
        environ.setdefault(env_lib.STACKS_SIGNAL, stacks.DEFAULT)  # a stall's stacks
        prefix = f"[host {h}] " if self.procs_per_host == 1 else f"[host {h} rank {rank}] "
        taken = None if self.standbys is None else self.standbys.take(rank, environ)
        if taken is not None:
          proc, pump = taken
          self.threads.append(pump)
        else:
          proc = subprocess.Popen(
              self.command, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT, start_new_session=True)
          pump = self._thread(trainers.pump, proc.stdout, prefix.encode(),
                              self.watchdog.tap(rank, self.stdout), self.lock)
        self.trainers[rank] = proc
        self._thread(self._wait, h, rank, proc, self.restart, pump)
        if self.standbys is not None and self.restart < self._max_restarts():
          self.standbys.start(rank, environ, start=self.restart + 1, prefix=prefix,
                              out=self.watchdog.tap(rank, self.stdout))
    self.stop_standbys(keep=set(self.trainers))

  def stop_standbys(self, keep: Collection[int] = ()) -> None:
    if self.standbys is not None:
      self.standbys.stop(keep)

  def _max_restarts(self) -> int:
    """How often the job may restart, as torchelastic's TORCHELASTIC_MAX_RESTARTS."""
    if not self.elastic or self.in_place:
      return self.max_restarts
    return self.cluster.num_hosts - self.min_hosts

  def _thread(self, target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True,  # daemon: a safety net only
                         name=f"sidecar-launch-{target.__name__}")
    t.start()
    self.threads.append(t)
    return t

  def _wait(self, host: int, rank: int, proc: subprocess.Popen, restart: int,
            pump: threading.Thread) -> None:
    code = proc.wait()
    # Its output read to the end first: the restart rule compares its last error line
    # (a child that kept the pipe open holds it up no longer than this).
    pump.join(timeout=_PUMP_DRAIN_S)
    self.events.put(_Exit(host=host, code=code, restart=restart, rank=rank))

  def supervise(self) -> int:
    """Waits for every trainer to exit 0, or for the failure that ends the job; returns
    the exit code. With ``elastic``, a lost host restarts the job on the others."""
    running = set(self.trainers)
    while running:
      try:
        event = self.events.get(timeout=_POLL)
      except queue.Empty:
        event = _Exit(wake=True)
      if event.wake:  # a turn, or a stall the watchdog found: judged now
        loss = self._check_sidecars() or self._check_stalls()
      else:
        if event.signum:
          self.say(f"got {signal.Signals(event.signum).name}; stopping every process")
          return 128 + event.signum
        if event.restart != self.restart:
          continue  # a trainer of an earlier start, stopped by us
        running.discard(event.rank)
        if event.code == 0:
          continue
        # A dead sidecar, if any, is the cause: its trainer's failure is the symptom.
        loss = self._check_sidecars() or _Loss(
            event.host, "trainer", event.code, trainers.exit_status(event.code),
            rank=event.rank if self.procs_per_host > 1 else -1, process=event.rank)
      if loss is None:
        continue
      if not self._restart(loss):
        return loss.exit_code
      running = set(self.trainers)
    return 0

  def _check_sidecars(self) -> _Loss | None:
    for h in self.hosts:
      code = self.cluster.poll(h)
      if code is not None:
        return _Loss(h, "sidecar", code, trainers.exit_status(code) or 1)
    return None

  def _check_stalls(self) -> _Loss | None:
    """A trainer of this start found hung, its stacks printed and killed (watchdog)."""
    found = time.monotonic()
    if (s := self.watchdog.check(self.trainers, self.restart)) is None:
      return None
    return _Loss(s.host, "trainer", -signal.SIGKILL, stall_lib.EXIT_CODE, process=s.rank,
                 rank=s.rank if self.procs_per_host > 1 else -1, why=s.why, found=found,
                 late_s=s.late_s)

  def _restart(self, loss: _Loss) -> bool:
    """Restarts the job without ``loss.host`` if ``elastic`` allows, or in place if
    ``in_place`` or (for a failed trainer) ``max_restarts`` does; False to end it."""
    if self.in_place or (not self.elastic and loss.what == "trainer" and self.max_restarts):
      return self._restart_in_place(loss)
    lost = time.monotonic() if loss.found is None else loss.found
    left = [h for h in self.hosts if h != loss.host]
    why = str(loss)
    if not self.elastic or len(left) < self.min_hosts:
      more = "" if not self.elastic else (
          f" ({len(left)} hosts would remain, fewer than --min-hosts {self.min_hosts})")
      whom = "the others" if loss.what == "trainer" else "every process"
      self.say(f"{why}{more}; stopping {whom}" + (". Its log ends:" if loss.what == "sidecar"
                                                   else ""))
      if loss.what == "sidecar":
        self.print_log_tail(loss.host)
      return False
    self.say(f"{why}; restarting the job on hosts {left}"
             + (". Its sidecar's log ends:" if loss.what == "sidecar" else ""))
    if loss.what == "sidecar":
      self.print_log_tail(loss.host)
    # A host whose trainer failed is lost too: its sidecar is stopped.
    stop, sidecar, spawn = self._relaunch(left, lambda: self.cluster.kill(loss.host),
                                          since=lost)
    self.say(f"restart {self.restart}: host {loss.host} lost (its {loss.what} "
             f"{trainers.how(loss.code)}); {_processes(len(left) * self.procs_per_host)} "
             f"on hosts {left}, started {stop + sidecar + spawn:.2f} s after the loss "
             f"(stopping the trainers {stop:.2f} s, the lost sidecar {sidecar:.2f} s, "
             f"starting the new trainers {spawn:.2f} s)")
    return True

  def _relaunch(self, hosts: list[int], between: Callable[[], None], *, since: float
                ) -> tuple[float, float, float]:
    """Stops every trainer, runs ``between`` (what becomes of the lost host's sidecar;
    what it raises stops the relaunch), and starts the trainers of ``hosts`` as the
    job's next start. Returns the seconds of each of the three, the first from ``since``."""
    if self.standbys is not None:  # their files, looked at while the trainers stop
      self.standbys.check_ahead()
    self.stop_trainers()
    stopped = time.monotonic()
    between()
    done = time.monotonic()
    self.hosts, self.trainers = list(hosts), {}
    self.restart += 1
    self.start_trainers()
    return stopped - since, done - stopped, time.monotonic() - done

  def _restart_in_place(self, loss: _Loss) -> bool:
    """Restarts every trainer at the job's full size beside the same sidecars, and first
    ``loss.host``'s sidecar if that is what died (a new one, empty, at the same
    addresses: only with ``elastic``)."""
    lost = time.monotonic() if loss.found is None else loss.found
    whom = "every process" if self.elastic else "the others"
    if self.restart >= self.max_restarts:
      self.say(f"{loss} after {self.restart} restarts (--max-restarts {self.max_restarts}); "
               f"stopping {whom}")
      return False
    if loss.what == "trainer" and not loss.why and (
        recurs := self.watchdog.recurs(loss.process, self.restart, loss.code)):
      self.say(f"{loss}; {recurs}; stopping {whom}")
      self.fails_again = True
      return False
    self.say(f"{loss}; restarting "
             + ("its sidecar and " if loss.what == "sidecar" else "")
             + f"every trainer in place on hosts {self.hosts}"
             + (". Its sidecar's log ends:" if loss.what == "sidecar" else ""))
    if loss.what == "sidecar":
      self.print_log_tail(loss.host)

    def start_again() -> None:
      if loss.what != "sidecar":
        return  # every sidecar still runs
      self.cluster.kill(loss.host)  # reaps it
      self.cluster.restart(loss.host)
      self.say(f"host {loss.host}'s new sidecar (pid {self.cluster.pid(loss.host)}) serves "
               f"{self.cluster.addresses[loss.host]}")

    try:
      stop, sidecar, spawn = self._relaunch(self.hosts, start_again, since=lost)
    except errors.SidecarError as e:
      self.say(f"host {loss.host}'s sidecar did not start again: {e}")
      return False
    took = (f"stopping the trainers {stop:.2f} s" if loss.found is None else
            f"found {loss.late_s:.2f} s after its timeout; its stacks, the kill and stopping "
            f"the trainers {stop:.2f} s") + (
        f", the sidecar {sidecar:.2f} s" if loss.what == "sidecar" else "")
    self.say(f"restart {self.restart}: {loss}; "
             f"{_processes(len(self.hosts) * self.procs_per_host)} on hosts {self.hosts} in place, "
             f"started {stop + sidecar + spawn:.2f} s after the loss ({took}, starting the new "
             f"trainers {spawn:.2f} s); {self.max_restarts - self.restart} of --max-restarts "
             f"{self.max_restarts} left")
    return True

  def print_log_tail(self, host: int) -> None:
    lines = self.cluster.log(host).splitlines()[-_LOG_TAIL_LINES:]
    if lines:
      self.print_line("\n".join(f"[sidecar {host}] {line}" for line in lines))

  def finish_saves(self, grace: float) -> None:
    """Once the trainers are stopped: waits up to ``grace`` seconds for the live sidecars
    to write (and commit) the steps they accepted, or until a signal; says each step
    abandoned."""
    live = {h: self.cluster.addresses[h] for h in range(self.cluster.num_hosts)
            if self.cluster.poll(h) is None}
    poll = functools.partial(drain.poll, token=self.cluster.token)
    self.drained = drain.wait(live, grace=grace, say=self.say, interrupted=self.signalled,
                              poll=poll)

  def signalled(self) -> str | None:
    """The name of a signal that came since the supervisor stopped reading its events."""
    while not self.events.empty():  # this thread alone reads it now
      if signum := self.events.get().signum:
        self.hurried = True
        return signal.Signals(signum).name
    return None

  def stop_trainers(self) -> None:
    """SIGTERM to every trainer's process group, SIGKILL to those left after the grace
    (each one named: a trainer that catches SIGTERM costs every restart the grace)."""
    trainers.stop_groups({rank: p.pid for rank, p in self.trainers.items()}, self.grace,
                         self.say)
    for p in self.trainers.values():
      p.wait()
    if self.store is not None:
      self.store.close()
      self.store = None
    for t in self.threads:
      t.join(timeout=2.0)  # A pipe can stay open only in a process outside the group.
    self.threads = [t for t in self.threads if t.is_alive()]

  def on_signal(self, signum: int, frame) -> None:
    del frame
    self.events.put(_Exit(signum=signum))


def _processes(n: int) -> str:
  return f"{n} process{'es' * (n != 1)}"
