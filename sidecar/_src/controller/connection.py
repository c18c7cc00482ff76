"""One controller-side connection to one sidecar: channel, handshake, metadata."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from sidecar._src.core import (
  address as address_lib,
  env as env_lib,
  errors,
  interrupts,
  options as options_lib,
)
from sidecar._src.wire import ipc, protocol
from sidecar._src.wire.protocol import pb

# The largest message a controller sends or takes; a response in parts too (CallParts).
MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
)


def channel_options(silence_timeout: float) -> tuple[tuple[str, int], ...]:
  """CHANNEL_OPTIONS, with HTTP/2 pings that find a hung or stopped sidecar within about
  ``silence_timeout`` seconds, also while a stream waits on a slow pipeline.

  A ping goes out after half the peer timeout without one (at most every 10 s) and must
  be answered within the other half; a stopped process answers none, so its streams and
  calls end with UNAVAILABLE ("ping timeout"): HostLostError. gRPC's own ping timeout
  (``grpc.http2.ping_timeout_ms``, 60 s by default) is what bounds it, not
  ``keepalive_timeout_ms``; the sidecar accepts pings this often
  (``host.server.KEEPALIVE_OPTIONS``).
  """
  half = max(int(silence_timeout * 500), 1)
  return CHANNEL_OPTIONS + (
      ("grpc.keepalive_time_ms", min(half, 10_000)),
      ("grpc.keepalive_timeout_ms", half),
      ("grpc.http2.ping_timeout_ms", half),
      ("grpc.http2.max_pings_without_data", 0),  # keep asking while a stream is quiet
  )


# A sidecar runs at most half its RPC threads' worth of one session's unary calls and
# refuses the rest (server/limits.CallSlots: 16 of the default 32). A controller keeps this
# many of its calls in flight per host and queues the others itself, so many
# ``call_async`` at once wait their turn instead of coming back RESOURCE_EXHAUSTED.
CALLS_IN_FLIGHT = 8
# The same for the Checkpoint service's rpcs (server/limits.CheckpointSlots: 8 per session).
CHECKPOINT_CALLS_IN_FLIGHT = 8
# A closing Controller waits this long at most for its sidecars to end its sessions.
LEAVE_S = 0.5
# How long close() waits for gRPC to close a channel. gRPC's close waits for every call on
# the channel to end after cancelling it; a call whose Python state a Ctrl-C broke (raised
# inside gRPC's own locks) never ends, and the close would wait forever (seen once in CI:
# a demo interrupted mid-save hung in Channel.close). Past this the close goes on in a
# daemon thread and the process's exit ends it.
CLOSE_S = 5.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Queued:
  send: Callable[[float], grpc.Future]
  done: Callable[[grpc.Future], None]
  fail: Callable[[BaseException], None]
  deadline: float
  timeout: float
  what: str


_T = TypeVar("_T")


class CallWindow:
  """At most ``size`` calls in flight on one connection; the others wait their turn.

  ``call(...)`` for a call sent as a future: ``send(seconds_left)`` sends it once the
  window has room; ``done(rpc)`` runs when it ends (after its slot is free again);
  ``fail(error)`` instead where it was never sent: its deadline passed in the queue
  (DeadlineExceededError), the window closed (ClosedError), or ``send`` raised.
  ``enter(timeout)`` / ``exit()`` around a call a thread makes itself, blocking
  (``blocking(call, ...)`` makes one between them).
  A thread of the window's own fails queued calls at their deadlines; ``close()``
  fails the rest and joins it.
  """

  def __init__(self, size: int = CALLS_IN_FLIGHT, *, name: str = "sidecar"):
    self._size, self._name = size, name
    self._cv = threading.Condition()
    self._running = 0
    # Waiting calls: a _Queued, or the Event of a thread blocked in enter().
    self._waiting: collections.deque[_Queued | threading.Event] = collections.deque()
    self.closed = False
    self._expirer: threading.Thread | None = None

  def call(self, send: Callable[[float], grpc.Future], *, done: Callable[[grpc.Future], None],
           fail: Callable[[BaseException], None], timeout: float, what: str) -> None:
    entry = _Queued(send, done, fail, time.monotonic() + timeout, timeout, what)
    with self._cv:
      closed = self.closed
      if not closed and self._running >= self._size:
        self._waiting.append(entry)
        if self._expirer is None:
          self._expirer = threading.Thread(target=self._expire, daemon=True,
                                           name=f"sidecar-calls-{self._name}")
          self._expirer.start()
        self._cv.notify()
        return
      if not closed:
        self._running += 1
    if closed:
      fail(self._closed_error(entry))
    else:
      self._run(entry)

  def enter(self, timeout: float) -> bool:
    """Takes a slot, waiting at most ``timeout`` s (Ctrl-C ends the wait); False if none
    came in time. Raises ClosedError once the window is closed."""
    with self._cv:
      if self.closed:
        raise errors.ClosedError(f"the connection to {self._name} is closed")
      if self._running < self._size:
        self._running += 1
        return True
      ready = threading.Event()
      self._waiting.append(ready)
    handed = False
    try:  # a Ctrl-C held off by interrupts.deferring ends the wait
      handed = interrupts.wait_event(ready, max(timeout, 0.0))
    finally:
      if not handed:  # timed out or interrupted: leave the line, or give back what came
        with self._cv:
          came = ready not in self._waiting
          if not came:
            self._waiting.remove(ready)
        if came:
          self.exit()
    return handed

  def exit(self) -> None:
    """Gives back the slot of a call made after ``enter``."""
    self._run(self._next())

  def blocking(self, call: Callable[[float], _T], *, timeout: float, what: str) -> _T:
    """``call(seconds_left)``'s result, made on this thread in a slot of the window (a
    call whose caller waits for it at once: no thread of gRPC's to wait for the answer).
    Raises what ``call`` raises; DeadlineExceededError where no slot came in ``timeout``;
    ClosedError where the window is, or closed meanwhile (gRPC's "Channel closed!")."""
    deadline = time.monotonic() + timeout
    if not self.enter(timeout):
      raise self.waited_too_long(what, timeout)
    try:
      return call(max(deadline - time.monotonic(), 0.0))
    except ValueError:
      if self.closed:  # gRPC: "Channel closed!"
        raise errors.ClosedError(f"{what} was not sent: the connection to {self._name} "
                                 "closed") from None
      raise
    finally:
      self.exit()

  def close(self) -> None:
    """Fails every queued call (ClosedError) and stops the expiring thread; idempotent."""
    with self._cv:
      self.closed = True
      queued = [e for e in self._waiting if isinstance(e, _Queued)]
      self._waiting = collections.deque(e for e in self._waiting if not isinstance(e, _Queued))
      self._cv.notify_all()
      expirer = self._expirer
    for e in queued:
      e.fail(self._closed_error(e))
    if expirer is not None and expirer is not threading.current_thread():
      expirer.join(5)

  def waited_too_long(self, what: str, timeout: float) -> errors.DeadlineExceededError:
    """The error of a call whose whole timeout passed while it waited for a slot."""
    return errors.DeadlineExceededError(
        f"{what} waited {timeout:.3g} s (its timeout) behind this controller's other calls "
        f"to {self._name} ({self._size} run at once); raise the timeout, or make fewer calls "
        "at once")

  def _closed_error(self, e: _Queued) -> errors.ClosedError:
    return errors.ClosedError(f"{e.what} was not sent: the connection to {self._name} closed")

  def _run(self, entry: _Queued | None) -> None:
    while entry is not None:
      left = entry.deadline - time.monotonic()
      try:
        if left <= 0:
          raise self.waited_too_long(entry.what, entry.timeout)
        rpc = entry.send(left)
      except Exception as e:
        if isinstance(e, ValueError) and self.closed:  # gRPC: "Channel closed!"
          e = self._closed_error(entry)
        entry.fail(e)
        entry = self._next()
        continue
      rpc.add_done_callback(functools.partial(self._ended, entry.done))
      return

  def _ended(self, done: Callable[[grpc.Future], None], rpc: grpc.Future) -> None:
    self.exit()  # the slot first: ``done`` may run the caller's callbacks, or wait
    done(rpc)

  def _next(self) -> _Queued | None:
    """The next waiting call, given the slot of one that ended; else the slot is freed."""
    with self._cv:
      if not self._waiting:
        self._running -= 1
        return None
      item = self._waiting.popleft()
    if isinstance(item, threading.Event):
      item.set()  # a blocked thread has the slot now
      return None
    return item

  def _expire(self) -> None:
    """Fails queued calls whose deadline passed while they waited."""
    while True:
      with self._cv:
        if self.closed:
          return
        now = time.monotonic()
        expired = [e for e in self._waiting if isinstance(e, _Queued) and e.deadline <= now]
        for e in expired:
          self._waiting.remove(e)
        if not expired:
          deadlines = [e.deadline for e in self._waiting if isinstance(e, _Queued)]
          self._cv.wait(min(deadlines) - now if deadlines else None)
          continue
      for e in expired:
        e.fail(self.waited_too_long(e.what, e.timeout))


_TLS_HINT = ("TLS on both sides or neither: a sidecar with --tls-cert needs tls_ca=... here, "
             "or SIDECAR_TLS_CA")


# Words of gRPC's reason for a connection that failed in its TLS handshake.
_TLS_WORDS = ("tls", "ssl", "certificate", "handshake")


def _connect_error(e: grpc.RpcError, address: str, timeout: float, *,
                   tls: bool) -> errors.SidecarError:
  """The error of a handshake that failed: the connection is the handshake's first step.

  The handshake is sent without ``wait_for_ready``, so a connection that cannot be made
  (refused, unresolvable name, reset) fails it at once, with gRPC's reason and the
  address it resolved; a sidecar that accepts and does not answer (stopped, or not a
  sidecar) takes the whole ``timeout``.
  """
  code = e.code() if hasattr(e, "code") else None
  reason = (e.details() or "") if code is not None else ""
  closed = "socket closed" in reason.lower()
  if code == grpc.StatusCode.UNAVAILABLE and tls and (
      closed or any(w in reason.lower() for w in _TLS_WORDS)):
    # an unknown CA, an expired certificate, a sidecar that wants a client certificate
    return errors.HostLostError(
        f"sidecar {address} refused the TLS connection: {reason}"
        + ("; it closed the handshake: does it want a client certificate (mTLS: tls_cert="
           "/tls_key=, or SIDECAR_TLS_CLIENT_CERT/_KEY), or not speak TLS at all?"
           if closed else ""))
  if code == grpc.StatusCode.UNAVAILABLE and address_lib.is_unix(address):
    return errors.HostLostError(
        f"cannot reach sidecar {address}: {e.details()}; is `sidecar serve --listen "
        f"{address}` running? (The worker socket, --socket, is not its gRPC address.)")
  if code == grpc.StatusCode.UNAVAILABLE and address_lib.looks_like_path(address):
    return errors.HostLostError(
        f"cannot reach sidecar {address}: {e.details()}; it looks like a path: a sidecar on "
        f"a Unix socket is unix:{address}")
  if code == grpc.StatusCode.UNAVAILABLE:
    return errors.HostLostError(
        f"cannot reach sidecar {address}: {e.details()}; is `sidecar serve` running there "
        f"and the port reachable ({_TLS_HINT})?")
  if code == grpc.StatusCode.DEADLINE_EXCEEDED:
    return errors.HostLostError(
        f"sidecar {address} did not answer within {timeout:.3g} s; is `sidecar serve` "
        f"running there, not stopped ({_TLS_HINT})?")
  return not_a_sidecar(e, address) or protocol.error_from_rpc(e, host=address)


def not_a_sidecar(e: grpc.RpcError, address: str) -> errors.InvalidArgumentError | None:
  """The error of an RPC that ``address`` does not serve (UNIMPLEMENTED): a gRPC server
  without the sidecar's service, most likely a sidecar's health port; else None."""
  if not hasattr(e, "code") or e.code() != grpc.StatusCode.UNIMPLEMENTED:
    return None
  return errors.InvalidArgumentError(
      f"{address} answers gRPC but serves no sidecar control service ({e.details()}): it "
      "looks like a sidecar's health port; give its control port instead (sidecar serve "
      f"--port, default {options_lib.DEFAULT_PORT}; the health port, --health-port, "
      f"default {options_lib.DEFAULT_HEALTH_PORT}, only answers probes)")


def open_channel(address: str, *, timeout: float, options: tuple[tuple[str, int], ...],
                 credentials: grpc.ChannelCredentials | None = None
                 ) -> tuple[grpc.Channel, ipc.Pinned | None]:
  """A channel to the sidecar at ``address``; for ``unix:PATH`` also the socket it is
  pinned to (close it after the channel), once the user serving it is one this process
  trusts (``ipc.check_server``): every (re)connect of the channel then goes to that very
  socket, whatever takes its name later, so no token ever goes to an impostor.

  Raises:
    PermissionDeniedError: this process may not open the socket, or another user's
      process serves it (naming its uid, user name and pid).
    HostLostError: nothing serves at ``PATH``.
  """
  if address_lib.is_unix(address):  # a bad path, or no permission: said now, not a timeout
    address_lib.check_access(address)
  pin, address, options = ipc.pin_channel(address, options, timeout=timeout, unreachable=(
      lambda e: errors.HostLostError(
          f"cannot reach sidecar {address}: {e.strerror or e}; is `sidecar serve --listen "
          f"{address}` running? (The worker socket, --socket, is not its gRPC address.)")))
  return (grpc.insecure_channel(address, options=options) if credentials is None
          else grpc.secure_channel(address, credentials, options=options)), pin


@dataclasses.dataclass(frozen=True, slots=True)
class HostInfo:
  """A sidecar's identity and what it can run, as its handshake told."""
  host_id: int
  slice_id: int
  device_ids: tuple[int, ...]
  hostname: str
  pid: int
  address: str
  functions: tuple[str, ...]
  pipelines: tuple[str, ...]
  registry_fingerprint: str
  versions: dict[str, str]


class Connection:
  """A channel to one sidecar, after a successful handshake."""

  def __init__(self, address: str, *, token: str | None, timeout: float,
               silence_timeout: float = env_lib.DEFAULT_SILENCE_TIMEOUT_S,
               credentials: grpc.ChannelCredentials | None = None):
    self.address = address
    try:  # as the sidecar refuses at start: no client could ever send it
      options_lib.check_token(token)
    except ValueError as e:
      raise errors.InvalidArgumentError("the " + str(e)
                                        ) from None
    self._channel, self._pin = open_channel(address, timeout=timeout, credentials=credentials,
                                            options=channel_options(silence_timeout))
    self._auth = ((protocol.AUTH_KEY, f"Bearer {token}"),) if token else ()
    # Over a unix: socket, this process's ticket: its sessions count against it alone.
    ticket = None if self._pin is None else ipc.fetch_ticket(self._pin, timeout=timeout)
    self._shake = self._auth + (((protocol.PID_TICKET_KEY, ticket),) if ticket else ())
    # Where the abstract socket told none (another network namespace, its name taken), a
    # ticket asked for in each handshake: its answer's, presented in the next ones.
    self._asks = self._pin is not None and ticket is None
    self._ticket = ""
    self._told_none = False  # warned once that a sidecar told no ticket
    self._handshake = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)
    self.calls = CallWindow(name=address)
    self.call_rpc = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Call", request_serializer=pb.CallRequest.SerializeToString,
        response_deserializer=pb.CallResponse.FromString)
    # A large call: serialized CallParts out, serialized CallParts of its response back.
    self.call_pieces_rpc = self._channel.stream_stream(f"/{protocol.SERVICE}/CallParts")
    self.stream_rpc = self._channel.stream_stream(
        f"/{protocol.SERVICE}/Stream", request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.StreamItem.FromString)
    self.checkpoint = protocol.ckpt_pb_grpc.CheckpointStub(self._channel)  # checkpoint_client
    self.checkpoint_calls = CallWindow(CHECKPOINT_CALLS_IN_FLIGHT, name=address)
    self.status_rpc = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Status", request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusResponse.FromString)
    self._leave = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Leave", request_serializer=pb.LeaveRequest.SerializeToString,
        response_deserializer=pb.LeaveResponse.FromString)
    self._timeout = timeout
    self._renew_lock = threading.Lock()
    self._renewed = -math.inf  # time.monotonic() of the last renew()
    try:
      reply = self._shake_hands()
    except grpc.RpcError as e:
      self.close()
      raise _connect_error(e, address, timeout, tls=credentials is not None) from None
    self.reply = reply
    self.metadata = self._auth + ((protocol.SESSION_KEY, reply.session),)
    ident = reply.identity
    self.info = HostInfo(
        host_id=ident.host_id, slice_id=ident.slice_id, device_ids=tuple(ident.device_ids),
        hostname=ident.hostname, pid=ident.pid, address=address,
        functions=tuple(e.name for e in reply.registry if e.kind == "function"),
        pipelines=tuple(e.name for e in reply.registry if e.kind == "pipeline"),
        registry_fingerprint=reply.registry_fingerprint,
        versions={"protocol": str(reply.versions.protocol), "package": reply.versions.package,
                  "python": reply.versions.python, "numpy": reply.versions.numpy,
                  "jax": reply.versions.jax})

  def _shake_hands(self) -> pb.HandshakeResponse:
    """A handshake; over a ``unix:`` socket with no pid ticket it asks for a ticket,
    presenting the one it has, and keeps the one the answer tells (a retired one is
    replaced). A sidecar that tells none is warned of: this process's sessions are then
    held with every ticketless client of its tenant."""
    metadata = self._shake + (((protocol.TICKET_KEY, self._ticket),) if self._ticket else ())
    reply = self._handshake(
        pb.HandshakeRequest(versions=protocol.local_versions(), ticket=self._asks,
                            client=f"controller pid {os.getpid()} on {socket.gethostname()}"),
        timeout=self._timeout, metadata=metadata, wait_for_ready=False)
    if self._asks and not reply.ticket and not self._told_none:
      self._told_none = True
      log.warning("sidecar %s told this process no ticket (its abstract socket could not "
                  "be reached: another network namespace, or its name taken; nor in the "
                  "handshake: an older sidecar): this Controller's sessions there are held "
                  "with every ticketless client of its tenant, and a flood of theirs can "
                  "evict them", self.address)
    self._ticket = reply.ticket
    return reply

  def renew(self) -> None:
    """Handshakes again, for a new session: the sidecar lost ours (SessionLostError).

    The calls that failed for it renew at once; one renewal serves them all (a second
    within a second of the last is skipped: the session is new already).

    Raises:
      SidecarError: the handshake failed.
    """
    with self._renew_lock:
      if time.monotonic() - self._renewed < 1.0:
        return
      try:
        reply = self._shake_hands()
      except grpc.RpcError as e:
        raise protocol.error_from_rpc(e, host=self.address) from None
      self.metadata = self._auth + ((protocol.SESSION_KEY, reply.session),)
      self._renewed = time.monotonic()

  def leave(self) -> grpc.Future:
    """Tells the sidecar our session ends (a closing Controller): its tenant has it back
    at once. Best effort: a sidecar that is gone, or predates Leave, lets it expire."""
    return self._leave.future(pb.LeaveRequest(), timeout=LEAVE_S, metadata=self.metadata,
                              wait_for_ready=False)

  def close(self) -> None:
    self.calls.close()
    self.checkpoint_calls.close()
    closer = threading.Thread(target=self._channel.close, name="sidecar-channel-close",
                              daemon=True)
    closer.start()
    closer.join(CLOSE_S)
    if closer.is_alive():  # its socket stays open too: gRPC may still use its fd
      log.warning("the channel to %s did not close within %.0f s (a call that Ctrl-C broke "
                  "inside gRPC never ends); left to this process's exit", self.address, CLOSE_S)
    elif self._pin is not None:
      self._pin.close()
