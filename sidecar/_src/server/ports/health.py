"""The ``grpc.health.v1`` service: ``Check`` that never waits, ``Watch`` streams bounded.

grpcio's own servicer (``grpc_health.v1.health.HealthServicer``) sends a watcher's answer
while it holds the lock that a closing stream's callback takes on gRPC's own thread: a
``Watch`` whose connection closed as it was answered stopped the health server for good
(every later check: DEADLINE_EXCEEDED), and a status change (the sidecar stopping) hung on
any watcher that did not read. And a ``Watch`` asks no token: 64 of them held the health
port (issue 76, attack round eight). Here:

- ``Check`` reads the status under a lock held for no send, and answers at once;
- a ``Watch`` is a generator on a pool of its own (``WATCHES`` + 2 threads, never those of
  ``Check`` or of the sidecar's calls): its thread sends, holding no lock; a status
  change only wakes it. At most ``WATCHES`` are watched at once; one more is refused at
  once (RESOURCE_EXHAUSTED, naming the bound).
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

SERVICE = "grpc.health.v1.Health"
# Watch streams at once, all clients together (the kubelet never watches; a tool might).
WATCHES = 16
# How often a watcher looks whether its stream was cancelled, besides being told.
_LOOK_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health:
  """The health service's state and its handlers (``handler()``); ``close()`` ends the
  watchers and joins their threads."""

  def __init__(self, watches: int = WATCHES):
    self.watches = watches
    self._cv = threading.Condition()
    self._status: dict[str, int] = {"": SERVING}
    self._final = False  # shutting down: the status changes no more
    self._closed = False
    self._watching = 0
    self._pool = futures.ThreadPoolExecutor(watches + 2, thread_name_prefix="sidecar-health-watch")

  def handler(self) -> grpc.GenericRpcHandler:
    def watch(request, context):
      return self._watch(request, context)
    watch.experimental_thread_pool = self._pool  # type: ignore[attr-defined]  # grpcio's hook
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(
            self._check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})

  @property
  def watching(self) -> int:
    with self._cv:
      return self._watching

  def set(self, service: str, status: int) -> None:
    """Sets ``service``'s status ("": the server's); watchers are woken, never waited on."""
    with self._cv:
      if not self._final:
        self._status[service] = status
        self._cv.notify_all()

  def enter_graceful_shutdown(self) -> None:
    """Every service NOT_SERVING, for good."""
    with self._cv:
      for service in self._status:
        self._status[service] = NOT_SERVING
      self._final = True
      self._cv.notify_all()

  def close(self) -> None:
    """Ends every Watch stream and joins their threads; idempotent."""
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    self._pool.shutdown(wait=True, cancel_futures=True)

  def _check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):
    with self._cv:
      status = self._status.get(request.service)
    if status is None:
      context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r:.100}")
    return health_pb2.HealthCheckResponse(status=status)

  def _watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):
    with self._cv:
      full = self._watching >= self.watches
      if not full:
        self._watching += 1
    if full:
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this sidecar's health service has {self.watches} Watch streams open, "
                    "its limit (ports/health.WATCHES); ask Check instead, as the kubelet does")

    def wake() -> None:
      with self._cv:
        self._cv.notify_all()
    context.add_callback(wake)  # its stream ended: stop waiting
    try:
      sent = None
      while True:
        with self._cv:
          while (not self._closed and context.is_active()
                 and self._status.get(request.service, SERVICE_UNKNOWN) == sent):
            self._cv.wait(_LOOK_S)
          if self._closed or not context.is_active():
            return
          sent = self._status.get(request.service, SERVICE_UNKNOWN)
        yield health_pb2.HealthCheckResponse(status=sent)  # sent by this thread, no lock held
    finally:
      with self._cv:
        self._watching -= 1
