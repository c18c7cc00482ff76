"""Worker processes that fill a feed's batches in the arena (``FeedOptions(workers=N)``).

Each worker is a fresh interpreter (spawned, never forked) that imports the
sidecar's modules, maps the arena through an inherited memfd and builds the
pipeline itself. The sidecar sends it (batch position, output blocks); the
worker writes the rows straight into those blocks and answers. A worker that
dies is restarted and given its unfinished batches again, so the stream the
trainer sees has no gap and no duplicate. Workers run as the sidecar does, JAX on
the CPU and no accelerator in sight (``core/platform.py``): the trainer owns the chip.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.core import errors, platform
from sidecar._src.server.pool import shares as shares_lib
from sidecar._src.user import data_roots
from sidecar._src.wire import ipc, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
MAX_RESTARTS = 3
# How long a closed feed's workers get to exit on their own (their socket's end tells them
# to) before they are killed: one in the middle of a slow batch must not outlive its feed,
# whose trainer may be dead (a restart's feed then waits for no leftover of the last).
STOP_GRACE = 0.5
# While a batch is being filled, how often the feed checks that its consumer still lives.
ALIVE_EVERY = 0.1


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
  """How a feed's worker processes are started: the command (its two descriptors'
  numbers follow), its environment (None: the sidecar's, JAX on the CPU), its directory
  and its process group. A pool tenant's (``tenant_procs/``) holds each to its tenant's
  limits and user, in its tenant process's group."""
  argv: tuple[str, ...] = (sys.executable, "-m", "sidecar._src.server.feeds.child")
  env: dict[str, str] | None = None
  cwd: str | None = None
  process_group: int | None = None


HERE = Launch()


@dataclasses.dataclass(slots=True)
class _Worker:
  proc: subprocess.Popen
  sock: socket.socket
  tasks: dict[int, dict[str, Any]]  # sent, unanswered, by sequence number


class FeedProcesses:
  """``size`` worker processes for one feed; a context manager.

  ``turns``: its tenant's turns at the sidecar's feed workers (``share.Shares``): a batch
  goes to a worker only on one of them, so a tenant's workers fill at most its fair share of
  batches at once, however many it started. None: no tenant, no share.

  ``alive``: whether the feed's consumer (its trainer) still lives, asked every
  ``ALIVE_EVERY`` seconds while ``wait`` waits for a batch: a trainer that dies while a
  slow batch is filled ends its feed, and its workers, then, not once the batch is done.

  ``roots``: where the pipeline each worker opens may read files (its tenant's data roots
  in a pool), as the sidecar's own opening of it.

  ``launch``: how each worker is started (a pool tenant's: its limits, its user).
  """

  def __init__(self, size: int, *, arena: shm.Arena, imports: tuple[str, ...], name: str,
               kwargs: pb.Value, spec: pb.FeedSpec, turns: shares_lib.Turns | None = None,
               alive: Callable[[], bool] | None = None,
               roots: data_roots.DataRoots = data_roots.ANYWHERE, launch: Launch = HERE):
    self.size = size
    self._launch = launch
    self._turns = turns
    self._alive = alive
    self._arena = arena
    self._hello = {"imports": list(imports), "name": name, "arena_size": arena.size,
                   "arena_populate": arena.reserved,
                   "kwargs": base64.b64encode(kwargs.SerializeToString()).decode(),
                   "spec": base64.b64encode(spec.SerializeToString()).decode(),
                   "data_roots": roots.to_dict()}
    self._workers: list[_Worker] = []
    self._seq = 0
    self._restarts = 0
    try:
      for i in range(size):
        self._workers.append(self._spawn(i, {}))
    except BaseException:
      self.close()
      raise

  def _spawn(self, i: int, tasks: dict[int, dict[str, Any]]) -> _Worker:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    launch = self._launch
    with theirs:
      proc = subprocess.Popen(
          [*launch.argv, str(theirs.fileno()), str(self._arena.fd)],
          pass_fds=(theirs.fileno(), self._arena.fd), stdin=subprocess.DEVNULL,
          env=platform.sidecar_env(os.environ) if launch.env is None else launch.env,
          cwd=launch.cwd, process_group=launch.process_group)
    worker = _Worker(proc, ours, tasks)
    try:
      ipc.send(ours, self._hello)
      reply, _ = ipc.recv(ours)
    except OSError:  # it died before it answered: a crash while it imported or built
      self._stop(worker)
      raise self._died(i, proc.returncode, "before it was ready") from None
    if "error" in reply:
      self._stop(worker)
      raise protocol.error_from_dict(reply["error"], host=f"feed worker {i}")
    for task in tasks.values():  # a restarted worker redoes what its predecessor left
      ipc.send(ours, task)
    return worker

  def free(self) -> bool:
    """Whether ``submit`` would send at once: its tenant is below its share of the workers."""
    return self._turns is None or self._turns.free()

  def submit(self, step: tuple[int, int], out: list[list[np.ndarray]]) -> tuple[int, int]:
    """Sends batch ``(epoch, position)`` into arrays ``out`` to a worker; returns a ticket.

    Waits for its tenant's turn first: call it with batches of this pool in flight only
    when ``free()`` says so (else those are what the turn waits for).
    """
    if self._turns is not None:
      self._turns.take()
    seq, self._seq = self._seq, self._seq + 1
    i = seq % self.size
    blocks = [[[self._arena.contains(a), list(a.shape), a.dtype.name] for a in leaf]
              for leaf in out]
    task = {"seq": seq, "epoch": step[0], "position": step[1], "blocks": blocks}
    worker = self._workers[i]
    worker.tasks[seq] = task
    try:
      ipc.send(worker.sock, task)
    except OSError:
      pass  # found dead in wait(), which restarts it with this task
    return i, seq

  def wait(self, ticket: tuple[int, int]) -> float:
    """Waits for a batch; returns the seconds the worker spent on it.

    Raises:
      ClosedError: the consumer died meanwhile (``alive``): the feed is over.
      RemoteError: the pipeline raised in the worker, or its workers kept dying.
    """
    i, seq = ticket
    while True:
      worker = self._workers[i]
      self._wait_readable(worker.sock)
      try:
        reply, _ = ipc.recv(worker.sock)
      except (ConnectionError, OSError):
        self._restart(i, seq)
        continue
      if worker.tasks.pop(reply["seq"], None) is not None and self._turns is not None:
        self._turns.give()
      if "error" in reply:
        raise protocol.error_from_dict(reply["error"], host=f"feed worker {i}")
      if reply["seq"] == seq:
        return float(reply["produce_s"])

  def _wait_readable(self, sock: socket.socket) -> None:
    """Returns once ``sock`` has data (or its end) to read; raises if the consumer died."""
    if self._alive is None:
      return
    poller = select.poll()  # not select.select: a busy sidecar's descriptors pass 1024
    poller.register(sock, select.POLLIN)
    while not poller.poll(ALIVE_EVERY * 1000):
      if not self._alive():
        raise errors.ClosedError("the feed's consumer is gone; its batch is abandoned")

  def _restart(self, i: int, seq: int) -> None:
    old = self._workers[i]
    code = old.proc.wait()
    self._restarts += 1
    if self._restarts > MAX_RESTARTS * self.size:
      raise self._died(i, code, f"and workers were restarted {self._restarts - 1} times; "
                       f"giving up at batch {seq}")
    log.warning("feed worker %d died (exit code %s); restarting it from batch %d, the first "
                "it had not delivered", i, code, min(old.tasks, default=seq))
    old.sock.close()
    self._workers[i] = self._spawn(i, old.tasks)

  def _died(self, i: int, code: int | None, when: str) -> errors.RemoteError:
    """The pipeline's failure where its worker process died (this sidecar lives on)."""
    how = f"exit code {code}"
    if code is not None and code < 0:
      with contextlib.suppress(ValueError):
        how = f"killed by {signal.Signals(-code).name}"
    return errors.RemoteError(
        "FeedWorkerDied", f"feed worker {i} of pipeline {self._hello['name']!r} died ({how}) "
        f"{when}: a crash in the pipeline's native code, or the kernel's OOM killer (see "
        "dmesg; fewer workers= use less memory)")

  @staticmethod
  def _stop(*workers: _Worker) -> None:
    """Stops ``workers`` together: each socket closed (a worker exits when its socket
    closes), then whoever still runs after ``STOP_GRACE`` is killed; all are reaped."""
    for w in workers:
      w.sock.close()
    deadline = time.monotonic() + STOP_GRACE
    for w in workers:
      try:
        w.proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        log.warning("feed worker (pid %d) still ran %g s after its feed ended; killing it",
                    w.proc.pid, STOP_GRACE)
        w.proc.kill()
        w.proc.wait()

  def close(self) -> None:
    """Stops every worker (within ``STOP_GRACE`` seconds) and reaps it; idempotent."""
    for w in self._workers:
      if self._turns is not None:
        self._turns.give(len(w.tasks))  # unanswered: abandoned with the feed
        w.tasks.clear()
    self._stop(*self._workers)
    self._workers = []

  def __enter__(self) -> FeedProcesses:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
