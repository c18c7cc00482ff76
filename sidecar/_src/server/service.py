"""The gRPC service a sidecar exposes: Handshake, Call, Stream, Status.

Requests arrive as raw bytes and are parsed here, so malformed bytes get
INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL). Every failure
leaves through ``protocol.abort``, the one place exceptions become statuses.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from sidecar._src.core import errors
from sidecar._src.server import client_ids, client_log, credentials
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.calls.calls import UnaryCalls
from sidecar._src.server.calls.credits import Credits
from sidecar._src.server.calls.stream_runner import StreamRunner
from sidecar._src.server.limits import (
  Sessions,
  Slots,
  StreamSlots,
  check_prefetch,
  connection_of,
)
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.server.workers.workers import WorkerListener
from sidecar._src.wire import codec, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
# How long the end of a Stream RPC waits for its credit reader to finish. The wait runs on
# gRPC's one event thread, which every RPC of the server needs: short, as the reader has
# been woken by then.
CREDITS_JOIN_S = 0.1


class Service:
  """Handlers for ``sidecar.v1.Sidecar``; owns no resources, only references."""

  def __init__(self, *, calls: UnaryCalls, stream_runner: StreamRunner,
               identity: pb.HostIdentity, arena_size: int,
               leases: Leases, workers: WorkerListener,
               checkpoints: Callable[[], list[pb.CheckpointStatus]] = list,
               sessions: Sessions | None = None, streams: Slots | None = None,
               replica_token: str | None = None,
               tokens: tenants_lib.Tokens | None = None,
               tenancy: tenants_lib.Tenancy | None = None,
               opened: Callable[[str], set[str]] | None = None,
               checkpoint_use: Callable[[], Mapping[str, tuple[int, int]]] = dict,
               max_request: int = codec.MAX_DECODED_BYTES,
               tickets: client_ids.Tickets | None = None,
               fetched: client_ids.Fetched | None = None):
    self._tickets = tickets  # a unix: socket's clients, by process
    self._fetched = fetched  # or by the ticket a handshake's answer told them
    self._unary = calls
    self._max_request = max_request  # the largest call in parts: max_message_size
    self._runner = calls.runner
    # The tokens ({b"Bearer <token>": tenant}); named: per-client tokens or a pool file.
    self._tokens = tokens or tenants_lib.Tokens({}, named=False)
    self._tenancy = tenancy or tenants_lib.Tenancy(None)
    self._opened = opened  # the checkpoint directories a client opened
    # Per tenant: its saves in progress, and the bytes of its RAM-tier copies.
    self._checkpoint_use = checkpoint_use
    # What another sidecar's handshake carries (REPLICA_KEY); None: no session is another sidecar's.
    self._replica_bearer = None if replica_token is None else f"Bearer {replica_token}".encode()
    self._stream_runner = stream_runner
    self._identity = identity
    self._arena_size = arena_size
    self._leases = leases
    self._workers = workers
    self._checkpoints = checkpoints
    self._sessions = Sessions(idle_s=86400.0, limit=4096) if sessions is None else sessions
    self._streams = StreamSlots(total=16, per_session=8) if streams is None else streams
    self._lock = threading.Lock()
    self._started = time.monotonic()

  def uptime_s(self) -> float:
    return time.monotonic() - self._started

  def handler(self) -> grpc.GenericRpcHandler:
    def unary(fn, response_cls):
      return grpc.unary_unary_rpc_method_handler(
          self._guard(fn), request_deserializer=None,
          response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {
        "Handshake": unary(self.handshake, pb.HandshakeResponse),
        # Call answers bytes made by UnaryCalls.run_serialized: a result's large arrays
        # are copied once, into them (gRPC sends bytes as they are).
        "Call": grpc.unary_unary_rpc_method_handler(
            self._guard(self.call), request_deserializer=None, response_serializer=None),
        "CallParts": grpc.stream_stream_rpc_method_handler(
            self._guard_stream(self.call_in_pieces), request_deserializer=None,
            response_serializer=None),
        "Stream": grpc.stream_stream_rpc_method_handler(
            self._guard_stream(self.stream), request_deserializer=None,
            response_serializer=pb.StreamItem.SerializeToString),
        "Status": unary(self.status, pb.StatusResponse),
        "Leave": unary(self.leave, pb.LeaveResponse),
        "Stalled": unary(self.stalled, pb.StalledResponse),
    })

  def _log(self, e: Exception, what: str, context: grpc.ServicerContext) -> None:
    """Our errors at INFO (the caller gets them; a pipeline's RemoteError was logged at
    ERROR, with its traceback, where it was raised: ``stream_runner``), anything else
    (user code's in a call, or a fault of ours) at ERROR with its traceback; within its
    client's share of the log (``client_log``)."""
    session = dict(context.invocation_metadata() or ()).get(protocol.SESSION_KEY)
    who = client_log.client_of(self._sessions.client(session), session, context.peer())
    said = client_log.DEFAULT
    if isinstance(e, errors.RemoteError):
      said.info(log, who, "%s: %s: %s", what, e.remote_type, protocol.for_log(e.remote_message))
    elif isinstance(e, errors.SidecarError):
      said.info(log, who, "%s: %s: %s", what, type(e).__name__, protocol.for_log(e))
    else:
      said.log(log, logging.ERROR, who, "%s raised %s: %s", what, type(e).__name__,
               protocol.for_log(e), exc_info=e)

  def _guard(self, fn: Callable[[Any, grpc.ServicerContext], Any]):
    def handle(raw: bytes, context: grpc.ServicerContext):
      try:
        return fn(raw, context)
      except Exception as e:  # Every failure becomes a status; the server keeps serving.
        self._log(e, fn.__name__, context)
        protocol.abort(context, e)
    return handle

  def _guard_stream(self, fn):
    def handle(requests, context: grpc.ServicerContext):
      try:
        yield from fn(requests, context)
      except Exception as e:  # As _guard, for a streaming handler.
        self._log(e, fn.__name__, context)
        protocol.abort(context, e)
    return handle

  def _require_session(self, context: grpc.ServicerContext) -> str:
    session = dict(context.invocation_metadata()).get(protocol.SESSION_KEY)
    self._sessions.use(session)  # SessionLostError if unknown or expired
    return str(session)

  def handshake(self, raw: bytes, context: grpc.ServicerContext) -> pb.HandshakeResponse:
    request = codec.parse(pb.HandshakeRequest, raw)
    ours = protocol.local_versions()
    diffs = protocol.version_differences(request.versions, ours)
    if diffs:
      raise errors.VersionMismatchError(
          f"client {request.client or '?'} and sidecar host {self._identity.host_id} differ: "
          + "; ".join(diffs) + ". Install the same versions on both sides")
    client = self._client(context)
    if client is None and self._tokens.named:  # no token: a certificate no tenant names
      raise errors.AuthenticationError(self._no_tenant(context))
    holder, ticket = self._holder(context, client, asks=request.ticket)
    session = self._sessions.new(replica_link=self._is_replica_link(context), client=client,
                                 holder=holder)
    return pb.HandshakeResponse(tenant=client or "", ticket=ticket,
        versions=ours, identity=self._identity, registry=self.registry_entries(),
        registry_fingerprint=self._runner.registry.fingerprint(), session=session,
        worker_socket=self._workers.path, arena_size=self._arena_size)

  def _holder(self, context: grpc.ServicerContext, client: str | None, *,
              asks: bool) -> tuple[str | None, str]:
    """Who holds a new session, and the fetched ticket to tell its client ("": none).

    Its TCP connection; or over a ``unix:`` socket the process its pid ticket names, else
    the fetched ticket it presents, else a new one if it ``asks`` (``client_ids``; none:
    every Unix client without one together), of tenant ``client`` (its token's): one
    tenant's flood, ticketless or with a ticket it copied, evicts only its own sessions
    (``client_ids.held_by``).

    Raises:
      ResourceExhaustedError: it asks for a ticket past its tenant's bound.
    """
    remote = context.peer()  # gRPC's name
    if connection_of(remote) is not None or not remote.startswith("unix"):
      return connection_of(remote), ""
    metadata = dict(context.invocation_metadata())
    ticketed = client_ids.ANONYMOUS if self._tickets is None else self._tickets.holder(
        metadata.get(protocol.PID_TICKET_KEY))
    ticket = ""
    if ticketed == client_ids.ANONYMOUS and self._fetched is not None:
      presented = metadata.get(protocol.TICKET_KEY)
      held = self._fetched.holder(presented, client)
      if held is not None:
        ticketed, ticket = held, str(presented)
      elif asks:
        ticket, ticketed = self._fetched.issue(client)
    return client_ids.held_by(ticketed, client), ticket

  def _client(self, context: grpc.ServicerContext) -> str | None:
    """The client whose token the call carries (per-client tokens), else None."""
    if not self._tokens.named:
      return None
    client = credentials.client_of(self._tokens.table, context.invocation_metadata())
    if client is None and self._tokens.tls:
      for name in _certificate_names(context):
        if name in self._tokens.tls:
          return self._tokens.tls[name]
    return client

  def _no_tenant(self, context: grpc.ServicerContext) -> str:
    names = _certificate_names(context)
    why = next((self._tokens.revoked_tls[n] for n in names if n in self._tokens.revoked_tls),
               None)
    if why is not None:
      return f"{why}; its certificate no longer works on this sidecar: ask the pool's operator"
    return (f"this sidecar serves a pool of tenants, and the client certificate "
            f"({', '.join(names) or 'no name'}) is no tenant's: name it in a tenant's "
            "tls_names in the pool file, or pass that tenant's token")

  def _is_replica_link(self, context: grpc.ServicerContext) -> bool:
    """Whether the handshake carries the peer token (compared in constant time)."""
    given = dict(context.invocation_metadata()).get(protocol.REPLICA_KEY)
    if self._replica_bearer is None or given is None:
      return False
    given = given.encode(errors="replace") if isinstance(given, str) else bytes(given)
    return hmac.compare_digest(given, self._replica_bearer)

  def registry_entries(self) -> list[pb.RegistryEntry]:
    return [pb.RegistryEntry(kind=e.kind, name=e.name, code_hash=e.code_hash)
            for e in self._runner.registry]

  def call(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
    """A serialized CallResponse (``UnaryCalls.run_serialized``: no copy of a result's
    large arrays beyond the one into these bytes)."""
    session = self._require_session(context)
    self._no_replica_link(session, "Call")
    with tenants_lib.acting_as(self._sessions.client(session)):
      return self._unary.run_serialized(raw, session, alive=context.is_active,
                                        time_left=context.time_remaining)

  def call_in_pieces(self, requests: Iterator[bytes], context: grpc.ServicerContext
                     ) -> Iterator[bytes]:
    """:meth:`call` for a large CallRequest in pieces (``CallPart``s, the first one
    announcing its size): they are copied into one buffer as they come, and the
    serialized CallResponse goes back in pieces (``UnaryCalls.run_in_pieces``)."""
    session = self._require_session(context)
    self._no_replica_link(session, "CallParts")
    first = next(requests, None)
    if first is None:
      raise errors.InvalidArgumentError("CallParts: no CallPart came")
    total = codec.parse(pb.CallPart, first).total
    with tenants_lib.acting_as(self._sessions.client(session)):
      yield from self._unary.run_in_pieces(
          total, itertools.chain((first,), requests), session, alive=context.is_active,
          time_left=context.time_remaining, limit=self._max_request)

  def _no_replica_link(self, session: str, what: str) -> None:
    """PermissionDeniedError for a session of the pool's peer token (client ""), the
    sidecars' own, for their replicas only, or of its operator token (``OPERATOR``), which
    reads Status and drops RAM-tier copies: neither is a tenant nor has quotas to run by."""
    client = self._sessions.client(session)
    if self._tokens.named and client == "":
      raise errors.PermissionDeniedError(
          f"{what}: the peer token is the sidecars' own, for their replicas only; it is no "
          "tenant of this sidecar's pool: present a tenant's token")
    if client == tenants_lib.OPERATOR:
      raise errors.PermissionDeniedError(tenants_lib.operator_denied(what))

  def stream(self, requests: Iterator[bytes], context: grpc.ServicerContext
             ) -> Iterator[pb.StreamItem]:
    # The slot before the first message: a stream that never sends one holds a thread too.
    session = self._require_session(context)
    self._no_replica_link(session, "Stream")
    with self._streams.hold(session):  # RESOURCE_EXHAUSTED when full
      first = codec.parse(pb.StreamRequest, next(requests, b""))
      if first.WhichOneof("kind") != "start":
        raise errors.InvalidArgumentError("the first StreamRequest must carry `start`")
      yield from self._stream(first, requests, context, self._sessions.client(session))

  def _stream(self, first: pb.StreamRequest, requests: Iterator[bytes],
              context: grpc.ServicerContext, tenant: str | None) -> Iterator[pb.StreamItem]:
    credits = Credits(check_prefetch(first.prefetch))
    # A Worker's feed over gRPC (a TCP transport) is its session's step signal too.
    worker = first.start.worker_session
    steps = self._workers.steps
    reader = threading.Thread(target=_read_credits, daemon=True, name="sidecar-credits",
                              args=(requests, credits, lambda n: steps.step(worker, taken=n)))
    reader.start()
    # gRPC ends the requests only once the RPC is over, after this handler returned (a
    # consumer half-closes when it saw the end): the RPC's end joins the reader.
    if not context.add_callback(lambda: _join_credits(reader)):
      _join_credits(reader)  # already over: nobody to run the stream for
      return
    revoked = self._tenancy.revoked
    alive = ((lambda: context.is_active() and tenant not in revoked) if tenant is not None
             else context.is_active)
    yield from self._stream_runner.run(first.start, credits, alive=alive,
                                       time_left=context.time_remaining, tenant=tenant)

  def leave(self, raw: bytes, context: grpc.ServicerContext) -> pb.LeaveResponse:
    """Ends the caller's handshake session, if its token's tenant owns it (a session of
    another tenant, or none, is left as it is)."""
    codec.parse(pb.LeaveRequest, raw)
    session = dict(context.invocation_metadata()).get(protocol.SESSION_KEY)
    if self._sessions.client(session) == self._client(context):
      self._sessions.end(session)
    return pb.LeaveResponse()

  def stalled(self, raw: bytes, context: grpc.ServicerContext) -> pb.StalledResponse:
    """``sidecar launch`` killed a stalled trainer: the ledgers of its start's sessions
    here, of the caller's tenant (every tenant's for no tenants or the pool's operator),
    are marked (``Workers.stalled``). A report marks only a life of the caller's own
    tenant, and counts only where that life then dies without another step."""
    request = codec.parse(pb.StalledRequest, raw)
    client = self._client(context)
    if client is None and self._tokens.named:  # a certificate no tenant names
      raise errors.AuthenticationError(self._no_tenant(context))
    since = request.since_step_s
    if not math.isfinite(since) or since < 0:  # one older than a session: from its attach
      raise errors.InvalidArgumentError(
          f"Stalled: since_step_s must be finite seconds >= 0, got {since!r}")
    every = client is None or client == tenants_lib.OPERATOR
    marked = self._workers.stalled(restart=request.restart, since_step_s=since,
                                   tenant=client, every=every)
    log.info("Stalled: rank %d of start %d stalled %.1f s ago and was killed; %d goodput "
             "ledgers marked", request.rank, request.restart, since, marked)
    return pb.StalledResponse(marked=marked)

  def status(self, raw: bytes, context: grpc.ServicerContext) -> pb.StatusResponse:
    codec.parse(pb.StatusRequest, raw)
    client = self._client(context)
    # Needs no session; one sent along is kept alive (a controller's health watch polls).
    self._sessions.touch(dict(context.invocation_metadata()).get(protocol.SESSION_KEY))
    hidden = client is None and self._tokens.named  # a certificate no tenant names
    operator = client == tenants_lib.OPERATOR
    if operator:  # the pool's operator sees everything: every tenant's feeds, directories, rows
      client = None
    return pb.StatusResponse(
        identity=self._identity, versions=protocol.local_versions(),
        registry=self.registry_entries(), arena_size=self._arena_size,
        arena_used=self._leases.allocator.used_bytes,
        arena_kept=self._stream_runner.kept_bytes(),
        arena_blocks=self._leases.allocator.num_blocks,
        workers=self._workers.num_sessions(), uptime_s=time.monotonic() - self._started,
        calls=self._runner.calls, feeds=[] if hidden else self._stream_runner.feeds(client),
        checkpoints=[] if hidden else self._visible_checkpoints(client),
        tenants=self._tenant_status(client, operator=operator),
        trainers=[] if hidden else self._trainer_status(client), tenant=client or "")

  def _trainer_status(self, client: str | None) -> list[pb.TrainerStatus]:
    """Each trainer's step progress (``server/goodput/steps.py``): every one's, or with per-client
    tokens or a pool, those of the caller's tenant only. A record that cannot be encoded
    is left out, and logged: it never fails the Status of every client (issue 69)."""
    listed = []
    for t in self._workers.steps.trainers(client, every=client is None):
      try:
        listed.append(pb.TrainerStatus(
            pid=t.pid, pid_verified=t.pid > 0, rank=t.rank, restart=t.restart, steps=t.steps,
            since_step_s=-1.0 if t.since_step_s is None else t.since_step_s,
            slowest_step_s=t.slowest_s, stall_timeout_s=t.timeout_s, stalled=t.stalled,
            ended=t.ended, tenant=t.tenant or "", phase=t.phase or "", phase_s=t.phase_s,
            last_step_unix=t.last_step_unix or 0.0,
            cpu_s=-1.0 if t.cpu_s is None else t.cpu_s))
      except (ValueError, TypeError) as e:
        log.error("Status: trainer record %r left out: it cannot be encoded (%s)", t, e)
    return listed

  def _tenant_status(self, client: str | None, *, operator: bool) -> list[pb.TenantStatus]:
    """The caller's own tenant's row (with a pool file), every tenant's for the pool's
    operator token; none for a caller of no tenant, the pool's peer token included
    (client ""): it is the sidecars' own, no tenant's, and sees no tenant's use."""
    if client:
      return self.tenant_status(client)
    return self.tenant_status() if operator else []

  def tenant_status(self, client: str | None = None) -> list[pb.TenantStatus]:
    """Each tenant's use now (with a pool file), or ``client``'s only: what Status and
    the metrics report."""
    pool = self._tenancy.pool
    if pool is None or not pool.quotas:
      return []
    size = self._arena_size
    held = self._leases.tenant_bytes()
    sessions = self._sessions.count_of()
    feeds = self._tenancy.feed_counts()
    waiting = self._leases.waiting()
    batches = self._stream_runner.tenant_batches()
    use = self._checkpoint_use()
    out = []
    for t in pool.tenants:
      if client is not None and t.name != client:
        continue
      n_feeds, n_workers = feeds.get(t.name, (0, 0))
      out.append(pb.TenantStatus(
          name=t.name, sessions=sessions.get(t.name, 0),
          workers=len(self._tenancy.workers_of(t.name)), arena_bytes=held.get(t.name, 0),
          arena_guaranteed=t.arena.bytes_of(size),
          arena_ceiling=size if t.arena_ceiling is None else t.arena_ceiling.bytes_of(size),
          feeds=n_feeds, feed_workers=n_workers, weight=t.weight,
          waiting=waiting.get(t.name, 0), batches=batches.get(t.name, 0),
          saves=use.get(t.name, (0, 0))[0], ram_tier_bytes=use.get(t.name, (0, 0))[1],
          ram_tier_quota=0 if t.ram_tier is None else t.ram_tier.bytes_of(size)))
    return out

  def _visible_checkpoints(self, client: str | None) -> list[pb.CheckpointStatus]:
    """Every checkpoint directory; with per-client tokens, those the caller opened only
    (the pool's operator, client None here, sees every one)."""
    if client is None or self._opened is None:
      return self._checkpoints()
    mine = self._opened(client)
    return [c for c in self._checkpoints() if os.path.realpath(c.directory) in mine]


def _certificate_names(context: grpc.ServicerContext) -> list[str]:
  """The common and DNS names of the caller's client certificate (mTLS), verified by the
  TLS layer against --tls-client-ca; none without one."""
  auth: Any = context.auth_context() or {}
  return [n.decode(errors="replace") if isinstance(n, bytes) else str(n)
          for key in ("x509_common_name", "x509_subject_alternative_name")
          for n in auth.get(key) or ()]


def _read_credits(requests: Iterator[bytes], credits: Credits,
                  on_taken: Callable[[int], None] = lambda n: None) -> None:
  """Grants what a stream's consumer credits, until it half-closes or goes away;
  ``on_taken(n)``: its trainer took n items (the step signal, ``server/goodput/steps.py``)."""
  try:
    for raw in requests:
      message = codec.parse(pb.StreamRequest, raw)
      credits.grant(message.credit, message.wait_s, message.saved_state_json)
      if message.credit:
        on_taken(message.credit)
  except Exception:
    credits.close()  # The consumer went away (or sent garbage).
  else:
    credits.finish()  # Half-closed: what it credited is still sent.


def _join_credits(reader: threading.Thread) -> None:
  # Runs on gRPC's thread once the RPC is over, when its requests have just ended: the
  # join is short, and bounded all the same.
  reader.join(CREDITS_JOIN_S)
  if reader.is_alive():
    log.warning("a stream's credit reader did not end within %.3g s of its RPC",
                CREDITS_JOIN_S)
