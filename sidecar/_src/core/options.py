"""Options: frozen, keyword-only, validated when made."""

from __future__ import annotations

import dataclasses
import ipaddress
import os

from sidecar._src.core import address as address_lib, stall

MIN_SHM = 1 << 20
# Not 8470/8471: libtpu listens on 8471 inside TPU VMs and pods.
DEFAULT_PORT = 8490
DEFAULT_HEALTH_PORT = 8491
# Without a token a sidecar listens here only: anyone who reaches its port may call it.
LOOPBACK = "127.0.0.1"
# With a token, ``sidecar serve`` listens on every interface unless told otherwise.
ALL_INTERFACES = "[::]"
# How long a feed's worker processes stay idle once its stream ended, for the next stream of
# the same work (a rollback's ``Feed.seek``, a trainer restarted beside this sidecar) to
# adopt them instead of starting new ones (seconds each: an interpreter importing JAX and
# Grain): ``server/feeds/idle.py``, ``sidecar serve --feed-idle-s``. 0: stopped at once.
FEED_IDLE_S = 120.0


def is_loopback(listen: str) -> bool:
  """Whether ``listen`` (``127.0.0.1``, ``[::1]``, ``localhost``, a ``unix:`` socket, ...)
  reaches only this host.

  Host names other than ``localhost`` count as not loopback: what they resolve to
  can change.
  """
  if address_lib.is_unix(listen):
    return True
  host = listen.strip()
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def quota_bytes(quota: float | int, arena: int) -> int:
  """``session_quota`` in bytes of an arena of ``arena`` bytes."""
  return max(1, int(arena * quota)) if isinstance(quota, float) else min(int(quota), arena)


def check_token(token: str | None, name: str = "token") -> None:
  """A token travels as gRPC metadata (``Bearer <token>``): visible ASCII, no spaces.

  Raises:
    ValueError: it is empty or holds anything else (a newline left in a token file, a
      non-ASCII letter), which no client could ever send: said at start, not as
      ``INTERNAL: Invalid metadata`` on every call.
  """
  if token is None:
    return
  if not isinstance(token, str) or not token:
    raise ValueError(f"{name} must be a non-empty string or None")
  bad = next((c for c in token if not "!" <= c <= "~"), None)
  if bad is not None and token.rstrip() and all("!" <= c <= "~" for c in token.rstrip()):
    # What `open(FILE).read()` of any token file gives: every tool ends it with a newline.
    raise ValueError(
        f"{name} ends in {token[len(token.rstrip()):]!r} after {len(token.rstrip())} "
        "characters, as a token file's text does: pass the text stripped "
        "(`open(FILE).read().strip()`), or name the file (SIDECAR_TOKEN_FILE=FILE, "
        "--token-file FILE), whose trailing newline is dropped when it is read")
  if bad is not None:
    raise ValueError(
        f"{name} holds {bad!r} at position {token.index(bad)}: a token must be visible ASCII "
        "(no spaces, newlines or other letters), as gRPC metadata carries it; write the file "
        "again with only the token, e.g. `openssl rand -hex 32 > FILE` (the newline it "
        "ends with is dropped when the file is read)")


def _check_port(name: str, value: object) -> None:
  """A port field is 1..65535, or 0 for a free one (None too for ``metrics_port``): said
  naming its ``sidecar serve`` flag, not left to gRPC, which binds such a port modulo 65536
  and names that one in its error."""
  if value is None and name == "metrics_port":
    return
  if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
    flag = "--" + name.replace("_", "-")
    extra = ", or None for no metrics" if name == "metrics_port" else ""
    raise ValueError(f"{name} ({flag}) must be a TCP port in 1..65535, or 0 to pick a free "
                     f"one{extra}; got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
  """How one sidecar serves. Every field has a ``sidecar serve`` flag."""
  host_id: int = 0
  slice_id: int = 0
  device_ids: tuple[int, ...] = ()
  # A TCP host (with ``port``; the health port listens on the same address), or
  # ``unix:PATH``: the gRPC server and its health on one Unix socket, no port at all.
  listen: str = LOOPBACK
  port: int = DEFAULT_PORT
  health_port: int = DEFAULT_HEALTH_PORT
  socket_path: str = "/run/sidecar/sidecar.sock"
  shm_size: int = 1 << 30
  token: str | None = None
  # Per-client tokens instead of the shared one: ((name, token), ...). Each client then
  # sees and reads only the checkpoint directories it opened (docs/security.md).
  client_tokens: tuple[tuple[str, str], ...] = ()
  # A pool file (sidecar serve --pool FILE): tenants with their tokens and quotas, instead of
  # the shared token or client_tokens (docs/pool.md). Reloaded on SIGHUP.
  pool: str | None = None
  # The pool's operator token file (--operator-token-file), where the pool file names none:
  # it reads every tenant's row and drops RAM-tier copies, and is no tenant. Read at each load.
  operator_token_file: str | None = None
  # What the other sidecars present at the handshake: only their sessions may send replicas.
  replica_token: str | None = None
  # The job's (or pool's) sidecars, by host id (gRPC addresses: HOST:PORT or unix:PATH):
  # the only places this one sends replicas to; or a file holding that list, read when a
  # link is made (for launchers that learn the ports once the sidecars run).
  replica_hosts: tuple[str, ...] = ()
  replica_hosts_file: str | None = None
  insecure: bool = False  # serve a non-loopback address without a token (logged as a warning)
  max_message_size: int = 256 << 20
  inline_limit: int = 64 << 10
  threads: int = 32  # for handshakes, calls and status; streams have their own below
  # Bounds on what clients hold (docs/security.md): gRPC streams at once (each holds a
  # thread of its own budget) in all and per handshake session; handshake sessions kept,
  # and how long one may go unused; worker-socket connections (each holds a thread).
  max_streams: int = 16
  max_streams_per_session: int = 8
  max_sessions: int = 4096
  max_sessions_per_client: int = 1024  # of one TCP connection: past it, its own oldest go
  session_idle_s: float = 86400.0
  session_evict_s: float = 60.0  # past max_sessions, only a session unused this long is evicted
  max_worker_connections: int = 256
  # What one worker session may hold of the arena: a fraction of it (0 < f <= 1) or bytes.
  session_quota: float | int = 0.9
  # A trainer with no step for this long (or 10x its slowest step, if more) after its
  # first is stalled (server/goodput/steps.py): Status and /metrics say so. 0: never.
  stall_timeout_s: float = stall.DEFAULT_FLOOR_S
  # TCP connections the control port keeps at once (more are closed as they come), and how
  # long a new one may take to say its first HTTP/2 frames (TLS included) before it is; a
  # connection that carried no RPC the token let through is closed after as long too, and
  # a peer keeps at most 16 of those (server/ports/strangers.py).
  max_connections: int = 2048
  handshake_timeout_s: float = 10.0
  # A connection of the control port with no RPC for this long is closed (a client's next
  # RPC connects again).
  connection_idle_s: float = 120.0
  imports: tuple[str, ...] = ()  # modules the sidecar imported; feed workers import them too
  # How long an ended feed's worker processes stay idle for the next feed of the same work
  # (its pipeline, arguments, seed, rows, tenant): ``FEED_IDLE_S``; 0: stopped at once.
  feed_idle_s: float = FEED_IDLE_S
  # Directories the checkpoint calls may act in (and below); none: they are refused.
  checkpoint_roots: tuple[str, ...] = ()
  # Port of the Prometheus /metrics endpoint, on ``listen``; None: no metrics; 0: a free one.
  metrics_port: int | None = None
  # TLS on the control port (PEM files): the server's certificate chain and key; with
  # tls_client_ca also mTLS, every client must present a certificate that CA signed.
  tls_cert: str | None = None
  tls_key: str | None = None
  tls_client_ca: str | None = None
  # With a ``unix:`` listen: the group (name or gid) that may connect too; its socket is
  # then mode 0660, else 0600 (only this user).
  socket_group: str | None = None

  @property
  def unix(self) -> address_lib.Address | None:
    """The Unix socket the gRPC server listens on; None for TCP."""
    return address_lib.parse(self.listen) if address_lib.is_unix(self.listen) else None

  def __post_init__(self):
    for name in ("host_id", "slice_id"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    for name in ("port", "health_port", "metrics_port"):
      _check_port(name, getattr(self, name))
    if self.metrics_port and self.metrics_port in (self.port, self.health_port):
      raise ValueError(f"metrics_port {self.metrics_port} is also the port or the health_port; "
                       "pick another --metrics-port")
    if address_lib.is_unix(self.listen):
      self._check_unix()
    elif self.socket_group is not None:
      raise ValueError(f"socket_group (--socket-group) applies to a unix: listen address, "
                       f"not to TCP {self.listen!r}")
    elif self.port and self.port == self.health_port:
      raise ValueError(f"port and health_port must differ, both are {self.port}")
    if not isinstance(self.shm_size, int) or self.shm_size < MIN_SHM:
      raise ValueError(f"shm_size must be at least {MIN_SHM} bytes, got {self.shm_size!r}")
    if any(not isinstance(d, int) or d < 0 for d in self.device_ids):
      raise ValueError(f"device_ids must be non-negative ints, got {self.device_ids!r}")
    if not self.socket_path:
      raise ValueError("socket_path must name a Unix socket path, got an empty string")
    for name in ("token", "replica_token"):
      check_token(getattr(self, name), name)
    if not isinstance(self.replica_hosts, tuple) or any(
        not isinstance(a, str) for a in self.replica_hosts):
      raise ValueError(f"replica_hosts must be a tuple of gRPC addresses (--replica-hosts "
                       f"HOST:PORT,unix:PATH,...), got {self.replica_hosts!r}")
    for a in self.replica_hosts:
      address_lib.parse(a, what="a --replica-hosts entry")
    if self.replica_hosts and self.replica_hosts_file:
      raise ValueError("replica_hosts and replica_hosts_file exclude each other: list the "
                       "job's sidecars in one place (--replica-hosts or --replica-hosts-file)")
    if self.client_tokens:
      if self.token is not None:
        raise ValueError("token and client_tokens exclude each other: give the shared token "
                         "(--token-file) or one per client (--client-tokens), not both")
      names = [n for n, _ in self.client_tokens]
      for n, t in self.client_tokens:
        if not isinstance(n, str) or not n or not all(c.isalnum() or c in "._-" for c in n):
          raise ValueError(f"a client's name is letters, digits, '.', '_' or '-', got {n!r}")
        check_token(t, f"client {n}'s token")
      tokens = [t for _, t in self.client_tokens]
      if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
        raise ValueError("client_tokens: each client needs a name and a token of its own")
    if self.pool is not None:
      if not isinstance(self.pool, str) or not self.pool:
        raise ValueError(f"pool must be the path of a pool file (--pool FILE), got {self.pool!r}")
      if self.token is not None or self.client_tokens:
        raise ValueError("a pool file (--pool) holds the tenants' tokens: give it alone, not "
                         "with --token-file or --client-tokens")
    elif self.operator_token_file is not None:
      raise ValueError("an operator token (--operator-token-file) is a pool's: give it with "
                       "--pool FILE (or name it in the pool file: operator_token_file)")
    if (self.tls_cert is None) != (self.tls_key is None):
      raise ValueError("tls_cert and tls_key go together (--tls-cert and --tls-key), got "
                       f"tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r}")
    if self.tls_client_ca is not None and self.tls_cert is None:
      raise ValueError("tls_client_ca (--tls-client-ca) needs TLS: give --tls-cert and "
                       "--tls-key too")
    # mTLS authenticates every client as a token does.
    if (self.token is None and not self.client_tokens and self.pool is None
        and self.tls_client_ca is None
        and not self.insecure and not is_loopback(self.listen)):
      raise ValueError(
          f"listen {self.listen!r} is not a loopback address and no token is set: anyone who "
          "can reach the port could run functions, feeds and checkpoints here; pass "
          "--token-file FILE (or SIDECAR_TOKEN / SIDECAR_TOKEN_FILE) or --tls-client-ca, listen "
          "on 127.0.0.1, or "
          "pass --insecure (SIDECAR_INSECURE=1) to serve without a token anyway")
    if not isinstance(self.checkpoint_roots, tuple) or any(
        not isinstance(r, str) or not r.strip() for r in self.checkpoint_roots):
      raise ValueError(
          "checkpoint_roots must be a tuple of directory paths (--checkpoint-root DIR), got "
          f"{self.checkpoint_roots!r}")
    if self.threads < 2:
      raise ValueError(f"threads must be at least 2, got {self.threads!r}")
    for name in ("max_streams", "max_streams_per_session", "max_sessions",
                 "max_sessions_per_client", "max_worker_connections", "max_connections"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name in ("handshake_timeout_s", "connection_idle_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ValueError(f"{name} must be positive finite seconds, got {v!r}")
    if (isinstance(self.feed_idle_s, bool) or not isinstance(self.feed_idle_s, (int, float))
        or not 0 <= self.feed_idle_s < float("inf")):
      raise ValueError(f"feed_idle_s (--feed-idle-s) must be finite seconds >= 0 (0: a feed's "
                       f"workers stop with it), got {self.feed_idle_s!r}")
    if not isinstance(self.session_evict_s, (int, float)) or not self.session_evict_s >= 0:
      raise ValueError(f"session_evict_s must be seconds >= 0, got {self.session_evict_s!r}")
    stall.check_floor(self.stall_timeout_s)
    if not isinstance(self.session_idle_s, (int, float)) or not self.session_idle_s > 0:
      raise ValueError(f"session_idle_s must be positive seconds, got {self.session_idle_s!r}")
    q = self.session_quota
    if (isinstance(q, bool) or not isinstance(q, (int, float))
        or not (0 < q <= 1 if isinstance(q, float) else q >= 1)):
      raise ValueError(
          f"session_quota must be a fraction of the arena in (0, 1] or bytes >= 1, got {q!r}")
    if self.inline_limit < 0 or self.max_message_size < 1 << 16:
      raise ValueError(
          f"inline_limit must be >= 0 and max_message_size >= 65536, got {self.inline_limit!r} "
          f"and {self.max_message_size!r}")

  def _check_unix(self) -> None:
    """A ``unix:`` listen address: a path a socket can bind, not the worker socket's, and
    no TLS (the socket file's mode is what guards it)."""
    unix = self.unix  # raises InvalidArgumentError (a ValueError) for a bad path
    assert unix is not None
    if unix.path == os.path.abspath(self.socket_path):
      raise ValueError(f"listen {self.listen!r} is the worker socket (socket_path); the gRPC "
                       "server needs a socket of its own, e.g. unix:DIR/grpc.sock")
    if self.tls_cert is not None:
      raise ValueError(f"TLS (--tls-cert) is for TCP; listen {self.listen!r} is a Unix "
                       "socket, which only who may open its file reaches: drop the TLS "
                       "flags, or listen on a TCP address")
    if self.socket_group is not None and not (
        isinstance(self.socket_group, str) and self.socket_group.strip()):
      raise ValueError(f"socket_group must be a group name or gid, got {self.socket_group!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FeedOptions:
  """How the sidecars produce a feed's batches; never what the batches hold.

  The batches depend only on the pipeline, its ``kwargs``, ``seed`` and the batch index
  (``ctl.feed``'s own arguments), so changing these options changes speed and memory,
  never the data.

  Example::

    feed = ctl.feed("digits", global_batch_size=64, sharding=sharding,
                    kwargs={"split": "train"},
                    options=sidecar.FeedOptions(workers=4, prefetch=4))

  Attributes:
    prefetch: batches each sidecar may run ahead of the trainer, each holding arena slots.
    workers: processes per sidecar producing batches straight into the arena; 0: the
      sidecar itself produces them.
    device_prefetch: batches the trainer process keeps ahead on its devices: a thread
      of the feed puts them there while the trainer computes, so the next batch is
      already on (or on its way to) the accelerator. None: the framework's choice
      (``DEVICE_PREFETCH`` where the devices are accelerators; 0 on CPU devices, where
      a batch aliases its arena block and a put costs nothing). 0: each batch is put
      when ``next()`` is called.
    replay: batches each sidecar keeps of those made since the trainer's last save, to
      serve again (not decode anew) when a rollback or a restart re-does their steps;
      within a quarter of its arena, given way first where the arena is full. 0: none.
      A pool tenant's feed (``sidecar serve --pool``) keeps none yet.
  """
  prefetch: int = 2
  workers: int = 0
  device_prefetch: int | None = None
  replay: int = 1024

  def __post_init__(self):
    if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 1:
      raise ValueError(f"prefetch must be a positive int, got {self.prefetch!r}")
    if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
      raise ValueError(f"workers must be an int >= 0 (0: the sidecar itself), got "
                       f"{self.workers!r}")
    if not isinstance(self.replay, int) or isinstance(self.replay, bool) or not (
        0 <= self.replay < 1 << 32):
      raise ValueError(f"replay must be an int >= 0 (batches kept; 0: none), got "
                       f"{self.replay!r}")
    d = self.device_prefetch
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
      raise ValueError(f"device_prefetch must be None (the framework's choice) or an int "
                       f">= 0, got {d!r}")
