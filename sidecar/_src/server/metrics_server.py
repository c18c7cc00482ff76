"""The HTTP server of ``/metrics``: a bounded number of connections, each with a read timeout.

Prometheus's own server starts a thread per connection and reads without a timeout, so
200 idle connections made 200 threads that stayed. Here at most ``max_connections``
are served at once (one more is closed at once, unread) and a connection that sends
nothing for ``read_timeout`` seconds is closed.
"""

from __future__ import annotations

import errno
import http.server
import logging
import socketserver
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, exposition

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # a scraper needs one; a few more for people with curl
READ_TIMEOUT_S = 10.0
# An accept that fails for want of descriptors, buffers or memory is waited out this long:
# socketserver drops the error and selects again at once, and the connection still
# waiting keeps the listener readable, so without a pause its thread spins a core.
ACCEPT_RETRY_S = 0.1
_PASSING = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_LOG_EVERY_S = 10.0


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
  daemon_threads = True  # each ends within its read timeout once its client is quiet
  block_on_close = False
  # socketserver's default backlog of 5 keeps a flood's connections in SYN retries (1 s,
  # then 3 s...): a scraper behind them waits seconds. Accepted, those past the cap are
  # closed at once.
  request_queue_size = 128

  def __init__(self, address: tuple[Any, ...], handler: type, *, max_connections: int):
    self.slots = threading.BoundedSemaphore(max_connections)
    self.refused = 0
    self._logged = -_LOG_EVERY_S  # time.monotonic() of the last passing accept error logged
    super().__init__(address, handler)

  def get_request(self) -> tuple[Any, Any]:
    try:
      return super().get_request()
    except OSError as e:
      if e.errno in _PASSING:
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY_S:
          self._logged = now
          log.warning("/metrics cannot accept a connection (%s); waiting %.3g s between "
                      "tries while it lasts", e, ACCEPT_RETRY_S)
        time.sleep(ACCEPT_RETRY_S)
      raise  # socketserver drops it and selects again

  def process_request(self, request: Any, client_address: Any) -> None:
    if not self.slots.acquire(blocking=False):
      self.refused += 1
      self.shutdown_request(request)  # past the cap: closed at once, nothing read
      return
    try:
      super().process_request(request, client_address)
    except BaseException:
      self.slots.release()
      raise

  def process_request_thread(self, request: Any, client_address: Any) -> None:
    try:
      super().process_request_thread(request, client_address)
    finally:
      self.slots.release()


def serve(registry: CollectorRegistry, addr: str, port: int, *,
          max_connections: int | None = None, read_timeout: float | None = None
          ) -> tuple[_Server, threading.Thread]:
  """Serves ``registry`` on ``addr:port``; returns the server and its thread (the owner
  calls ``shutdown()``, ``server_close()`` and joins it). The bounds default to
  ``MAX_CONNECTIONS`` and ``READ_TIMEOUT_S``, read when it starts.

  Raises:
    OSError: the address cannot be bound.
  """
  base: Any = exposition.MetricsHandler.factory(registry)
  read_timeout = READ_TIMEOUT_S if read_timeout is None else read_timeout

  class Handler(base):
    timeout = read_timeout  # socket timeout of every read: an idle client is let go

    def log_message(self, format: str, *args: Any) -> None:
      pass  # one line per scrape would flood the sidecar's log

  family, host = exposition._get_best_family(addr, port)

  class Server(_Server):
    address_family = family

  server = Server((host, port), Handler,
                  max_connections=MAX_CONNECTIONS if max_connections is None else max_connections)
  thread = threading.Thread(target=server.serve_forever, name="sidecar-metrics", daemon=True)
  thread.start()
  return server, thread

