"""Worker processes that fill a feed's batches in the arena (``FeedOptions(workers=N)``).

Each worker is a fresh interpreter (spawned, never forked) that imports the
sidecar's modules, maps the arena through an inherited memfd and builds the
pipeline itself. The sidecar sends it (batch position, output blocks); the
worker writes the rows straight into those blocks and answers. A worker that
dies is restarted and given its unfinished batches again, so the stream the
trainer sees has no gap and no duplicate. Workers run as the sidecar does, JAX on
the CPU and no accelerator in sight (``core/platform.py``): the trainer owns the chip.
Workers whose feed ended may serve the next feed of the same work (``idle.py``): their
batches in flight drained (:meth:`FeedProcesses.drain`), then adopted
(:meth:`FeedProcesses.adopt`).
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
from sidecar._src.core import dtypes as dtypes_lib, errors, platform
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
  answers: ipc.FrameReader  # on ``sock``: an answer's header and body in one ``recv``


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
    self.slowest_s = 0.0  # the longest a worker took for one batch (``idle.py``'s drain)
    # Answers read before their batch was waited for (``_collect``), by sequence number.
    self._early: dict[int, dict[str, Any]] = {}
    self._answers = select.poll()  # every worker's socket: which have answered
    try:
      # All start at once: each imports the pipeline's modules and builds it, seconds apart
      # from none (one after another, 12 workers that import Grain took minutes to start).
      for i in range(size):
        self._workers.append(self._start(i, {}))
      for i in range(size):
        self._ready(i)
    except BaseException:
      self.close()
      raise

  def _start(self, i: int, tasks: dict[int, dict[str, Any]]) -> _Worker:
    """Starts worker ``i`` and sends it the pipeline; ``_ready`` waits for it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    launch = self._launch
    with theirs:
      proc = subprocess.Popen(
          [*launch.argv, str(theirs.fileno()), str(self._arena.fd)],
          pass_fds=(theirs.fileno(), self._arena.fd), stdin=subprocess.DEVNULL,
          env=platform.sidecar_env(os.environ) if launch.env is None else launch.env,
          cwd=launch.cwd, process_group=launch.process_group)
    worker = _Worker(proc, ours, tasks, ipc.FrameReader(ours))
    try:
      ipc.send(ours, self._hello)
    except OSError:
      pass  # it died at once: _ready says how
    return worker

  def _ready(self, i: int) -> None:
    """Waits for worker ``i`` to have built the pipeline, then sends it its tasks (a
    restarted worker redoes what its predecessor left)."""
    worker = self._workers[i]
    try:
      reply, _ = ipc.recv(worker.sock)
    except OSError:  # it died before it answered: a crash while it imported or built
      self._stop(worker)
      raise self._died(i, worker.proc.wait(), "before it was ready") from None
    if "error" in reply:
      self._stop(worker)
      raise protocol.error_from_dict(reply["error"], host=f"feed worker {i}")
    for task in worker.tasks.values():
      ipc.send(worker.sock, task)
    self._answers.register(worker.sock, select.POLLIN)

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
    self._collect()
    i = least_busy([len(w.tasks) for w in self._workers], seq % self.size)
    blocks = [[[self._arena.contains(a), list(a.shape), dtypes_lib.name_of(a.dtype)]
               for a in leaf] for leaf in out]
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
    while (reply := self._early.pop(seq, None)) is None:
      worker = self._workers[i]
      try:
        self._answered(worker, self._answer(worker))
      except (ConnectionError, OSError):
        self._restart(i, seq)
    if "error" in reply:
      raise protocol.error_from_dict(reply["error"], host=f"feed worker {i}")
    return float(reply["produce_s"])

  def _answered(self, worker: _Worker, reply: dict[str, Any]) -> None:
    """Takes ``worker``'s answer: its batch is done (its turn given back), and kept until
    waited for, in order (a pipeline's error too)."""
    if worker.tasks.pop(reply["seq"], None) is not None and self._turns is not None:
      self._turns.give()
    self.slowest_s = max(self.slowest_s, float(reply.get("produce_s", 0.0)))
    self._early[reply["seq"]] = reply

  def _collect(self) -> None:
    """Takes the answers that came already (one poll of every worker's socket), so that
    ``submit`` sees which workers are free. A worker found dead is left to ``wait``, which
    restarts it when its batch is due."""
    for fd, _ in self._answers.poll(0):
      for worker in self._workers:
        if worker.sock.fileno() == fd:
          try:
            while True:
              self._answered(worker, self._answer(worker, wait=False))
          except (BlockingIOError, ConnectionError, OSError):
            pass
          break

  def _answer(self, worker: _Worker, *, wait: bool = True) -> dict[str, Any]:
    """``worker``'s next answer: at once where it has come already (the workers ahead of
    the feed: one ``recv``, no poll), else once it comes (``_wait_readable``); ``wait``
    False: BlockingIOError instead."""
    try:
      return ipc.message_of(worker.answers.read(wait=False))
    except BlockingIOError:
      if not wait:
        raise
    # Not come yet: wait outside the handler (a consumer gone is its own error, not one
    # raised while handling the empty read)
    self._wait_readable(worker.sock)
    return ipc.message_of(worker.answers.read())

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
    with contextlib.suppress(KeyError, ValueError):  # not registered yet, or closed
      self._answers.unregister(old.sock)
    old.sock.close()
    self._workers[i] = self._start(i, old.tasks)
    self._ready(i)

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

  @property
  def pids(self) -> list[int]:
    """The worker processes' ids, by worker."""
    return [w.proc.pid for w in self._workers]

  def drain(self, timeout: float) -> bool:
    """Waits for the answer to every batch in flight and drops it (its feed ended), so that
    none reaches the next feed these workers serve and none is written after its blocks
    went back; the consumer's ``alive`` is no longer asked. False where an answer did not
    come within ``timeout`` seconds (a batch stuck in the pipeline) or a worker died: then
    only :meth:`close` is left."""
    self._alive = None
    deadline = time.monotonic() + timeout
    try:
      for worker in self._workers:
        while worker.tasks:
          try:
            self._answered(worker, self._answer(worker, wait=False))
          except BlockingIOError:
            left = deadline - time.monotonic()
            poller = select.poll()
            poller.register(worker.sock, select.POLLIN)
            if left <= 0 or not poller.poll(left * 1000):
              return False
    except (ConnectionError, OSError):
      return False
    finally:
      self._early.clear()
    return True

  def adopt(self, size: int, *, turns: shares_lib.Turns | None,
            alive: Callable[[], bool] | None) -> None:
    """Serves another feed of the same work (drained: none of the last one's batches is
    in flight): ``size`` workers (the surplus stopped, the lacking started, together), its
    tenant's ``turns`` and its consumer's ``alive``; a restart budget of its own."""
    assert not any(w.tasks for w in self._workers), "drain() first"
    self._turns, self._alive, self._restarts = turns, alive, 0
    if size < len(self._workers):
      surplus, self._workers = self._workers[size:], self._workers[:size]
      for w in surplus:
        with contextlib.suppress(KeyError, ValueError):
          self._answers.unregister(w.sock)
      self._stop(*surplus)
    first = len(self._workers)
    self.size = size
    for i in range(first, size):
      self._workers.append(self._start(i, {}))
    for i in range(first, size):
      self._ready(i)

  def close(self) -> None:
    """Stops every worker (within ``STOP_GRACE`` seconds) and reaps it; idempotent."""
    for w in self._workers:
      if self._turns is not None:
        self._turns.give(len(w.tasks))  # unanswered: abandoned with the feed
        w.tasks.clear()
    self._stop(*self._workers)
    self._workers = []
    self._early.clear()

  def __enter__(self) -> FeedProcesses:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def least_busy(loads: list[int], start: int) -> int:
  """The worker with the fewest batches to make (``loads``, by worker): a slower one (a
  core it shares, a costlier batch) is given fewer, and the feed is not held to its pace.
  Among equals, the first from ``start`` on (the batch's turn): they take turns."""
  n = len(loads)
  return min(range(start, start + n), key=lambda j: loads[j % n]) % n
