"""The Unix socket that workers attach to: arena fd out, allocate and free in.

An ``attach`` connection is one worker session. It is handed one memfd: the sidecar's
arena, or with a pool file its tenant's own (``arenas.py``): the tenant whose token it
presents (or whose ``uids`` hold its user), or, for another sidecar's link presenting the
peer token, the tenant it names. The session ends when the
connection closes, and then every block leased to it goes back to the arena: a
worker killed with SIGKILL leaks nothing. A ``stream`` connection, opened by an
attached worker, carries one stream of descriptors: the fast path for batches,
with no TCP and no HTTP/2 in the way. A ``calls`` connection carries one worker's
unary calls, one after another (the fast path for ``ctl.call``).

A worker's pid is the kernel's: the socket's peer credentials (``SO_PEERCRED``) at
attach, never the ``pid`` its attach message claims (issue 69). The claim is only
checked (an impossible pid is refused) and logged. Where the kernel gives no pid (a
trainer in another PID namespace), the session's pid is 0: unverified, listed as such in
``Status.trainers``, and never signalled (``tools/watchdog.py``).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.core import errors, stall
from sidecar._src.server import client_log, sockets
from sidecar._src.server.arenas import arenas as arenas_lib
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.calls.calls import UnaryCalls
from sidecar._src.server.calls.credits import SocketCredits
from sidecar._src.server.calls.stream_runner import StreamRunner
from sidecar._src.server.goodput import ledgers as ledgers_lib, steps as steps_lib
from sidecar._src.server.limits import check_prefetch
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.server.workers import connector, conns, session_blocks, silent
from sidecar._src.wire import codec, feed_batch, ipc, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)

# A new connection must send its first frame within this: one that says nothing would
# hold its thread (and a connection slot) for ever.
FIRST_FRAME_S = 10.0
# accept() errors that pass: out of descriptors (a flood of idle connections on another
# port), of buffers, of memory, or a client that left before it was accepted. The loop
# waits this long and accepts again; only close() ends it.
_PASSING = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                      errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})
ACCEPT_RETRY_S = 0.1
_LOG_EVERY_S = 10.0  # a passing accept error is logged at most this often
_FLAG = "--socket (socket_path)"


class WorkerListener:
  """Accepts worker connections on ``path`` and serves their requests."""

  def __init__(self, path: str, arenas: arenas_lib.Arenas, leases: Leases,
               hello: Callable[[dict[str, Any]], dict[str, Any]], streams: StreamRunner, *,
               calls: UnaryCalls | None = None, call_bytes: int = ipc.MAX_MESSAGE,
               max_connections: int = 256, on_dead: Callable[[BaseException], None] = (
                   lambda e: None), tenancy: tenants_lib.Tenancy | None = None,
               ledgers: ledgers_lib.Ledgers | None = None,
               steps: steps_lib.Steps | None = None):
    self.path = path
    self._ledgers = ledgers  # the goodput ledgers its sessions write (None: refused)
    # Each session's steps and when it was last heard from (a frame, a feed credit): the
    # stall signal, and the goodput ledger's time of a death, where the session ends only
    # once a killed process is gone.
    self.steps = steps or steps_lib.Steps()
    self._blocks = session_blocks.SessionBlocks(leases, self.steps)  # alloc and free frames
    self._replica_sessions: set[str] = set()  # other sidecars' replica links (ReplicaAttach)
    # Which tenant each worker is (the token it presents at attach), and their quotas.
    self._tenancy = tenancy or tenants_lib.Tenancy(None)
    self._calls, self._call_bytes = calls, call_bytes  # None: calls come over gRPC only
    self._on_dead = on_dead  # told if accepting fails for good (the health goes NOT_SERVING)
    self._stop = threading.Event()
    self.max_connections = max_connections
    # Open connections of any kind, each with its thread: close() ends and joins them.
    self._connections: dict[socket.socket, threading.Thread] = {}
    self._streams = streams
    self._arenas = arenas
    self._leases = leases
    self._hello = hello
    self._lock = threading.Lock()
    self._sessions: dict[str, socket.socket] = {}
    self._pids: dict[str, int] = {}  # each session's pid, the kernel's (0: unverified)
    # Sessions of revoked tenants, ended: why, for the calls and streams that still name
    # them (a tenant removed from the pool file is told so, not "unknown session").
    self._ended: dict[str, str] = {}
    self._by_tenant: dict[str, int] = {}  # connections each tenant holds (with a pool)
    self._silent = silent.Silent(max_connections)  # those yet to say their first frame
    self._closed = False
    ipc.check_socket_path(path, fix="give --socket (socket_path) a shorter path")
    self._made_dirs = sockets.make_dirs(os.path.dirname(os.path.abspath(path)),
                                        what="worker socket", flag=_FLAG)
    try:  # one left by a killed sidecar is replaced; one a live sidecar serves is refused
      sockets.claim(path, what="worker socket", flag=_FLAG)
    except OSError:
      sockets.remove_dirs(self._made_dirs)
      raise
    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      self._sock.bind(path)
    except OSError as e:
      self._sock.close()
      sockets.remove_dirs(self._made_dirs)
      raise OSError(e.errno, f"cannot make the worker socket {path} ({e.strerror}): give "
                    f"{_FLAG} a path in a writable directory") from e
    # Owner and group may attach (connecting needs write permission on the socket): on
    # Kubernetes, a pod fsGroup shared by trainer and sidecar; nobody else.
    os.chmod(path, 0o660)
    self._sock.listen(64)
    self._thread = threading.Thread(target=self._accept_loop, name="sidecar-workers", daemon=True)
    self._thread.start()

  def has_session(self, session: str) -> bool:
    with self._lock:
      return session in self._sessions

  def client_of(self, session: str) -> str:
    """Whose log lines a worker session's are (client_log.py): its tenant's, else its own."""
    tenant = self._tenancy.of_worker(session)  # "": the one shared token's, no tenant
    return f"tenant {tenant!r}" if tenant else f"worker session {session}"

  def pids(self) -> dict[str, int]:
    """The worker pid of each session attached now, as the kernel said at attach (0: it
    did not say: unverified)."""
    with self._lock:
      return {s: self._pids.get(s, 0) for s in self._sessions}

  def num_sessions(self) -> int:
    with self._lock:
      return len(self._sessions)

  def stalled(self, *, restart: int, since_step_s: float, tenant: str | None,
              every: bool) -> int:
    """``sidecar launch`` killed a stalled trainer of start ``restart``: marks the ledgers
    its sessions keep (``every`` one's or ``tenant``'s: ``Ledgers.stalled``); how many."""
    if self._ledgers is None:
      return 0
    now = time.time()
    return sum(self._ledgers.stalled(s, max(now - since_step_s, attached), now)
               for s, attached in self.steps.of_start(restart, tenant, every=every))

  @property
  def alive(self) -> bool:
    """Whether the socket still accepts workers (until close(), unless accepting broke)."""
    return self._thread.is_alive() and not self._stop.is_set()

  def _accept_loop(self) -> None:
    """Accepts until close(): an error that passes (EMFILE, ...) is logged and waited out."""
    logged = -_LOG_EVERY_S
    while not self._stop.is_set():
      try:
        conn, _ = self._sock.accept()
      except OSError as e:
        if self._stop.is_set():
          return  # closed
        if e.errno not in _PASSING:
          log.error("worker socket %s: accept failed (%s): no worker can attach any more; "
                    "restart the sidecar", self.path, e)
          self._on_dead(e)
          return
        if time.monotonic() - logged >= _LOG_EVERY_S:
          logged = time.monotonic()
          log.warning("worker socket %s: accept failed (%s); retrying every %.1f s (too many "
                      "open connections on this sidecar's ports?)", self.path, e,
                      ACCEPT_RETRY_S)
        self._stop.wait(ACCEPT_RETRY_S)
        continue
      cred = ipc.ucred_or_none(conn)  # who the kernel says connects
      # The process behind it, named by its pid and start before it can say anything.
      thread = threading.Thread(target=self._serve,
                                args=(conn, cred, connector.Connector.of(cred)),
                                name="sidecar-worker-conn", daemon=True)
      with self._lock:  # a user's silent connections give way to another's (silent.py)
        gone, full = [], True
        if not self._closed:
          gone, full = self._silent.arrive(
              conn, cred, full=len(self._connections) >= self.max_connections)
        if not full:
          self._connections[conn] = thread
      for old in gone:  # its thread ends it: its first frame never comes now
        with contextlib.suppress(OSError):
          old.shutdown(socket.SHUT_RDWR)
      if full:
        self._refuse(conn, cred)
        continue
      try:
        thread.start()
      except RuntimeError as e:  # no thread to be had: this one connection is refused
        with self._lock:
          self._connections.pop(conn, None)
        log.warning("worker socket: cannot start a thread for a connection (%s)", e)
        conn.close()

  def _refuse(self, conn: socket.socket, cred: ipc.Ucred | None) -> None:
    """Answers a connection past the limit with RESOURCE_EXHAUSTED and closes it."""
    client_log.DEFAULT.warning(log, connector.user(cred),
                               "worker socket: %d connections open, the limit; refused one",
                               self.max_connections)
    error = errors.ResourceExhaustedError(
        f"the sidecar's worker socket has {self.max_connections} connections open, its limit "
        "(max_worker_connections); close Workers and streams that are done")
    with contextlib.suppress(OSError):
      conn.settimeout(0.5)  # never let one refusal hold the accept loop
      ipc.send(conn, {"error": protocol.error_dict(error)})
    conn.close()

  def _serve(self, conn: socket.socket, cred: ipc.Ucred | None,
             connecting: connector.Connector) -> None:
    session = None
    who = connector.user(cred)  # whose log lines these are, until it attaches (client_log.py)
    counts = contextlib.ExitStack()  # the tenant's count of connections, once taken
    try:
      conn.settimeout(FIRST_FRAME_S)
      with conns.own_io():
        message, _ = ipc.recv(conn)
      self._silent.spoke(conn, cred)
      conn.settimeout(None)  # an attached worker may be quiet for hours
      if message.get("op") == "stream":
        return self._stream(conn, str(message.get("session")))
      if message.get("op") == "calls":
        return self._serve_calls(conn, str(message.get("session")))
      if message.get("op") != "attach":
        raise errors.InvalidArgumentError(
            f"first message must be attach, got {message.get('op')!r:.64}")
      tenant = self._attach_tenant(message, cred)
      claimed = connector.claimed_pid(message.get("pid"))  # InvalidArgumentError: impossible
      pid = connecting.pid
      replica_link = tenants_lib.ReplicaAttach.parse(message.get("token")) is not None
      counts.enter_context(self._counted(tenant))  # ResourceExhaustedError: all taken
      reply = self._hello(message)  # raises VersionMismatchError on skew
      session = "w-" + secrets.token_hex(16)  # a capability: it names the blocks it may use
      with self._lock:
        if self._closed:
          return
        self._tenancy.add_worker(session, tenant)
        self._sessions[session] = conn
        if replica_link:
          self._replica_sessions.add(session)
        self._pids[session] = pid
      self.steps.attach(session, pid=pid, pid_start=connecting.start, tenant=tenant,
                        rank=connector.small_int(message.get("rank")),
                        restart=connector.small_int(message.get("restart")))
      # Its tenant's arena, and no other: what it maps is all it can ever see.
      space = self._arenas.bind(session, tenant)
      arena = space.arena
      assert arena is not None
      reply.update(session=session, arena_size=arena.size, arena_populate=arena.reserved)
      shm.check_sealed(arena.fd)  # never a memfd whose size the worker could change
      with conns.own_io():
        ipc.send(conn, reply, fds=(arena.fd,))
      who = self.client_of(session)
      client_log.DEFAULT.info(log, who, "worker pid %s attached as %s%s", pid or "unverified",
                              session, connector.claim_note(claimed, pid),
                              extra={"session": session})
      # Whether it reads {"queued": place} frames while an alloc waits its turn (a pool).
      frames = message.get("queue") is True
      while True:
        with conns.own_io():
          message, _ = ipc.recv(conn)
        self._handle(conn, session, message, frames=frames)
    except conns.Gone:
      pass  # the worker closed its connection, or died
    except Exception as e:
      # Malformed frames included: answered, then the connection ends (after garbage,
      # nothing on it can be trusted to be a frame boundary).
      conns.log_failure("worker connection", e, session or "-", who)
      with contextlib.suppress(OSError):
        ipc.send(conn, {"error": protocol.error_dict(e)})
    finally:
      if session is not None:
        with self._lock:
          self._sessions.pop(session, None)
          self._pids.pop(session, None)
          self._replica_sessions.discard(session)
        ended = self.steps.end(session)
        if self._ledgers is not None and ended is not None:  # gone without a finish: died
          self._ledgers.ended(session, ended.seen, stalled=ended.stalled)
        freed = self._leases.release_all(session)
        self._arenas.unbind(session)
        client_log.DEFAULT.info(log, who, "worker session %s ended; %d arena blocks released",
                                session, freed, extra={"session": session})
        client_log.DEFAULT.flush(who)  # what its lines owe, where it is its own client
        self._tenancy.drop_worker(session)
      counts.close()
      self._silent.spoke(conn, cred)
      conn.close()
      with self._lock:
        self._connections.pop(conn, None)

  def _attach_tenant(self, message: dict[str, Any], cred: ipc.Ucred | None) -> str | None:
    """The tenant an attaching worker is: its token's (or its user's), or the one another
    sidecar's replica link names with the replica token (``tenants.ReplicaAttach``).

    Raises:
      AuthenticationError: no tenant's token (with a pool file); a replica link whose
        replica token is not this sidecar's, or whose tenant is none of the pool's.
    """
    # The user the kernel says the worker runs as.
    return self._tenancy.worker_tenant(message.get("token"), None if cred is None else cred.uid)

  def _check_not_replica_link(self, session: str, what: str) -> None:
    """PermissionDeniedError where ``session`` is another sidecar's replica link: it maps
    the tenant's arena to copy replicas in, and runs nothing as that tenant."""
    if session in self._replica_sessions:
      raise errors.PermissionDeniedError(
          f"{what}: this worker session is another sidecar's replica link, which copies "
          "replicas into a tenant's arena and runs no calls or streams; a trainer attaches "
          "with its tenant's own token")

  def _connection_limit(self, name: str | None) -> tuple[int, str] | None:
    """The most worker-socket connections tenant ``name`` may hold, and what sets it."""
    t = self._tenancy.tenant(name)
    pool = self._tenancy.pool
    if t is None or pool is None:
      return None
    where = self._tenancy.where(t.name)
    if t.connections is not None:
      return t.connections, f"connections={t.connections}, {where}"
    if not pool.quotas:
      return None
    share = max(1, int(self.max_connections * t.weight / sum(x.weight for x in pool.tenants)))
    return share, f"its share by weight of max_worker_connections={self.max_connections}, {where}"

  @contextlib.contextmanager
  def _counted(self, tenant: str | None):
    """Counts a connection of ``tenant`` while the block runs.

    Raises:
      ResourceExhaustedError: the tenant holds as many as it may: its flood of
        connections is its own, and other tenants' workers still attach.
    """
    limit = self._connection_limit(tenant)
    if limit is None or tenant is None:
      yield
      return
    with self._lock:
      held = self._by_tenant.get(tenant, 0)
      if held >= limit[0]:
        raise errors.ResourceExhaustedError(
            f"tenant {tenant!r} holds {held} connections to the worker socket, its quota "
            f"({limit[1]}); close Workers and streams that are done, or ask the pool's "
            "operator to raise its connections in the pool file")
      self._by_tenant[tenant] = held + 1
    try:
      yield
    finally:
      with self._lock:
        self._by_tenant[tenant] -= 1

  def _stream(self, conn: socket.socket, session: str) -> None:
    """Serves one stream: StreamRequest frames in, StreamItem frames out."""
    try:
      with self._counted(self._tenancy.of_worker(session)):
        self._stream_in(conn, session)
      if not self.has_session(session):  # refused (or ended): its consumer reads why
        conns.linger(conn, ipc.MAX_MESSAGE)
    except errors.SidecarError as e:  # the tenant holds all the connections it may
      conns.log_failure("stream", e, session, self.client_of(session))
      with contextlib.suppress(OSError):
        ipc.send_bytes(conn, pb.StreamItem(end=True, error=protocol.error_info(e))
                       .SerializeToString())

  def _stream_in(self, conn: socket.socket, session: str) -> None:
    """:meth:`_stream`'s body, within the tenant's count of connections: whatever fails
    is answered in the end frame, unless the connection itself failed (``conns.Gone``)."""
    try:
      if not self.has_session(session):
        self._check_ended(session)
        raise errors.InvalidArgumentError(f"stream for unknown worker session {session!r}")
      self._check_not_replica_link(session, "stream")
      with conns.own_io():  # before any buffered read
        first = pb.StreamRequest.FromString(ipc.recv_bytes(conn))
      if first.WhichOneof("kind") != "start" or first.start.worker_session != session:
        raise errors.InvalidArgumentError("the first frame must start a stream for this session")
      credits = SocketCredits(conn, check_prefetch(first.prefetch),
                               lambda freed: self._blocks.free(
                                   session, freed, client=self.client_of(session)),
                               on_taken=lambda n: self.steps.step(session, taken=n))
      producer = threading.get_ident()

      def alive() -> bool:
        # A producer that waits for arena room reads no credit frames, so it reads them
        # here: the consumer's frees may be what makes room, and its close ends the wait.
        if threading.get_ident() == producer:
          credits.drain()
        return self.has_session(session) and not (credits.closed or credits.gone)
      # Blocks of the last items sent, those not yet reported taken (items are taken in
      # order); once taken, the worker holds (and frees) them. Those never taken come
      # back here when the consumer closes the stream.
      sent, unread = 0, collections.deque()
      try:
        for item in self._streams.run(first.start, credits, alive=alive,
                                      time_left=lambda: None,
                                      tenant=self._tenancy.of_worker(session)):
          blocks = feed_batch.item_blocks(item)
          try:
            with conns.own_io():
              ipc.send_bytes(conn, item.SerializeToString())
          except conns.Gone:
            self._blocks.free(session, blocks)  # never arrived whole: nobody can read it
            raise
          sent += 1
          unread.append(blocks)
          while len(unread) > sent - credits.taken:
            unread.popleft()
      finally:
        credits.drain()
        if credits.closed:  # The consumer took exactly what it credited.
          while len(unread) > sent - credits.taken:
            unread.popleft()
          self._blocks.free(session, [x for blocks in unread for x in blocks])
      end = pb.StreamItem(end=True)
    except conns.Gone:
      return  # its consumer closed the connection, or died: nobody to tell
    except Exception as e:  # the pipeline's own (an OSError too), or ours
      conns.log_failure("stream", e, session, self.client_of(session))
      end = pb.StreamItem(end=True, error=protocol.error_info(e))
    with contextlib.suppress(OSError):
      ipc.send_bytes(conn, end.SerializeToString())

  def _serve_calls(self, conn: socket.socket, session: str) -> None:
    """Serves a worker's calls, one after another: a CallRequest frame in, a
    CallResponse frame out (its ``error`` where the call failed). An unknown session or
    a frame past the limit is answered the same way, and ends the connection."""
    try:
      with self._counted(self._tenancy.of_worker(session)):
        self._serve_calls_in(conn, session)
    except errors.SidecarError as e:  # nothing more on it can be trusted to be a frame
      conns.log_failure("calls", e, session, self.client_of(session))
      with contextlib.suppress(OSError):
        ipc.send_bytes(conn, pb.CallResponse(error=protocol.error_info(e)).SerializeToString())
      conns.linger(conn, self._call_bytes)

  def _serve_calls_in(self, conn: socket.socket, session: str) -> None:
    """:meth:`_serve_calls`'s loop, within the tenant's count of connections."""
    if self._calls is None or not self.has_session(session):
      self._check_ended(session)
      raise errors.InvalidArgumentError(f"calls for unknown worker session {session!r}")
    self._check_not_replica_link(session, "calls")
    alive = lambda: self.has_session(session) and conns.client_open(conn)
    while True:
      with conns.own_io():
        raw = ipc.recv_bytes(conn, limit=self._call_bytes)
      if not self.has_session(session):  # ended since (its tenant revoked, say)
        self._check_ended(session)
        raise errors.InvalidArgumentError(f"calls for unknown worker session {session!r}")
      try:
        with tenants_lib.acting_as(self._tenancy.of_worker(session)):
          response = self._calls.run(raw, session, alive=alive, worker=session)
      except Exception as e:  # this call's error, answered; the connection serves on
        conns.log_failure("call", e, session, self.client_of(session))
        response = pb.CallResponse(error=protocol.error_info(e))
      try:
        with conns.own_io():
          ipc.send_bytes(conn, response.SerializeToString())
      except conns.Gone:  # never arrived whole: nobody can read its result's blocks
        self._blocks.free(session, codec.arena_blocks(response.result))
        raise

  def _handle(self, conn: socket.socket, session: str, message: dict[str, Any], *,
              frames: bool = False) -> None:
    self.steps.heard(session)
    op = message.get("op")
    if op == "ping":  # a sign of life, asked while a stream of this worker waits
      with conns.own_io():
        ipc.send(conn, {"ok": True})
      return
    if op == "cancel":  # sent while an alloc waited (Ctrl-C): that alloc has answered
      return
    if op == "free":
      self._blocks.free(session, session_blocks.free_pairs(message.get("blocks", [])),
                        client=self.client_of(session))
      return
    if op == "goodput":
      self._goodput(conn, session, message)
      return
    if op == stall.OP:  # the trainer's word to the stall rule: never answered
      try:
        self.steps.phase(session, stall.Phase.from_dict(message))
      except ValueError as e:
        client_log.DEFAULT.warning(log, self.client_of(session),
                                   "worker %s: a phase frame refused: %s", session,
                                   protocol.for_log(e), extra={"session": session})
      return
    if op == "alloc":
      reply = self._blocks.answer_alloc(conn, session, message, frames=frames)
      with conns.own_io():
        ipc.send(conn, reply)
      return
    with conns.own_io():
      ipc.send(conn, {"error": protocol.error_dict(
          errors.InvalidArgumentError(f"unknown op {op!r:.64}"))})

  def _goodput(self, conn: socket.socket, session: str, message: dict[str, Any]) -> None:
    """A frame of the goodput ledger (``server/goodput/ledgers.py``): answered where it asks
    (``reply``, the first, which binds the directory), else an error is only logged:
    the trainer's step never waits for it."""
    reply = message.get("reply") is True
    error: errors.SidecarError | None = None
    try:
      self._check_not_replica_link(session, "goodput")
      if self._ledgers is None:
        raise errors.InvalidArgumentError("this sidecar keeps no goodput ledger")
      self._ledgers.receive(session, message, tenant=self._tenancy.of_worker(session),
                            attached=self.steps.attached(session))
      self._ledger_steps(session, message)
    except errors.SidecarError as e:
      error = e
    except OSError as e:
      error = errors.CheckpointWriteError(f"goodput: cannot write the ledger: {e}",
                                          errno=e.errno, path=e.filename)
    if error is not None and not reply and (self._ledgers is None
                                            or self._ledgers.refused(session)):
      log.warning("worker %s: %s", session, error, extra={"session": session})
    if reply:
      with conns.own_io():
        ipc.send(conn, {"ok": True} if error is None else {"error": protocol.error_dict(error)})

  def _ledger_steps(self, session: str, message: dict[str, Any]) -> None:
    """A ledger frame that shows step progress (a first step, a save, more batches) is
    a step of ``session`` (the frame was checked: its events are events)."""
    events = message.get("events", [])
    if saves := sum(e.get("kind") == "save" for e in events):
      self.steps.step(session, saves=saves)
    elif any(e.get("kind") == "first_step" for e in events):
      self.steps.step(session)
    elif batches := [e["batches"] for e in events if e.get("kind") == "mark"
                     and "batches" in e]:
      self.steps.step(session, batches=int(max(batches)))

  def _check_ended(self, session: str) -> None:
    """AuthenticationError naming why, if ``session`` was ended by :meth:`end`."""
    with self._lock:
      why = self._ended.get(session)
    if why is not None:
      raise errors.AuthenticationError(f"{why}; this worker's session was ended")

  def end(self, sessions: list[str], why: str) -> None:
    """Ends the connections of worker ``sessions`` (a revoked tenant's): their blocks go
    back as their connections close, and their streams end."""
    with self._lock:
      conns = [self._sessions[s] for s in sessions if s in self._sessions]
      for s in sessions:
        self._ended[s] = why
    for conn in conns:
      log.info("worker connection ended: %s", why)
      with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)

  def close(self) -> None:
    """Stops accepting (joining the accept thread), ends every connection and joins its
    thread; idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      conns = dict(self._connections)
    self._stop.set()
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in flight (Linux)
    self._sock.close()
    self._thread.join(timeout=2.0)
    for conn in conns:
      with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 2.0  # one stuck in user code (a pipeline) stays a daemon
    for thread in conns.values():
      thread.join(timeout=max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path)
    sockets.remove_dirs(self._made_dirs)

