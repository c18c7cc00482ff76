"""The gRPC service a sidecar exposes: Handshake, Call, Status.

Requests arrive as raw bytes and are parsed here, so malformed bytes get
INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL). Every failure
leaves through ``protocol.abort``, the one place exceptions become statuses.
"""

from __future__ import annotations

import inspect
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import message as pb_message

from sidecar._src import codec, errors, protocol, registry as registry_lib, shm
from sidecar._src.host.leases import Leases
from sidecar._src.host.workers import WorkerListener
from sidecar._src.protocol import pb

log = logging.getLogger(__name__)


class Service:
  """Handlers for ``sidecar.v1.Sidecar``; owns no resources, only references."""

  def __init__(self, *, registry: registry_lib.Registry, identity: pb.HostIdentity,
               arena: shm.Arena, leases: Leases, workers: WorkerListener, inline_limit: int):
    self._registry = registry
    self._identity = identity
    self._arena = arena
    self._leases = leases
    self._workers = workers
    self._inline_limit = inline_limit
    self._sessions: set[str] = set()
    self._lock = threading.Lock()
    self._started = time.monotonic()
    self._calls = 0
    # Finalizers of sidecar-side views hand their block back here, never under a lock.
    self._released: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._release_loop, name="sidecar-release", daemon=True).start()

  # ---- plumbing ----------------------------------------------------------

  def handler(self) -> grpc.GenericRpcHandler:
    def unary(fn, response_cls):
      return grpc.unary_unary_rpc_method_handler(
          self._guard(fn), request_deserializer=None,
          response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {
        "Handshake": unary(self.handshake, pb.HandshakeResponse),
        "Call": unary(self.call, pb.CallResponse),
        "Status": unary(self.status, pb.StatusResponse),
    })

  def _guard(self, fn: Callable[[bytes, grpc.ServicerContext], Any]):
    def handle(raw: bytes, context: grpc.ServicerContext):
      try:
        return fn(raw, context)
      except Exception as e:  # Every failure becomes a status; the server keeps serving.
        if isinstance(e, errors.SidecarError):
          log.info("%s: %s", fn.__name__, e)
        else:
          log.warning("%s raised %s: %s", fn.__name__, type(e).__name__, e)
        protocol.abort(context, e)
    return handle

  @staticmethod
  def _parse(cls, raw: bytes):
    try:
      return cls.FromString(raw)
    except (pb_message.DecodeError, RuntimeError) as e:
      raise errors.InvalidArgumentError(
          f"malformed {cls.__name__} ({len(raw)} bytes): {e}") from None

  def _require_session(self, context: grpc.ServicerContext) -> None:
    session = dict(context.invocation_metadata()).get(protocol.SESSION_KEY)
    with self._lock:
      known = session in self._sessions
    if not known:
      raise errors.VersionMismatchError(
          f"no handshake on this connection (session {session!r}); call Handshake first "
          "and send its session as metadata 'sidecar-session'")

  def _release_loop(self) -> None:
    while True:
      offset, generation, pin = self._released.get()
      try:
        self._leases.release(offset, generation, pin)
      except errors.StaleDescriptorError as e:
        log.error("%s", e)

  # ---- handlers ----------------------------------------------------------

  def handshake(self, raw: bytes, context: grpc.ServicerContext) -> pb.HandshakeResponse:
    request = self._parse(pb.HandshakeRequest, raw)
    ours = protocol.local_versions()
    diffs = protocol.version_differences(request.versions, ours)
    if diffs:
      raise errors.VersionMismatchError(
          f"client {request.client or '?'} and sidecar host {self._identity.host_id} differ: "
          + "; ".join(diffs) + ". Install the same versions on both sides")
    session = "c-" + secrets.token_hex(8)
    with self._lock:
      self._sessions.add(session)
    return pb.HandshakeResponse(
        versions=ours, identity=self._identity, registry=self.registry_entries(),
        registry_fingerprint=self._registry.fingerprint(), session=session,
        worker_socket=self._workers.path, arena_size=self._arena.size)

  def registry_entries(self) -> list[pb.RegistryEntry]:
    return [pb.RegistryEntry(kind=e.kind, name=e.name, code_hash=e.code_hash)
            for e in self._registry]

  def call(self, raw: bytes, context: grpc.ServicerContext) -> pb.CallResponse:
    request = self._parse(pb.CallRequest, raw)
    self._require_session(context)
    entry = self._registry.get(registry_lib.FUNCTION, request.name)
    args = codec.decode(request.args, from_arena=self._view, where="args")
    kwargs = codec.decode(request.kwargs, from_arena=self._view, where="kwargs")
    if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(
        isinstance(k, str) for k in kwargs):
      raise errors.InvalidArgumentError(
          f"args must be a tuple and kwargs a dict with str keys, got {type(args).__name__} "
          f"and {type(kwargs).__name__}")
    _bind(entry, args, kwargs)
    with self._lock:
      self._calls += 1
    result = entry.fn(*args, **kwargs)
    session = request.worker_session
    to_arena = None
    granted: list[shm.Block] = []
    if session:
      if not self._workers.has_session(session):
        raise errors.InvalidArgumentError(
            f"worker_session {session!r} is not attached to this sidecar")
      timeout = context.time_remaining()
      to_arena = lambda a: self._to_arena(a, session, timeout, granted)
    try:
      value = codec.encode(result, to_arena=to_arena, inline_limit=self._inline_limit,
                           where=f"result of {request.name!r}")
    except BaseException:
      for block in granted:
        self._leases.release(block.offset, block.generation, session)
      raise
    return pb.CallResponse(result=value)

  def _to_arena(self, a: np.ndarray, session: str, timeout: float | None,
                granted: list[shm.Block]) -> codec.ArenaRef:
    block = self._leases.alloc(a.nbytes, session, timeout=timeout)
    granted.append(block)
    dst = self._arena.view(block.offset, a.nbytes)
    np.copyto(dst, a.reshape(-1).view(np.uint8))
    return codec.ArenaRef(block.offset, a.nbytes, block.generation, a.dtype.name, a.shape)

  def _view(self, ref: codec.ArenaRef) -> np.ndarray:
    """A sidecar-side array on an arena block, pinned while any view of it lives."""
    pin = self._leases.new_pin()
    self._leases.hold(ref.offset, ref.generation, pin)
    put = self._released.put
    holder = self._arena.lease(ref.offset, ref.nbytes,
                               lambda: put((ref.offset, ref.generation, pin)))
    return codec.as_array(holder, ref)

  def status(self, raw: bytes, context: grpc.ServicerContext) -> pb.StatusResponse:
    self._parse(pb.StatusRequest, raw)
    with self._lock:
      calls = self._calls
    return pb.StatusResponse(
        identity=self._identity, versions=protocol.local_versions(),
        registry=self.registry_entries(), arena_size=self._arena.size,
        arena_used=self._leases.allocator.used_bytes,
        arena_blocks=self._leases.allocator.num_blocks,
        workers=self._workers.num_sessions(), uptime_s=time.monotonic() - self._started,
        calls=calls)


def _bind(entry: registry_lib.Entry, args: tuple, kwargs: dict) -> None:
  sig = entry.signature
  if sig is None:
    return
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise errors.InvalidArgumentError(
        f"bad arguments for {entry.kind} {entry.name!r}{sig}: {e}") from None
