"""``sidecar stalls``: which trainers of some sidecars are hung, read from outside.

The Kubernetes trainer container's liveness probe (``sidecar stalls localhost:8490
--stacks``, docs/kubernetes.md): one process, run now and then beside the trainer, that
reads each sidecar's ``Status.trainers`` and exits 1 where one is hung. Busy is not hung
(``core/stall.py``'s ``judge``, as ``sidecar launch``'s watchdog judges: ``watchdog.py``):
where a trainer is stalled the sidecars are read again :data:`busy.MIN_WINDOW_S` later, and
what each trainer's process burned meanwhile (``TrainerStatus.cpu_s``: the sidecar reads the
pid it had from the kernel) tells slow from hung. Its stacks are asked only of a pid it may
signal (:func:`_unsignalled`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sidecar._src.core import busy, stacks, stall
from sidecar._src.tools import watchdog
from sidecar._src.wire import ipc

if TYPE_CHECKING:  # the protobuf messages load with gRPC, once a Status is read
  from sidecar._src.wire.protocol import pb


def probe(addresses: Sequence[str], *, token: str | None, timeout: float, send_stacks: bool,
          say: Callable[[str], None]) -> int:
  """``sidecar stalls``: 1 where a trainer attached to one of the sidecars at ``addresses``
  is hung (a "stall" line for each, and a "not stalled" line, with its state, for each of
  the others; with ``send_stacks``, its stacks asked for where
  :func:`_unsignalled` finds no reason not to: the k8s trainer container's liveness probe
  runs beside it), else 0. Busy is not hung: where one is stalled the sidecars are read
  again :data:`busy.MIN_WINDOW_S` later, and a stalled trainer whose process burned CPU
  meanwhile (its sidecar reads it: ``TrainerStatus.cpu_s``) is slow, one that burned nothing
  while another trainer of its start worked waits (``stall.judge``): each is said, and
  neither fails the probe before :data:`stall.SLOW_MULTIPLE` x its timeout. A sidecar that
  does not answer is said, and is no stall: its own probes watch it."""
  from sidecar._src.arena import shm  # numpy: `sidecar launch --help` stays fast
  here = (shm.boot_id(), ipc.pid_namespace())
  first = _read_all(addresses, token=token, timeout=timeout, say=say)
  _say_not_stalled(first, say)
  if not any(t.stalled and not t.ended for got in first.values() for t in got.trainers):
    return 0
  time.sleep(busy.MIN_WINDOW_S)  # a second reading: what each burned meanwhile
  then = time.monotonic() - busy.MIN_WINDOW_S
  second = _read_all(addresses, token=token, timeout=timeout, say=say)
  cpu = busy.Samples()
  for reading, at in ((first, then), (second, None)):
    for address, got in reading.items():
      for t in got.trainers:
        cpu.add((address, t.rank, t.restart, t.pid), t.cpu_s if t.cpu_s >= 0 else None, at)
  found = 0
  for address, got in second.items():
    for t in got.trainers:
      if not t.stalled or t.ended:
        continue
      rate = cpu.rate((address, t.rank, t.restart, t.pid))
      works = next((f"rank {o.rank}" for a, g in second.items() for o in g.trainers
                    if o.restart == t.restart and o.rank != t.rank and not o.ended and (
                        (o.phase and not o.stalled)
                        or (cpu.busy((a, o.rank, o.restart, o.pid)) or False))), "")
      verdict = stall.judge(t.since_step_s, t.stall_timeout_s,
                            busy=None if rate is None else rate >= busy.BUSY_SHARE,
                            others_work=bool(works))
      head = (f"host {got.identity.host_id} rank {t.rank} stalled: no step for "
              f"{t.since_step_s:.1f} s since its last step (its stall timeout "
              f"{t.stall_timeout_s:.1f} s; pid {t.pid if t.pid_verified else 'unverified'})")
      if verdict is not stall.Verdict.HUNG:
        say(f"{head}, but " + (f"it works ({watchdog.share(rate)} of a core): slow" if verdict is
                               stall.Verdict.SLOW else f"{works} works: it waits")
            + f"; no hang before {stall.SLOW_MULTIPLE:g}x its timeout. If this is an "
            f"evaluation or another long phase, {watchdog.FIX}")
        continue
      found += 1
      say(head)
      if not send_stacks:
        continue
      if (why := _unsignalled(t, got, here)) is not None:
        say(f"no stacks asked of host {got.identity.host_id} rank {t.rank}: {why}")
        continue
      sig = watchdog.stacks_signal()
      # Unknown (no SigCgt in /proc: gVisor) is sent too: an attached trainer's Worker
      # armed it where SIDECAR_STACKS_SIGNAL is set, as in this container's environment.
      if sig is not None and stacks.catches(t.pid, sig) is not False:
        with contextlib.suppress(OSError):
          os.kill(t.pid, sig)  # its stacks go to its own stderr: the container's log
  return 1 if found else 0


def _say_not_stalled(reading: dict[str, pb.StatusResponse], say: Callable[[str], None]
                     ) -> None:
  """A line for each trainer of ``reading`` that is not stalled, with its state: a gap on
  its way to a stall shows here before its timeout (issue 79)."""
  from sidecar._src.controller import status as status_lib
  for got in reading.values():
    for t in got.trainers:
      if t.ended or t.stalled:
        continue
      say(f"host {got.identity.host_id} rank {t.rank} not stalled: "
          f"{status_lib.trainer_state(t)}" + (
              f", its last step {t.since_step_s:.1f} s ago" if t.since_step_s >= 0 else
              " (its clock starts at its first completed step)")
          + (f", in it {t.phase_s:.0f} s" if t.phase else "")
          + (f" (its stall timeout {t.stall_timeout_s:.1f} s)" if t.stall_timeout_s > 0
             else " (no stall timeout)"))


def _read_all(addresses: Sequence[str], *, token: str | None, timeout: float,
              say: Callable[[str], None]) -> dict[str, pb.StatusResponse]:
  """Each sidecar's Status that answered; one that did not is said."""
  from sidecar._src.controller import status as status_lib  # gRPC, as refresh()
  out = {}
  for address in addresses:
    try:
      out[address] = status_lib.fetch(address, timeout=timeout, token=token)
    except Exception as e:  # noqa: BLE001 - any failure: no stall can be told
      say(f"cannot read the status of the sidecar at {address} ({type(e).__name__}: {e}); "
          "no stall can be told")
  return out


def _unsignalled(t: pb.TrainerStatus, got: pb.StatusResponse, here: tuple[str, str]
                 ) -> str | None:
  """Why ``sidecar stalls --stacks`` may not signal trainer ``t`` (a ``TrainerStatus`` of
  Status ``got``), None where it may: only a pid the sidecar had from the kernel (its
  worker socket's peer credentials), of the caller's own tenant, in this process's boot and
  PID namespace (``here``), where the number names the same process (issue 69)."""
  if not t.pid_verified or not 0 < t.pid < ipc.PID_LIMIT:
    return ("its pid is unverified: the sidecar had none from the kernel (a trainer in "
            "another PID namespace; in Kubernetes, shareProcessNamespace: true shares one)")
  if t.tenant != got.tenant:
    return (f"it is tenant {t.tenant!r}'s trainer, and this token is "
            + (f"tenant {got.tenant!r}'s" if got.tenant else "no tenant's")
            + ": a token acts on its own tenant's trainers only")
  boot, namespace = here
  if not boot or got.identity.boot_id != boot or not namespace or (
      got.identity.pid_namespace != namespace):
    return (f"its pid {t.pid} is the sidecar's view, from another "
            + ("kernel" if got.identity.boot_id != boot else "PID namespace")
            + " than this process's (or one /proc does not name), where it names another "
            "process: run `sidecar stalls --stacks` beside the trainer, sharing the sidecar's "
            "PID namespace")
  return None
