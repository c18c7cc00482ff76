"""The c10d store of a ``sidecar launch --torch`` job, on loopback only.

torch's ``TCPStore`` server listens on every interface whatever ``MASTER_ADDR`` says: with
rank 0 serving it, anyone who reached the machine read and wrote the job's keys (a forged
feed position ended up in the saved data state) while the sidecars listened on loopback
only. So the launcher serves the store itself, as torchrun's agent does
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank is a client): it binds ``127.0.0.1``
and hands the listening socket to a process of this module, which serves the store on it
(``TCPStore(master_listen_fd=...)``) until its stdin closes. One store per start of the
job: a restart's ranks find no keys of the last one.

Example::

  with LoopbackStore() as store:  # MASTER_ADDR=127.0.0.1, MASTER_PORT=store.port
    ...
"""

from __future__ import annotations

import socket
import subprocess
import sys

STOP_S = 5.0  # how long close() waits for the store to exit before it kills it


class LoopbackStore:
  """A c10d store served on ``127.0.0.1:port`` by a child process; ``close()`` stops it."""

  def __init__(self) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
      sock.bind(("127.0.0.1", 0))
      sock.listen(1024)  # ranks that connect before the store runs wait in the backlog
      self.port: int = sock.getsockname()[1]
      fd = sock.fileno()
      self._proc: subprocess.Popen | None = subprocess.Popen(
          [sys.executable, "-m", __name__, str(fd)], pass_fds=(fd,), stdin=subprocess.PIPE,
          start_new_session=True)  # a Ctrl-C to the launcher's group: the launcher stops it

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.port}"

  def close(self) -> None:
    """Stops the store (its stdin closes; SIGKILL after ``STOP_S``); idempotent."""
    proc, self._proc = self._proc, None
    if proc is None:
      return
    assert proc.stdin is not None
    proc.stdin.close()
    try:
      proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()

  def __enter__(self) -> LoopbackStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _serve(fd: int) -> None:
  """Serves the store on listening socket ``fd`` until stdin closes."""
  import datetime

  import torch.distributed as dist
  with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: fd stays
    port = sock.getsockname()[1]
  store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                        master_listen_fd=fd, timeout=datetime.timedelta(seconds=60))
  sys.stdin.buffer.read()  # EOF: the launcher closed it, or is gone
  del store


if __name__ == "__main__":
  _serve(int(sys.argv[1]))
