"""The tenants of a shared sidecar, each with its token and its quotas: the pool.

A pool comes from a pool file (``sidecar serve --pool FILE``, read by ``pool_file.load``,
every key in docs/pool.md), or from the older modes, which are pools too: the shared token
(``--token-file``) is one tenant with no quotas (:meth:`Pool.shared`), and per-client
tokens (``--client-tokens``) are named tenants with no quotas (:meth:`Pool.clients`).
:meth:`Pool.check_arena` checks the arena shares once the arena's size is known
(guarantees that sum above it).

The pool itself is frozen values (:class:`Tenant`, :class:`Pool`); at run time
:class:`Tenancy` says which session and worker belongs to which tenant (and counts each
tenant's feeds), :class:`Tokens` what the control port takes. Each quota is an object of
``quotas.py`` (beside this one), which the parts that enforce it ask (``limits``, ``leases``,
``pool/tenant_checks``, ``pool/departures``, ``Tenancy.feeding``; ``workers.py``'s
connections).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.core import errors, paths
from sidecar._src.server.tenancy import quotas as quotas_lib
from sidecar._src.user import data_roots

# The client name of a session of the pool's operator token (``operator_token_file``): no
# tenant's name can be it (names are letters, digits, '.', '_' and '-').
OPERATOR = "(operator)"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
  """One tenant of a pool: its name, token, what it may reach, and its quotas.

  ``quotas``: the value of each quota of ``quotas.ALL`` the pool file gives it, by key (one
  left out: no quota of that kind, or the quota's default). The parts that enforce a quota
  ask its object (``quotas.CALLS.limit(tenant, pool)``); ``tenant.calls`` reads it too.
  """
  name: str
  token: str = dataclasses.field(repr=False)
  token_file: str | None = None
  line: int = 0  # where the pool file names it (0: not from a file)
  quotas: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
  checkpoint_roots: tuple[str, ...] = ()  # resolved; empty: the sidecar's roots
  # Where its pipelines may read files (resolved): the pool file's data_roots, else its
  # checkpoint_roots; empty: nowhere (in a pool file; outside one, anywhere).
  data_roots: tuple[str, ...] = ()
  functions: frozenset[str] | None = None  # None: every registered one
  pipelines: frozenset[str] | None = None
  weight: float = 1.0
  # Workers whose process runs as one of these users belong to it without a token (the
  # kernel says who connected to the worker socket: SO_PEERCRED).
  uids: frozenset[int] = frozenset()
  # The user (and group) its processes run as (server/tenant_procs/): the kernel's
  # permission checks then decide what its pipelines and functions may read and write;
  # None: the sidecar's own user.
  uid: int | None = None
  gid: int | None = None
  # With mTLS (--tls-client-ca): client certificates whose common name (or a DNS name of
  # theirs) is one of these are this tenant's, with no token.
  tls_names: frozenset[str] = frozenset()

  def __getattr__(self, key: str) -> Any:
    """A quota's value by its key (``tenant.arena_ceiling``; None: none of that kind)."""
    quota = quotas_lib.BY_KEY.get(key)
    if quota is None:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
    return quota.of(self)

  def allows(self, kind: str, name: str) -> bool:
    """Whether its allowlist of ``kind`` ("function" or "pipeline") lets it run ``name``."""
    allowed = self.functions if kind == "function" else self.pipelines
    return allowed is None or name in allowed


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pool:
  """The tenants of one sidecar. ``path``: the pool file (None: made from tokens).

  ``operator_token``: the pool's operator's (``operator_token_file``), no tenant's: it reads
  every tenant's row of Status and drops anyone's RAM-tier copies, nothing else; None: none.
  """
  tenants: tuple[Tenant, ...]
  path: str | None = None
  operator_token: str | None = dataclasses.field(default=None, repr=False)
  operator_token_file: str | None = None
  operator_where: str = ""  # where it is named, for messages: FILE:LINE or the flag

  def check_operator(self, replica_token: str | None) -> None:
    """Checks that the operator token is not the sidecars' peer token.

    Raises:
      InvalidArgumentError: naming both.
    """
    if self.operator_token and replica_token and hmac.compare_digest(
        self.operator_token.encode(), replica_token.encode()):
      raise errors.InvalidArgumentError(
          f"{self.operator_where}: the operator token ({self.operator_token_file}) is the "
          "sidecars' peer token (--peer-token-file or SIDECAR_PEER_TOKEN): the peer token is "
          "the sidecars' own, for their replicas; give the operator a token of its own "
          "(`openssl rand -hex 32 > FILE; chmod 600 FILE`)")

  @classmethod
  def shared(cls, token: str) -> Pool:
    """The shared-token mode: one unnamed tenant, no quotas."""
    return cls(tenants=(Tenant(name="", token=token),))

  @classmethod
  def clients(cls, pairs: tuple[tuple[str, str], ...]) -> Pool:
    """The per-client tokens mode: one tenant per client, no quotas."""
    return cls(tenants=tuple(Tenant(name=n, token=t) for n, t in pairs))

  @property
  def quotas(self) -> bool:
    """Whether this pool came from a pool file (its tenants' workers must say who they are)."""
    return self.path is not None

  def mode(self) -> str:
    """How this sidecar names its tenants, for messages: the pool file, or the tokens."""
    if self.path is not None:
      return f"the pool file {self.path} (--pool)"
    if len(self.tenants) == 1 and not self.tenants[0].name:
      return "one shared token"
    return "per-client tokens (--client-tokens)"

  def by_name(self) -> dict[str, Tenant]:
    return {t.name: t for t in self.tenants}

  def by_token(self) -> dict[str, Tenant]:
    return {t.token: t for t in self.tenants}

  def where(self, tenant: Tenant) -> str:
    """``FILE:LINE`` of a tenant, for messages."""
    return f"{self.path}:{tenant.line}" if self.path else "the sidecar's tokens"

  def check_arena(self, arena: int) -> None:
    """Checks the tenants' arena shares against an arena of ``arena`` bytes.

    Raises:
      InvalidArgumentError: a share above the arena, a ceiling below one batch or below
        its guarantee, or guarantees that together pass the arena; naming the line.
    """
    fmt = shm.format_size
    total = 0
    for t in self.tenants:
      for share in quotas_lib.ARENA_SHARES:
        if (why := share.check(t, arena)) is not None:
          raise error_at(self.path, t.line, why)
      g = quotas_lib.ARENA.bytes_of(t, arena) or 0
      c = quotas_lib.ARENA_CEILING.bytes_of(t, arena)
      if c is not None and c < max(g, quotas_lib.MIN_ARENA):
        raise error_at(self.path, t.line, f"tenant {t.name!r}: arena_ceiling "
                       f"{t.arena_ceiling} ({fmt(c)}) is below its guaranteed arena "
                       f"({fmt(g)}) or one batch ({fmt(quotas_lib.MIN_ARENA)}); raise it")
      total += g
    if total > arena:
      shares = ", ".join(f"{t.name} {t.arena}" for t in self.tenants)
      raise error_at(self.path, self.tenants[0].line if self.tenants else 0,
                   f"the tenants' guaranteed arena shares ({shares}) sum to {fmt(total)}, "
                   f"more than the arena ({fmt(arena)}, --shm-size); lower them or raise "
                   "--shm-size")

  def check_roots(self, roots: tuple[str, ...]) -> None:
    """Checks that every tenant's checkpoint roots lie under one of the sidecar's, and that
    a data root that is, holds or lies in one of the sidecar's lies in the tenant's own
    checkpoint roots (elsewhere there, another tenant's checkpoints may be)."""
    real = tuple(os.path.realpath(r) for r in roots)
    for t in self.tenants:
      for r in t.checkpoint_roots:
        if not any(paths.inside(r, s) for s in real):
          raise error_at(self.path, t.line, f"tenant {t.name!r}: checkpoint root {r} is under "
                       f"no --checkpoint-root of the sidecar ({', '.join(real) or 'none'}); "
                       "add one that holds it")
      for r in t.data_roots:
        shared = [s for s in real if paths.overlap(r, s)]
        if shared and not any(paths.inside(r, c) for c in t.checkpoint_roots):
          raise error_at(self.path, t.line, f"tenant {t.name!r}: data root {r} "
                         f"{'is' if r == shared[0] else 'overlaps'} the sidecar's "
                         f"--checkpoint-root {shared[0]}, where other tenants' checkpoints "
                         "may be; keep data outside the sidecar's checkpoint roots, or in "
                         "the tenant's own checkpoint_roots")

  def data_roots(self, name: str | None) -> data_roots.DataRoots:
    """Where tenant ``name``'s pipelines may read: anywhere outside a pool file, its data
    roots in one (none: a name that is no tenant's), which functions they may name in
    their arguments (its ``functions`` allowlist), and how many files they may hold open
    (its ``open_files``, else its share by weight of ``quotas.open_files_total()``)."""
    if not self.quotas:
      return data_roots.ANYWHERE
    t = self.by_name().get(name) if name is not None else None
    functions = () if t is None else None if t.functions is None else tuple(sorted(t.functions))
    files = None if t is None else quotas_lib.OPEN_FILES.limit(
        t, self, total=quotas_lib.open_files_total())
    return data_roots.DataRoots(roots=t.data_roots if t is not None else (),
                                tenant=name or "", where=self.where(t) if t else str(self.path),
                                functions=functions,
                                open_files=files.most if files else None,
                                open_files_why=files.why if files else "")


def error_at(path: str | None, line: int, message: str) -> errors.InvalidArgumentError:
  """An InvalidArgumentError naming ``path:line`` (where the pool file says it)."""
  if not path:
    return errors.InvalidArgumentError(message)
  return errors.InvalidArgumentError(f"{path}:{line}: {message}" if line else f"{path}: {message}")


def operator_denied(what: str) -> str:
  """Why a session of the pool's operator token may not do ``what``."""
  return (f"{what}: this is the pool's operator token (operator_token_file), which reads "
          "Status (every tenant's row) and drops RAM-tier copies (DropRamTier), nothing "
          "else: it is no tenant; present a tenant's token to run, feed or checkpoint")


# ---- at run time ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaAttach:
  """What another sidecar's replica link presents at a worker-socket attach, in the place of
  a tenant's token: the peer token, and the tenant whose replicas its blocks will hold (as
  the sending sidecar authenticated it; "" outside pools). The peer token is not a tenant:
  the blocks count against ``tenant``."""
  PREFIX = "sidecar-peer-attach:"
  replica_token: str = dataclasses.field(repr=False)
  tenant: str = ""

  def token(self) -> str:
    return self.PREFIX + json.dumps({"peer_token": self.replica_token, "tenant": self.tenant})

  @classmethod
  def parse(cls, token: object) -> ReplicaAttach | None:
    """The ReplicaAttach ``token`` is, or None where it is no such thing (a tenant's token)."""
    if not isinstance(token, str) or not token.startswith(cls.PREFIX):
      return None
    try:
      d = json.loads(token[len(cls.PREFIX):])
      return cls(str(d["peer_token"]), str(d.get("tenant") or ""))
    except (ValueError, KeyError, TypeError):
      raise errors.AuthenticationError(
          "a malformed peer attach (the sidecars' replica link) at the worker socket") from None


# The tenant a unary call runs for, set by its way in (the gRPC service, the worker
# socket) while it runs: the budgets that see only bytes (inline requests) and the
# allowlists read it.
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("sidecar_tenant",
                                                                     default=None)


@contextlib.contextmanager
def acting_as(tenant: str | None) -> Iterator[None]:
  """``CURRENT`` is ``tenant`` while the block runs."""
  token = CURRENT.set(tenant)
  try:
    yield
  finally:
    CURRENT.reset(token)


class Tenancy:
  """Which tenant each session and worker is, and the pool in force (swapped on reload).

  Args:
    pool: the tenants; None: no authentication (every session is nobody's).
    replica_token: what the job's other sidecars prove at a worker-socket attach (their
      replica links, :class:`ReplicaAttach`); None: no sidecar's link is taken there.
  """

  def __init__(self, pool: Pool | None, *, replica_token: str | None = None):
    self._lock = threading.Lock()
    self._replica_token = replica_token
    self._pool = pool
    self._tenants: dict[str, Tenant] = pool.by_name() if pool else {}
    self._workers: dict[str, str] = {}  # worker session -> tenant
    self._feeds = quotas_lib.Held(quotas_lib.FEEDS, "feeds", lambda: self._pool,
                                  fix="close feeds that are done, or raise its quota")
    self._feed_workers = quotas_lib.Held(
        quotas_lib.FEED_WORKERS, "feed worker processes", lambda: self._pool,
        fix="ask for fewer workers=, or close feeds that are done")
    self.revoked: dict[str, str] = {}  # tenant -> why (its token no longer works)
    # The key of /metrics' opaque ids where no tenant's token is one (no pool, a name
    # that is no tenant's): stable while this sidecar runs.
    self._own_key = secrets.token_bytes(32)

  @property
  def pool(self) -> Pool | None:
    return self._pool

  @property
  def quotas(self) -> bool:
    """Whether tenants have quotas (a pool file): then a worker must say whose it is."""
    return self._pool is not None and self._pool.quotas

  def tenant(self, name: str | None) -> Tenant | None:
    """The tenant named ``name`` in the pool in force (None: no such tenant, or no name)."""
    if name is None:
      return None
    with self._lock:
      return self._tenants.get(name)

  def names(self) -> list[str]:
    with self._lock:
      return sorted(self._tenants)

  def swap(self, pool: Pool) -> tuple[list[str], list[str]]:
    """Puts ``pool`` in force; the tenants removed and those whose token changed."""
    with self._lock:
      old = self._tenants
      new = pool.by_name()
      removed = sorted(n for n in old if n not in new)
      changed = sorted(n for n in old if n in new and (
          new[n].token != old[n].token or not old[n].tls_names <= new[n].tls_names))
      for n in removed:
        self.revoked[n] = f"tenant {n!r} was removed from the pool file {pool.path}"
      for n in changed:
        self.revoked[n] = (f"tenant {n!r}'s token (or tls_names) was changed in the pool "
                           f"file {pool.path}")
      for n in new:
        if n not in removed and n not in changed:
          self.revoked.pop(n, None)
      self._pool, self._tenants = pool, new
      return removed, changed

  # worker sessions
  def worker_tenant(self, token: object, uid: int | None = None) -> str | None:
    """The tenant whose token a worker presented at attach, else the one whose ``uids``
    hold the user its process runs as (``uid``, from the kernel).

    Raises:
      AuthenticationError: with a pool file, a worker with no token or a wrong one, whose
        user no tenant names; another sidecar's link (:class:`ReplicaAttach`) with a wrong peer
        token or a tenant not in the pool.
    """
    with self._lock:
      pool = self._pool
    attach = ReplicaAttach.parse(token)
    if attach is not None:
      return self._replica_tenant(attach, pool)
    if pool is None:
      return None
    if pool.operator_token and isinstance(token, str) and hmac.compare_digest(
        token.encode(errors="replace"), pool.operator_token.encode()):
      raise errors.AuthenticationError(
          f"this is the pool's operator token ({pool.operator_where}): it reads Status and "
          "drops RAM-tier copies, and is no tenant, so no worker attaches with it; give the "
          "worker its tenant's token (SIDECAR_TOKEN or SIDECAR_TOKEN_FILE)")
    found = None
    if isinstance(token, str):
      for t in pool.tenants:
        if t.token and hmac.compare_digest(token.encode(errors="replace"), t.token.encode()):
          found = t.name
    if found is not None:
      return found
    if token is None and uid is not None:
      found = next((t.name for t in pool.tenants if uid in t.uids), None)
      if found is not None:
        return found
    if len(pool.tenants) == 1 and not pool.quotas:
      return pool.tenants[0].name  # the shared token: every worker is its one tenant's
    if pool.quotas:
      raise errors.AuthenticationError(
          f"this sidecar serves a pool of tenants (the pool file {pool.path}): a worker must "
          "present its tenant's token at attach; set SIDECAR_TOKEN (or SIDECAR_TOKEN_FILE) "
          "in the trainer's environment, pass token= to the Worker, or name its user in the "
          "tenant's uids. If this is the sidecars' own replica link (another sidecar on this "
          "machine maps this one's arena through its worker socket), it is that link this "
          "pool sidecar refused, not a trainer: replicate over gRPC (SIDECAR_REPLICA_SHM=0 "
          "for the sending sidecar)")
    return None

  def _replica_tenant(self, attach: ReplicaAttach, pool: Pool | None) -> str | None:
    """The tenant another sidecar's replica link attaches for, once its peer token holds."""
    if self._replica_token is None or not hmac.compare_digest(
        attach.replica_token.encode(errors="replace"), self._replica_token.encode()):
      raise errors.AuthenticationError(
          "the sidecars' replica link was refused at this worker socket: its peer token is "
          + ("not this sidecar's" if self._replica_token else "set, this sidecar has none")
          + "; give every sidecar of the job the same --peer-token-file (or "
          "SIDECAR_PEER_TOKEN)")
    if not attach.tenant:
      if pool is not None and pool.quotas:
        raise errors.AuthenticationError(
            "the sidecars' replica link named no tenant, and this sidecar serves a pool "
            f"({pool.path}): every replica is some tenant's; give every sidecar the same pool")
      if pool is not None and len(pool.tenants) == 1:
        return pool.tenants[0].name  # the shared token's one tenant, as its workers
      return None
    if pool is None or attach.tenant not in pool.by_name():
      raise errors.AuthenticationError(
          f"the sidecars' replica link is for tenant {attach.tenant!r}, which is not in this "
          f"sidecar's pool ({(pool.path or 'its tokens') if pool else 'none'}); "
          "give every sidecar of the pool the same pool file")
    return attach.tenant

  def add_worker(self, session: str, tenant: str | None) -> None:
    if tenant is not None:
      with self._lock:
        self._workers[session] = tenant

  def drop_worker(self, session: str) -> None:
    with self._lock:
      self._workers.pop(session, None)

  def of_worker(self, session: object) -> str | None:
    with self._lock:
      return self._workers.get(session) if isinstance(session, str) else None

  def workers_of(self, tenant: str) -> list[str]:
    with self._lock:
      return [s for s, t in self._workers.items() if t == tenant]

  def metrics_key(self, tenant: str | None) -> bytes:
    """The key of ``tenant``'s opaque ids on ``/metrics`` (``metrics.opaque_id``): derived
    from its token, so the same after a restart and known only to it and the operator
    (docs/security.md, "The metrics port"); this sidecar's own where it has no token."""
    t = self.tenant(tenant)
    if t is None or not t.token:
      return self._own_key
    return hashlib.sha256(b"sidecar-metrics-id\0" + t.token.encode()).digest()

  def data_roots(self, tenant: str | None) -> data_roots.DataRoots:
    """Where ``tenant``'s pipelines may read, in the pool in force (``Pool.data_roots``)."""
    with self._lock:
      pool = self._pool
    return pool.data_roots(tenant) if pool is not None else data_roots.ANYWHERE

  # feeds
  @contextlib.contextmanager
  def feeding(self, tenant: str | None, workers: int) -> Iterator[None]:
    """Counts a feed of ``tenant`` with ``workers`` processes while the block runs.

    Raises:
      ResourceExhaustedError: the tenant runs as many feeds or feed workers as it may.
    """
    t = self.tenant(tenant)
    with self._feeds.hold(t), self._feed_workers.hold(t, workers):
      yield

  @contextlib.contextmanager
  def feed_workers(self, tenant: str | None, workers: int) -> Iterator[None]:
    """Counts ``workers`` feed worker processes of ``tenant`` while the block runs: a
    feed's apart from the feed itself (``feeding(tenant, 0)``), or those kept idle for its
    next stream (``feeds/idle.py``).

    Raises:
      ResourceExhaustedError: they would pass the tenant's ``feed_workers`` quota.
    """
    with self._feed_workers.hold(self.tenant(tenant), workers):
      yield

  def feed_counts(self) -> Mapping[str, tuple[int, int]]:
    """Each tenant's feeds and feed worker processes now."""
    feeds, workers = self._feeds.counts(), self._feed_workers.counts()
    return {n: (feeds.get(n, 0), workers.get(n, 0)) for n in feeds.keys() | workers.keys()}

  def _where(self, t: Tenant) -> str:
    pool = self._pool
    return pool.where(t) if pool is not None else "the sidecar's tokens"

  def where(self, name: str) -> str:
    t = self.tenant(name)
    return self._where(t) if t is not None else "the pool file"

  def check_worker(self, tenant: str | None, worker_session: str) -> None:
    """PermissionDeniedError unless ``worker_session`` (a request's, whose arena it uses)
    is one of ``tenant``'s workers: with a pool file, no tenant names another's."""
    if not self.quotas or not worker_session or tenant is None:
      return
    if self.of_worker(worker_session) != tenant:
      raise errors.PermissionDeniedError(
          f"worker_session {worker_session!r:.60} is no worker of tenant {tenant!r} (on this "
          "sidecar each tenant's requests name only its own workers); attach a Worker with "
          "its token")

  def check_allowed(self, tenant: str | None, kind: str, name: str) -> None:
    """PermissionDeniedError unless ``tenant``'s allowlist of ``kind`` holds ``name``."""
    t = self.tenant(tenant)
    if t is not None and not t.allows(kind, name):
      allowed = sorted((t.functions if kind == "function" else t.pipelines) or ())
      raise errors.PermissionDeniedError(
          f"tenant {t.name!r} may not run {kind} {name!r}: its {kind}s allowlist "
          f"({self._where(t)}) holds {', '.join(allowed) or 'nothing'}; add it there")


class Tokens:
  """The bearer tokens the control port takes (``{b"Bearer <token>": tenant name}``), and
  those a reload revoked (``{b"Bearer <token>": why}``); swapped whole on reload.

  ``named``: whether names identify tenants (per-client tokens or a pool file), so that
  each sees only its own checkpoints; the shared token's one tenant has none.
  """

  def __init__(self, table: dict[bytes, str], *, named: bool,
               tls: dict[str, str] | None = None):
    self.table = table
    self.named = named
    self.tls = tls or {}  # certificate name -> tenant (mTLS identities)
    self.revoked: dict[bytes, str] = {}
    self.revoked_tls: dict[str, str] = {}  # certificate name -> why

  @staticmethod
  def of(pool: Pool | None, replica_token: str | None) -> Tokens:
    """The tokens of ``pool`` (None: none; then nothing is asked), the peers' token (client
    ""), and the pool's operator token (client ``OPERATOR``)."""
    if pool is None:
      return Tokens({}, named=False)
    named = pool.quotas or any(t.name for t in pool.tenants)
    table = {f"Bearer {t.token}".encode(): t.name for t in pool.tenants if t.token}
    if named and replica_token:  # the other sidecars authenticate with theirs
      table[f"Bearer {replica_token}".encode()] = ""
    if pool.operator_token:
      table[f"Bearer {pool.operator_token}".encode()] = OPERATOR
    return Tokens(table, named=named,
                  tls={n: t.name for t in pool.tenants for n in t.tls_names})

  def swap(self, new: Tokens, revoked: dict[str, str]) -> None:
    """Takes ``new``'s table; the old tokens of tenants in ``revoked`` (name: why) are
    refused with that reason from now on."""
    for bearer, name in self.table.items():
      if name in revoked and bearer not in new.table:
        self.revoked[bearer] = revoked[name]
    for cert, name in self.tls.items():
      if name in revoked and cert not in new.tls:
        self.revoked_tls[cert] = revoked[name]
    for bearer in new.table:
      self.revoked.pop(bearer, None)
    for cert in new.tls:
      self.revoked_tls.pop(cert, None)
    self.table, self.tls = new.table, new.tls
