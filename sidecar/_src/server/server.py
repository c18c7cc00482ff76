"""One sidecar: the arena, the worker socket, the gRPC and health servers.

Lifecycle: NEW -> SERVING -> STOPPED. ``start()`` and ``stop()`` are idempotent.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import socket
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import registry as formats_lib
from sidecar._src.core import errors, options as options_lib
from sidecar._src.server import (
  client_ids,
  credentials,
  isolation,
  metrics as metrics_lib,
  policies,
  preflight,
  sockets,
)
from sidecar._src.server.arenas import arenas as arenas_lib
from sidecar._src.server.arenas.arena_io import ArenaIO
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.calls.calls import Runner, UnaryCalls
from sidecar._src.server.calls.stream_runner import StreamRunner
from sidecar._src.server.checkpoint import links as links_lib
from sidecar._src.server.checkpoint.checkpoints import Checkpoints
from sidecar._src.server.checkpoint.service import CheckpointService
from sidecar._src.server.feeds import idle as idle_lib, kept as kept_lib
from sidecar._src.server.goodput import ledgers as ledgers_lib, steps as steps_lib
from sidecar._src.server.limits import (
  CHECKPOINT_THREADS,
  CallSlots,
  CheckpointSlots,
  InlineBytes,
  Sessions,
  StreamSlots,
)
from sidecar._src.server.pool import departures as departures_lib, pool_file
from sidecar._src.server.pool.tenant_checks import TenantCalls, TenantCheckpoints
from sidecar._src.server.ports import (
  health as health_lib,
  health_port as health_port_lib,
  strangers as strangers_lib,
)
from sidecar._src.server.service import Service
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.server.tenant_procs import processes as tenant_procs_lib
from sidecar._src.server.workers.workers import WorkerListener
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import ipc, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)


# Controllers ping every half peer timeout (at most every 10 s) while a stream is quiet,
# to find a stopped sidecar: those pings are welcome, not strikes toward a GOAWAY.
KEEPALIVE_OPTIONS = (("grpc.http2.min_ping_interval_without_data_ms", 100),)
# Streams one connection of the control port may have open at once (a Controller keeps at
# most 8 calls, 8 checkpoint rpcs and its feeds' streams in flight): past it, the client
# waits for one to end. A client without a token opens them in vain: each is refused at once.
STREAMS_PER_CONNECTION = 128
# The health port answers the kubelet, which opens a connection per probe: a few at once.
HEALTH_CONNECTIONS = health_port_lib.HEALTH_CONNECTIONS
class State(enum.Enum):
  NEW = "new"
  SERVING = "serving"
  STOPPED = "stopped"


def _dialable(listen: str) -> str:
  """A TCP listen address as this machine dials it: a wildcard is reached on loopback."""
  return options_lib.LOOPBACK if listen.strip("[]") in ("::", "0.0.0.0", "") else listen


class Server:
  """A sidecar server. Use as a context manager, or ``start()`` then ``stop()``."""

  def __init__(self, opts: options_lib.ServerOptions, *,
               registry: registry_lib.Registry | None = None):
    self.options = opts
    self.registry = registry or registry_lib.default_registry()
    self.state = State.NEW
    self.port = 0  # TCP only; a unix: sidecar has none
    self.health_port = 0
    self.address = ""  # what a client dials: unix:PATH or HOST:PORT
    self.metrics_port: int | None = None
    self.metrics: metrics_lib.Recorder = metrics_lib.OFF
    self.identity = pb.HostIdentity(
        host_id=opts.host_id, slice_id=opts.slice_id, device_ids=list(opts.device_ids),
        hostname=socket.gethostname(), pid=os.getpid(), boot_id=shm.boot_id(),
        pid_namespace=ipc.pid_namespace())  # where its trainers' pids (Status) name them
    self._lock = threading.Lock()
    self._stopped = threading.Event()

  def start(self) -> Server:
    with self._lock:
      if self.state is State.SERVING:
        return self
      if self.state is State.STOPPED:
        raise errors.ClosedError("this sidecar server was stopped; make a new one")
      try:
        self._start()
      except BaseException:
        self._teardown()
        raise
      self.state = State.SERVING
    # Debug: `sidecar serve` prints its own line, with the address it listens on.
    log.debug("sidecar host %d serving on %s (health %s), socket %s, arena %s",
              self.options.host_id, self.address, self.health_port or "on the same socket",
              self.options.socket_path, shm.format_size(self.arenas.size))
    return self

  def _start(self) -> None:
    o = self.options
    preflight.check(o)  # the socket's and checkpoints' mounts, before the arena takes seconds
    if o.token is None and not o.client_tokens and not options_lib.is_loopback(o.listen):
      log.warning(
          "INSECURE: serving %s with no token (--insecure): anyone who can reach ports %d "
          "and %d can run this sidecar's functions, feeds and checkpoint calls; give it "
          "--token-file or listen on 127.0.0.1", o.listen, o.port, o.health_port)
    pool = self._pool(o)
    # A pool's sidecar imports its formats' libraries here, once, before it serves: no
    # tenant's first save waits for (or races) another's import. Elsewhere the first save
    # that needs them imports them, under the same one lock (``ckptfmt/orbax/libs.py``:
    # racing imports broke the package for every caller, issue 76), and a sidecar that
    # never saves, or saves DCP, pays nothing: about 2 s of CPU at every start.
    if o.checkpoint_roots and pool is not None:
      formats_lib.DEFAULT.load_installed()
    self.tenancy = tenants_lib.Tenancy(pool, replica_token=o.replica_token)
    if pool is not None and pool.quotas:  # each tenant's blocks in a memfd of its own
      shm.check_capacity(-(-o.shm_size // shm.PAGE) * shm.PAGE)
      self.arenas = arenas_lib.Arenas(-(-o.shm_size // shm.PAGE) * shm.PAGE, per_tenant=True,
                                      ceiling_of=self._ceiling_of)
      self.arena = None
    else:
      self.arena = shm.Arena.create(o.shm_size)
      self.arenas = arenas_lib.Arenas.single(self.arena)
    if o.metrics_port is not None:
      self.metrics = metrics_lib.Metrics(self._snapshot)
    named = bool(o.client_tokens) or o.pool is not None  # each tenant its own checkpoints
    self.leases = Leases(self.arenas,
                         quota=options_lib.quota_bytes(o.session_quota, self.arenas.size),
                         quota_share=(o.session_quota if isinstance(o.session_quota, float)
                                      else None),
                         tenancy=self.tenancy, tenant_of=self.tenancy.of_worker,
                         metrics=self.metrics,  # kept feed batches, then durable RAM-tier
                         reclaim=self._reclaim,  # copies, give way to new work
                         holds=lambda tenant: self.checkpoints.describe_ram(
                             tenant, everyone=not named))
    # Feeds' batches made since their trainers' last saves, for re-done steps.
    self.kept_batches = kept_lib.KeptBatches(self.leases)
    # What more a client may run and checkpoint: a pool file's tenants' allowlists and
    # quotas; the token modes' clients have none (and a reload keeps a pool a pool).
    call_policy, checkpoint_policy = policies.OPEN_CALLS, policies.OPEN_CHECKPOINTS
    if o.pool is not None:
      call_policy = TenantCalls(self.tenancy)
      checkpoint_policy = TenantCheckpoints(
          self.tenancy, arena_bytes=self.arenas.size,
          tenant_of=lambda session: self.sessions.client(session))
    self.checkpoints = Checkpoints(  # peers share the token (and the TLS CA)
        o.host_id, policy=checkpoint_policy, token=o.replica_token if named else o.token,
        replica_token=o.replica_token, roots=o.checkpoint_roots, metrics=self.metrics,
        spare=self.leases.spare,
        replica_hosts=links_lib.ReplicaHosts(o.replica_hosts, file=o.replica_hosts_file),
        replica_credentials=links_lib.replica_credentials(o.tls_cert, o.tls_key, o.tls_client_ca))
    self.arena_io = ArenaIO(self.leases, inline_limit=o.inline_limit,
                            is_attached=lambda session: self.workers.has_session(session))
    # With a pool file, each tenant's calls, streams and feeds run in processes of its own,
    # which the kernel bounds (ARCHITECTURE.md, "Tenant processes").
    self.tenant_procs: tenant_procs_lib.TenantProcesses | None = None
    if pool is not None and pool.quotas:
      self.tenant_procs = tenant_procs_lib.TenantProcesses(
          self.tenancy, self.arena_io,
          imports=tenant_procs_lib.imports_of(o.imports, self.registry),
          inline_limit=o.inline_limit, limit=o.max_message_size)
    self.runner = Runner(registry=self.registry, arena_io=self.arena_io, metrics=self.metrics,
                         policy=call_policy, isolation=self.tenant_procs or isolation.IN_PROCESS)
    # Feeds' worker processes, idle once their stream ended, for the next of the same work.
    self.idle_workers = idle_lib.IdleWorkers(self.tenancy, grace=o.feed_idle_s)
    self.stream_runner = StreamRunner(self.runner, imports=o.imports, tenancy=self.tenancy,
                                      replay=self.kept_batches, idle=self.idle_workers)
    sessions = Sessions(idle_s=o.session_idle_s, limit=o.max_sessions,
                        evict_idle_s=o.session_evict_s, tenancy=self.tenancy,
                        per_client=o.max_sessions_per_client)
    self.sessions = sessions
    # A caller's tenant: its handshake session's, or its worker's.
    tenant_of = lambda s: sessions.client(s) or self.tenancy.of_worker(s)
    # One budget of calls, whether they come over gRPC or a worker's socket.
    # The inline bytes decoded at once: a call's arrays and a Stage's shards.
    self.inline = inline = InlineBytes(tenancy=self.tenancy)
    calls = UnaryCalls(self.runner, CallSlots(o.threads, tenancy=self.tenancy,
                                              tenant_of=tenant_of), inline)
    def ledger_directory(directory: str, tenant: str | None) -> str:
      # The goodput ledger's directory: checked as a checkpoint call's (core/goodput.py).
      resolved = self.checkpoints.resolve(directory, "directory")
      if named:
        self.checkpoints.check_client(tenant or "", directory, "directory")
      return resolved
    self.ledgers = ledgers_lib.Ledgers(ledger_directory,
                                       check_storage=self.checkpoints.check_storage,
                                       bound=functools.partial(ledgers_lib.bound_of, self.tenancy))
    self.workers = WorkerListener(o.socket_path, self.arenas, self.leases, self._worker_hello,
                                  self.stream_runner, calls=calls,
                                  call_bytes=o.max_message_size,
                                  max_connections=o.max_worker_connections,
                                  on_dead=self._listener_dead, tenancy=self.tenancy,
                                  ledgers=self.ledgers,
                                  steps=steps_lib.Steps(o.stall_timeout_s,
                                                        on_gap=self.ledgers.gap))
    # The tokens a client may present: the shared one, one per client, or the pool's.
    self.tokens = tokens_holder = tenants_lib.Tokens.of(pool, o.replica_token)
    tokens = tokens_holder.table
    checkpoint_slots = CheckpointSlots(tenancy=self.tenancy, tenant_of=tenant_of)
    # A departed tenant's RAM-tier steps go back after its ram_keep (pool file).
    self.departures = departures_lib.Departures(
        self.tenancy,
        busy=lambda name: bool(self.tenancy.workers_of(name))
        or bool(self.tenancy.feed_counts().get(name, (0, 0))[0]),
        last_used=sessions.last_used, release=self.checkpoints.release_ram)
    if o.pool is not None:  # a reload may add ram_keep: any pool file's sidecar sweeps
      self.departures.start()
    # A unix: socket's clients told apart by process (their handshake sessions' holder).
    self._tickets = client_ids.Tickets() if o.unix is not None else None
    # Or by a ticket told in the handshake, where the abstract socket told them none.
    self.fetched = (client_ids.Fetched(sessions, idle_s=sessions.evict_idle_s)
                    if o.unix is not None else None)
    self.service = Service(calls=calls, stream_runner=self.stream_runner,
                           identity=self.identity, arena_size=self.arenas.size,
                           leases=self.leases, workers=self.workers,
                           checkpoints=self.checkpoints.tier.status, sessions=sessions,
                           streams=StreamSlots(total=o.max_streams,
                                               per_session=o.max_streams_per_session,
                                               tenancy=self.tenancy, tenant_of=tenant_of),
                           replica_token=o.replica_token, tokens=tokens_holder,
                           tenancy=self.tenancy, opened=self.checkpoints.opened_by,
                           checkpoint_use=self.checkpoints.tier.group_use,
                           max_request=o.max_message_size, tickets=self._tickets,
                           fetched=self.fetched)
    handshake = ("grpc.server_handshake_timeout_ms", int(o.handshake_timeout_s * 1000))
    nofile = preflight.raise_nofile()
    # A health connection is three descriptors: the client's, the relay's, gRPC's end.
    if nofile < 2 * (o.max_connections + 3 * HEALTH_CONNECTIONS + o.max_worker_connections):
      log.warning("the descriptor limit (%d) is below twice the connections this sidecar "
                  "keeps (max_connections=%d, health %d, worker socket %d): a flood of them "
                  "could leave none; raise `ulimit -n`", nofile, o.max_connections,
                  HEALTH_CONNECTIONS, o.max_worker_connections)
    msg = [("grpc.max_receive_message_length", o.max_message_size),
           ("grpc.max_send_message_length", o.max_message_size),
           ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS,
           ("grpc.max_allowed_incoming_connections", o.max_connections), handshake,
           ("grpc.max_connection_idle_ms", int(o.connection_idle_s * 1000)),
           ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION)]
    # Streams and checkpoint rpcs have budgets of their own: streams that never send a
    # credit, or saves that wait on a slow disk, cannot take the threads of handshakes,
    # calls and status.
    self._executors = [futures.ThreadPoolExecutor(o.threads + o.max_streams + CHECKPOINT_THREADS,
                                                  thread_name_prefix="sidecar-rpc")]
    interceptors: list[grpc.ServerInterceptor] = []
    if tokens or tokens_holder.tls:
      interceptors.append(credentials.TokenAuth(tokens_holder, mtls=o.tls_client_ca is not None))
    # Over TCP, the connections that carried an RPC past the token: the others are
    # strangers, bounded per peer and in time (ports/strangers.py).
    self._admitted = strangers_lib.Admitted() if o.unix is None else None
    if self._admitted is not None:
      interceptors.append(self._admitted)
    self._grpc = grpc.server(self._executors[0], options=msg, interceptors=interceptors)
    checkpoint = CheckpointService(checkpoints=self.checkpoints, arena_io=self.arena_io,
                                   sessions=sessions, metrics=self.metrics,
                                   per_client=named,
                                   slots=checkpoint_slots, inline=inline,
                                   tenancy=self.tenancy,
                                   isolation=self.tenant_procs or isolation.IN_PROCESS)
    self._grpc.add_generic_rpc_handlers((self.service.handler(), checkpoint.handler()))
    reflection.enable_server_reflection(
        (protocol.SERVICE, protocol.CHECKPOINT_SERVICE, reflection.SERVICE_NAME), self._grpc)
    self._health = health_lib.Health()
    if (unix := o.unix) is not None:  # one socket: the services and health, no port
      self._grpc.add_generic_rpc_handlers((self._health.handler(),))
      self._listen_unix(unix.path)
      self.address = unix.target
      self._grpc.start()
    else:
      self.port = self._bind(self._grpc, f"{o.listen}:{o.port}", "--port",
                             credentials.tls_credentials(o))
      self.address = f"{_dialable(o.listen)}:{self.port}"
      self._grpc.start()
      assert self._admitted is not None
      self.strangers = strangers_lib.Strangers(self.port, self._admitted,
                                               grace_s=o.handshake_timeout_s).start()
      self._serve_health(o, handshake)
    if isinstance(self.metrics, metrics_lib.Metrics):
      assert o.metrics_port is not None  # TCP always; a unix: sidecar's on loopback
      self.metrics_port = self.metrics.serve(
          options_lib.LOOPBACK if unix is not None else o.listen, o.metrics_port)
    status = (health_pb2.HealthCheckResponse.SERVING if self.workers.alive
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", protocol.SERVICE):
      self._health.set(name, status)

  def _serve_health(self, o: options_lib.ServerOptions, handshake: tuple[str, int]) -> None:
    """The TCP health port: accepted by ``HealthPort`` (per peer and in total), relayed to
    a gRPC server of its own on a Unix socket in a private directory, which takes one
    stream per connection and has a thread per connection (ports/health_port.py)."""
    slots = health_port_lib.HEALTH_CONNECTIONS
    # The relay holds at most ``slots`` connections; gRPC counts one the relay closed until
    # it reads the close, so while a flood's connections give way it counts more than are
    # open, and refused the next probe's past ``slots`` (one in eight runs of the flood
    # test). Its bound is a backstop with room for that lag; the relay's is the bound.
    self._health_dir = health_port_lib.inner_dir(
        os.path.dirname(o.socket_path) if o.socket_path else None)
    inner = os.path.join(self._health_dir, health_port_lib.INNER_NAME)
    self._executors.append(futures.ThreadPoolExecutor(slots, thread_name_prefix="sidecar-health"))
    self._health_grpc = grpc.server(self._executors[-1], options=[
        ("grpc.max_concurrent_streams", 1), ("grpc.max_allowed_incoming_connections",
                                          health_port_lib.INNER_CONNECTIONS), handshake])
    self._health_grpc.add_generic_rpc_handlers((self._health.handler(),))
    self._bind(self._health_grpc, f"unix:{inner}", "--health-port")
    self._health_grpc.start()
    self.health_front = health_port_lib.HealthPort(o.listen, o.health_port, inner).start()
    self.health_port = self.health_front.port

  def _ceiling_of(self, name: str) -> int | None:
    """Tenant ``name``'s arena size: its ceiling (the whole arena without one); None if it
    is no tenant of the pool in force."""
    t = self.tenancy.tenant(name)
    if t is None:
      return None
    size = self.arenas.size
    return size if t.arena_ceiling is None else t.arena_ceiling.bytes_of(size)

  def _pool(self, o: options_lib.ServerOptions) -> tenants_lib.Pool | None:
    """The tenants: the pool file's (checked against the arena and the checkpoint roots),
    one per client token, the shared token's one, or None (no token)."""
    if o.pool is not None:
      pool = pool_file.load(o.pool, operator_token_file=o.operator_token_file)
      pool.check_operator(o.replica_token)
      pool.check_arena(o.shm_size)
      pool.check_roots(o.checkpoint_roots)
      return pool
    if o.client_tokens:
      return tenants_lib.Pool.clients(o.client_tokens)
    return tenants_lib.Pool.shared(o.token) if o.token else None

  def reload(self) -> str:
    """Reads the pool file again (SIGHUP) and puts it in force without dropping sessions.

    A tenant removed (or whose token changed) loses its sessions and workers at once: its
    next call fails naming why. A bad file changes nothing.

    Returns:
      What changed, in words.

    Raises:
      InvalidArgumentError, OSError: the file is bad (the pool in force stays).
    """
    o = self.options
    if o.pool is None:
      raise errors.InvalidArgumentError(
          "this sidecar has no pool file (sidecar serve --pool FILE): nothing to reload")
    pool = self._pool(o)
    assert pool is not None
    with self._lock:
      old = self.tenancy.pool
      removed, changed = self.tenancy.swap(pool)
      revoked = {n: self.tenancy.revoked[n] for n in removed + changed}
      if old is not None and old.operator_token and old.operator_token != pool.operator_token:
        revoked[tenants_lib.OPERATOR] = (f"the operator token was changed in the pool file "
                                         f"{o.pool}")
      self.tokens.swap(tenants_lib.Tokens.of(pool, o.replica_token), revoked)
      for name, why in revoked.items():
        self.sessions.revoke(name)
        if self.fetched is not None:
          self.fetched.revoke(name)
        # Its arena takes no new block; it closes once its blocks are back (its Workers
        # end now, its RAM-tier copies go): nothing written later is in that memfd.
        self.arenas.retire(name)
        self.workers.end(self.tenancy.workers_of(name), why)
        self.idle_workers.release(name)
        self.checkpoints.release_ram(name)
        if self.tenant_procs is not None and name != tenants_lib.OPERATOR:
          self.tenant_procs.revoke(name, why)
      self.arenas.refresh()
    done = (f"pool file {o.pool} reloaded: {len(pool.tenants)} tenants"
            + (f"; removed {', '.join(removed)}" if removed else "")
            + (f"; token changed for {', '.join(changed)}" if changed else ""))
    log.warning("%s", done)
    return done

  def _listener_dead(self, error: BaseException) -> None:
    """A listener the sidecar needs is gone for good: health says so, the kubelet restarts."""
    health = getattr(self, "_health", None)
    if health is not None:
      for name in ("", protocol.SERVICE):
        health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

  def _snapshot(self) -> metrics_lib.Snapshot:
    """What ``/metrics`` reads when scraped."""
    allocator = self.leases.arenas
    by_session, pinned = self.leases.held_bytes()
    pids = self.workers.pids()
    tenancy = self.tenancy

    def label(tenant: str | None, value: str) -> str:  # a tenant's thing, opaque (metrics.py)
      return metrics_lib.opaque_id(tenancy.metrics_key(tenant), value)

    leased: dict[str, int] = {}
    for session, pid in pids.items():
      worker = label(tenancy.of_worker(session), f"pid{pid}")
      leased[worker] = leased.get(worker, 0) + by_session.get(session, 0)
    usage = self.checkpoints.tier.usage()
    return metrics_lib.Snapshot(
        host_id=self.options.host_id, slice_id=self.options.slice_id,
        uptime_s=self.service.uptime_s(),
        arena_size=allocator.size, arena_used=allocator.used_bytes,
        arena_blocks=allocator.num_blocks, leased=tuple(sorted(leased.items())),
        pinned_bytes=pinned, workers=len(pids), feeds=self.stream_runner.feed_totals(),
        ram_steps=usage["ram_steps"], ram_bytes=usage["ram_bytes"],
        replica_steps=usage["replica_steps"], replica_bytes=usage["replica_bytes"],
        writing_steps=usage["writing_steps"], writing_bytes=usage["writing_bytes"],
        tenants=tuple(metrics_lib.TenantFigures.from_status(t)
                      for t in self.service.tenant_status()),
        goodput=tuple(metrics_lib.GoodputFigures.of(f.tenant, label(f.tenant, f.directory),
                                                     f.ledger)
                      for f in self.ledgers.figures()),
        trainers=tuple(metrics_lib.TrainerFigures.of(t, label(t.tenant, f"pid{t.pid}"))
                       for t in self.workers.steps.trainers() if not t.ended))

  def _listen_unix(self, path: str) -> None:
    """Binds the gRPC server to the Unix socket ``path``: its directory made if missing,
    a stale socket file replaced, a live one refused; mode 0600, or 0660 for
    ``--socket-group``, before the server accepts anyone."""
    o = self.options
    self._unix_dirs = sockets.make_dirs(os.path.dirname(path), what="gRPC socket",
                                        flag="--listen")
    sockets.claim(path, what="gRPC socket", flag="--listen unix:PATH")
    with sockets.private_umask():
      self._bind(self._grpc, f"unix:{path}", "--listen unix:PATH")
    self._unix_inode = sockets.inode_of(path)
    if self._unix_inode is not None and self._tickets is not None:
      self._client_ids = client_ids.Listener(ipc.client_ids_name(*self._unix_inode),
                                             self._tickets)
      self._client_ids.start()
    sockets.restrict(path, mode=0o660 if o.socket_group else 0o600, group=o.socket_group)

  @staticmethod
  def _bind(server: grpc.Server, target: str, flag: str,
            credentials: grpc.ServerCredentials | None = None) -> int:
    try:
      bound = (server.add_insecure_port(target) if credentials is None
               else server.add_secure_port(target, credentials))
    except RuntimeError as e:
      bound = 0
      reason = str(e)
    else:
      reason = "port in use or address not available"
    if not bound:
      raise OSError(f"cannot listen on {target} ({reason}); pick another {flag}")
    return bound

  def _worker_hello(self, message: dict) -> dict:
    theirs = pb.Versions(**{k: v for k, v in (message.get("versions") or {}).items()
                            if k in ("protocol", "package", "python", "numpy", "jax")})
    ours = protocol.local_versions()
    diffs = protocol.version_differences(theirs, ours)
    if diffs:
      raise errors.VersionMismatchError(
          f"worker pid {message.get('pid')} and sidecar host {self.options.host_id} differ: "
          + "; ".join(diffs) + ". Install the same versions on both sides")
    self._adopt(message.get("process"))
    ident = self.identity
    return {"versions": protocol.versions_dict(ours),
            "identity": {"host_id": ident.host_id, "slice_id": ident.slice_id,
                         "device_ids": list(ident.device_ids), "hostname": ident.hostname,
                         "pid": ident.pid, "boot_id": ident.boot_id}}

  def _adopt(self, process: object) -> None:
    """Takes the attaching trainer's process index and devices as this host's identity.

    Under ``jax.distributed`` the trainer process beside this sidecar says which devices
    it owns; ``--device-ids`` overrides that.
    """
    if process is None:
      return
    try:
      index = int(process["process_index"])  # type: ignore[index]
      devices = [int(d) for d in process["device_ids"]]  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
      raise errors.InvalidArgumentError(
          f"attach: 'process' must be {{'process_index': int, 'device_ids': [int]}}, got "
          f"{process!r:.200}") from None
    if index < 0 or any(d < 0 or d >= 1 << 31 for d in devices):
      raise errors.InvalidArgumentError(f"attach: bad process identity {process!r:.200}")
    with self._lock:
      self.identity.process_index = index
      if not self.options.device_ids:
        del self.identity.device_ids[:]
        self.identity.device_ids.extend(devices)
    log.info("trainer process %d attached with devices %s", index, devices)

  def write_ready_file(self, path: str) -> None:
    """Atomically writes where this sidecar listens (LocalCluster waits for it)."""
    data = {"address": self.address, "port": self.port, "health_port": self.health_port,
            "metrics_port": self.metrics_port,
            "socket": self.options.socket_path, "pid": os.getpid()}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      json.dump(data, f)
    os.replace(tmp, path)

  def wait(self, timeout: float | None = None) -> bool:
    return self._stopped.wait(timeout)

  def stop(self, grace: float = 2.0) -> None:
    """Stops serving and frees the arena; idempotent."""
    with self._lock:
      if self.state is State.STOPPED:
        return
      self.state = State.STOPPED
      self._teardown(grace)
    self._stopped.set()

  def _teardown(self, grace: float = 0.0) -> None:
    if getattr(self, "_health", None) is not None:
      self._health.enter_graceful_shutdown()
    if getattr(self, "idle_workers", None) is not None:
      self.idle_workers.close()  # first: the feeds that end below stop their workers
    if isinstance(self.metrics, metrics_lib.Metrics):
      self.metrics.close()
    for name in ("strangers", "health_front"):
      if getattr(self, name, None) is not None:
        getattr(self, name).close()
    for name in ("_grpc", "_health_grpc"):
      server = getattr(self, name, None)
      if server is not None:
        server.stop(grace).wait(grace + 1)
    if getattr(self, "_health", None) is not None:
      self._health.close()  # its watchers' threads
    if getattr(self, "_health_dir", None) is not None:
      health_port_lib.remove_inner_dir(self._health_dir)
    if getattr(self, "_client_ids", None) is not None:
      self._client_ids.close()
    if (unix := self.options.unix) is not None:  # ours only: not a live sidecar's
      sockets.remove_if_same(unix.path, getattr(self, "_unix_inode", None))
      sockets.remove_dirs(getattr(self, "_unix_dirs", []))
    # Their threads: idle ones end at once; one still in a handler (a user function that
    # ignores its cancelled RPC) is waited for a moment, not for ever.
    for executor in getattr(self, "_executors", ()):
      executor.shutdown(wait=False, cancel_futures=True)
      for thread in list(getattr(executor, "_threads", ())):
        thread.join(grace + 1)
    if (tenant_procs := getattr(self, "tenant_procs", None)) is not None:
      tenant_procs.close()  # their jobs end with them; their blocks come back here
    if getattr(self, "departures", None) is not None:
      self.departures.close()
    if getattr(self, "ledgers", None) is not None:
      self.ledgers.close()  # sessions ended by the stop did not die
    if getattr(self, "workers", None) is not None:
      self.workers.close()
    if getattr(self, "checkpoints", None) is not None:
      self.checkpoints.close()
    if getattr(self, "kept_batches", None) is not None:
      self.kept_batches.close()
    if getattr(self, "arena_io", None) is not None:
      self.arena_io.close()
    if getattr(self, "arenas", None) is not None:
      self.arenas.close()
    elif (arena := getattr(self, "arena", None)) is not None:
      arena.close()

  def _reclaim(self, nbytes: int, tenant: str | None) -> int:
    """Where the arena is full: kept feed batches go first, then durable RAM-tier copies
    for what they did not let go of; the bytes let go of."""
    kept = self.kept_batches.reclaim(nbytes, tenant)
    return kept + (self.checkpoints.reclaim(nbytes - kept, tenant) if kept < nbytes else 0)

  def __enter__(self) -> Server:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

