"""What a checkpointer holds alone: its directory for its job, and each step it is saving.

The sidecars hold a directory for one job (``server/checkpoint/ownership.py``): another
live job's open is refused, this job's processes and restarts never are
(:func:`open_directory`). In the trainer's process, one save() of a step runs at a time,
and in a single-process job one checkpointer of a directory saves a step at a time
(:class:`StepClaims`): the sidecar could not tell a second from a retry.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sidecar._src.controller.checkpoint.client import CheckpointTransport
from sidecar._src.controller.checkpoint.options import CheckpointOptions
from sidecar._src.controller.peers import Peers
from sidecar._src.core import errors, interrupts, job as job_lib

# A refusal by another live job of the directory (``server/checkpoint/ownership``) is tried
# again for this long: every sidecar of a job that just ended lets go within 5 s.
HELD_WAIT_S = 6.0
HELD = "is held by another live job"
# This process's own job name, where its environment names none (core/job.py): process 0's
# is the job's (every Checkpointer of a process opens as one job).
_PROCESS_JOB = f"job {secrets.token_hex(4)} (pid {os.getpid()} on {socket.gethostname()})"
# The steps a Checkpointer of this process is saving, by (directory, step), until durable
# or failed: a second Checkpointer of the directory (of one Controller, whose sidecar
# session is the same) must not begin the step meanwhile, as the sidecar cannot tell it
# from a retry. Checked in single-process jobs (where no other process waits to agree).
_SAVING: dict[tuple[str, int], StepClaims] = {}
_SAVING_LOCK = threading.Lock()


def job_name(peers: Peers, key: str) -> str:
  """The job the sidecars hold the directory for: every process's the same (``key``: the
  checkpointer's keys' prefix between the processes)."""
  return job_lib.name_of(os.environ) or (
      _PROCESS_JOB if peers.count == 1
      else peers.broadcast(f"{key}/job", _PROCESS_JOB if peers.index == 0 else None))


def open_directory(client: CheckpointTransport, hosts: Sequence[int], directory: str, *,
                   options: CheckpointOptions, sweep: bool, job: str, process: int
                   ) -> list[list[int]]:
  """Opens ``directory`` on ``hosts`` for ``job`` (as trainer process ``process``); the
  committed steps each lists. A refusal because another live job holds it is tried again
  for up to :data:`HELD_WAIT_S` seconds."""
  holder = f"process {process} (pid {os.getpid()} on {socket.gethostname()})"
  deadline = time.monotonic() + HELD_WAIT_S
  while True:
    try:
      return [interrupts.wait(f) for f in [
          client.open(h, directory, ram_steps=options.ram_steps,
                      ram_budget=options.ram_budget, sweep=sweep, job=job, holder=holder)
          for h in hosts]]
    except errors.PermissionDeniedError as e:
      # A job that just ended is let go by each of its sidecars on its own (a restarted
      # notebook kernel's second sidecar let go 3 ms after the first refused): retried
      # here, the sidecar's answer immediate. Opening again is idempotent for this job.
      if HELD not in str(e) or time.monotonic() >= deadline:
        raise
      interrupts.wait_event(threading.Event(), 0.1)


class StepClaims:
  """The steps one checkpointer (of ``directory``) is saving: against its own threads
  (:meth:`copying`) and the other checkpointers of this process (:meth:`reserve`)."""

  def __init__(self, directory: str):
    self._directory = directory
    self._copying: set[int] = set()  # steps a save() of this process is copying now
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def copying(self, step: int) -> Iterator[None]:
    """While a save() copies ``step``; raises InvalidArgumentError while another does."""
    with self._lock:  # two threads saving one step: the second would break both
      if step in self._copying:
        raise errors.InvalidArgumentError(
            f"step {step} is being saved already (another save({step}) of this checkpointer "
            "runs now); save each step once, from one thread")
      self._copying.add(step)
    try:
      yield
    finally:
      with self._lock:
        self._copying.discard(step)

  def reserve(self, step: int, *, single_process: bool) -> Callable[[Any], None]:
    """Marks ``step`` of this directory as being saved by this checkpointer in this
    process (in a single-process job) until the returned callable runs; raises
    PermissionDeniedError while another checkpointer of this process saves it."""
    key = (self._directory, step)
    if not single_process:
      return lambda _: None
    with _SAVING_LOCK:
      other = _SAVING.get(key)
      if other is not None and other is not self:
        raise errors.PermissionDeniedError(
            f"step {step} of {self._directory!r:.200} is being saved by another checkpointer "
            f"of this directory in the same process: another save of step {step} into this "
            "directory is in flight; wait for that save to end (its handle's durable), or "
            "save each step from one checkpointer")
      _SAVING[key] = self

    def release(_: Any) -> None:
      with _SAVING_LOCK:
        if _SAVING.get(key) is self:
          del _SAVING[key]
    return release
