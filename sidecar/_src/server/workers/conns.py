"""One connection of the worker socket (``workers.py``): its own I/O failing, its failures
logged, whether its client is still there, and how a refused one ends.

What ends a connection unanswered is its own socket failing (``Gone``), and nothing
else: it is raised only around the connection's own reads and writes (``own_io``). An
OSError raised anywhere else (a pipeline's FileNotFoundError, the sidecar's own
PermissionDeniedError) is answered to the client, never taken for a closed socket:
issue 62 item 1, where a user's OSError once read as "the sidecar is gone".
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator

from sidecar._src.core import errors
from sidecar._src.server import client_log
from sidecar._src.wire import ipc, protocol

log = logging.getLogger(__name__)
# How long a refused connection waits for the request its client may be sending (linger).
LINGER_S = 1.0


class Gone(Exception):
  """A connection's own read or write failed: its client closed it, or died. Never
  leaves ``workers.py``: it ends the connection there, with nobody left to tell."""


@contextlib.contextmanager
def own_io() -> Iterator[None]:
  """Around a connection's own reads and writes: its OSError (ConnectionError,
  TimeoutError included) raised as ``Gone``."""
  try:
    yield
  except OSError as e:
    raise Gone(e) from e


def log_failure(what: str, e: Exception, session: str, client: str) -> None:
  """Our errors at INFO (the caller gets them; a pipeline's RemoteError was logged at
  ERROR, with its traceback, where it was raised), anything else (user code's in a call,
  or a fault of ours) at ERROR with its traceback; within ``client``'s share of the log
  (``client_log``)."""
  said = client_log.DEFAULT
  if isinstance(e, errors.RemoteError):
    said.info(log, client, "%s: %s: %s", what, e.remote_type,
              protocol.for_log(e.remote_message), extra={"session": session})
  elif isinstance(e, errors.SidecarError):
    said.info(log, client, "%s: %s: %s", what, type(e).__name__, protocol.for_log(e),
              extra={"session": session})
  else:
    said.log(log, logging.ERROR, client, "%s raised %s: %s", what, type(e).__name__,
             protocol.for_log(e), exc_info=e, extra={"session": session})


def linger(conn: socket.socket, limit: int) -> None:
  """After the answer that refuses a connection: says the end (EOF), then reads the
  request its client may be sending, for at most LINGER_S. A client sends its first
  request right after the connection's opening frame; closed at once, the connection
  would fail that send (EPIPE: 'the sidecar is gone') before its client read why."""
  with contextlib.suppress(OSError, ConnectionError, errors.SidecarError):
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(LINGER_S)
    ipc.recv_bytes(conn, limit=limit)


def quiet(conn: socket.socket) -> bool:
  """Whether a worker waiting for an alloc is still there and still waits: it sends
  nothing meanwhile, so data (its cancel) or a hang-up ends the wait."""
  try:
    conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
  except BlockingIOError:
    return True
  except OSError:
    return False
  return False


def client_open(conn: socket.socket) -> bool:
  """Whether the other end of ``conn`` is still there (it sends nothing during a call, so
  a readable socket with no data is one it closed)."""
  try:
    return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
  except BlockingIOError:
    return True
  except OSError:
    return False
