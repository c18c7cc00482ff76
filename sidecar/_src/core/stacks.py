"""A trainer's Python stacks on a signal: what ``sidecar launch`` prints of a stalled one.

Where ``$SIDECAR_STACKS_SIGNAL`` names a signal (``sidecar launch`` sets ``SIGUSR2`` unless
it is set; the k8s manifests set it too), the trainer library registers
``faulthandler`` on it when a Worker attaches (:func:`arm`): the signal makes the process
write every thread's Python stack to its stderr, and go on. faulthandler's handler runs in
C, so it works for a trainer hung anywhere: in a blocked socket read, ``time.sleep``, a
lock, a collective. A launcher sends it unless the process is known not to catch it
(:func:`catches`): the signal's default action would kill a process that did not arm.
Where ``/proc`` cannot tell (gVisor's, on the lent TPU host, has no SigCgt), it is sent
to attached trainers: their Worker armed it where the variable is set.
"""

from __future__ import annotations

import faulthandler
import signal

from sidecar._src.core import env as env_lib

DEFAULT = "SIGUSR2"  # what sidecar launch sets


def parse(name: str) -> signal.Signals:
  """The signal ``name`` names (``SIGUSR2``, ``USR2`` or its number).

  Raises:
    ValueError: no such signal, or one that cannot be caught (SIGKILL, SIGSTOP).
  """
  text = name.strip().upper()
  try:
    sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
        text if text.startswith("SIG") else "SIG" + text]
  except (KeyError, ValueError):
    raise ValueError(f"{env_lib.STACKS_SIGNAL} must name a signal, e.g. {DEFAULT}, got "
                     f"{name!r:.50}") from None
  if sig in (signal.SIGKILL, signal.SIGSTOP):
    raise ValueError(f"{env_lib.STACKS_SIGNAL} must be a signal a process can catch, got "
                     f"{sig.name}")
  return sig


def arm() -> signal.Signals | None:
  """Registers faulthandler on ``$SIDECAR_STACKS_SIGNAL``, every thread's stack to fd 2
  (the process's stderr, whatever ``sys.stderr`` became); None where it is unset or not
  a signal (nothing is registered). Idempotent."""
  name = env_lib.get(env_lib.STACKS_SIGNAL)
  if name is None:
    return None
  try:
    sig = parse(name)
    faulthandler.register(sig, file=2, all_threads=True, chain=False)
  except (ValueError, OSError, RuntimeError):
    return None  # never the reason a trainer does not start
  return sig


def catches(pid: int, sig: int) -> bool | None:
  """Whether process ``pid`` catches signal ``sig`` (``/proc/PID/status``'s SigCgt); None
  where that cannot be told: a kernel whose ``/proc`` has no SigCgt (gVisor's, as on the
  lent TPU host), or no such process. False only where it is known not to."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("SigCgt:"):
          return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
  except (OSError, ValueError, IndexError):
    pass
  return None
