"""The main of a tenant's process (``python -m sidecar._src.server.tenant_procs.child FD``).

The sidecar (``process.py``) starts it with one end of a socketpair as descriptor ``FD``. It
reads the sidecar's ``Hello``, holds itself to the tenant's limits
(``limits.ProcessLimits.apply``) before it imports any module of the user's, imports them
(JAX on the CPU, as the sidecar's: ``core/platform.py``; the operator's code, which the
sidecar imported as its own user too), becomes the tenant's user where it has one
(``ProcessLimits.become``), answers ``Ready``, then serves: an ``ArenaFd`` maps one of
its tenant's arenas, a ``JobFd`` runs a job in a thread of its own (``child_jobs.serve``).
When the control socket ends (the sidecar stops it, or died, ``kill -9`` included), it
empties its temporary directory and kills its own process group: itself and its feed
workers, whatever they were doing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading

from sidecar._src.arena import shm
from sidecar._src.core import platform
from sidecar._src.server.tenant_procs import child_jobs, limits as limits_lib, messages as m
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import protocol


def main(control: socket.socket) -> None:
  hello, _, _ = m.recv(control, (m.Hello,), what="the sidecar")
  assert isinstance(hello, m.Hello)
  limits = limits_lib.ProcessLimits.from_dict(hello.limits)
  try:
    limits.apply()  # first: nothing of the user's runs unbounded
    for path in reversed(hello.sys_path):
      if path not in sys.path:
        sys.path.insert(0, path)
    platform.apply_to_sidecar()
    registry_lib.load_modules(list(hello.imports))  # the operator's code, as the sidecar's
    limits.become()  # the tenant's user, before anything of the tenant's arrives
  except Exception as e:  # an import that fails (or meets a limit): the sidecar says so
    m.send(control, m.Error(protocol.error_dict(limits.typed(e))))
    _end(hello.tmp)
  m.send(control, m.Ready(os.getpid()))
  arenas = child_jobs.Arenas()
  while True:
    try:
      message, _, fds = m.recv(control, (m.ArenaFd, m.JobFd), max_fds=1, what="the sidecar")
    except (ConnectionError, OSError):
      break  # the sidecar stopped this process, or died
    if not fds:
      continue
    if isinstance(message, m.ArenaFd):
      arenas.add(message.arena, shm.Arena.attach(fds[0], message.size, populate=False))
    else:
      threading.Thread(target=child_jobs.serve, name="sidecar-tenant-job", daemon=True,
                       args=(socket.socket(fileno=fds[0]), arenas, limits)).start()
  _end(hello.tmp)


def _end(tmp: str) -> None:
  """Empties this process's temporary directory, then kills its process group (its feed
  workers and itself): nothing of it outlives its sidecar."""
  with contextlib.suppress(OSError):
    for name in os.listdir(tmp):
      path = os.path.join(tmp, name)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.unlink(path)
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):
      stream.flush()
  os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
  main(socket.socket(fileno=int(sys.argv[1])))
