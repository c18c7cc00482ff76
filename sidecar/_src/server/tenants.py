"""The pool file: the tenants of a shared sidecar, each with its token and its quotas.

A pool file (``sidecar serve --pool FILE``) is YAML::

    tenants:
      - {name: alice, token_file: /etc/sidecar/alice.token, arena: 0.4}
      - {name: bob, token_file: /etc/sidecar/bob.token, arena: 2GiB, sessions: 64}

Every key is in docs/pool.md ("The pool file"). :func:`load` reads and checks it, naming
the line of every mistake (an unknown key, a duplicate name or token, a quota below its
least); :meth:`Pool.check_arena` checks the arena shares once the arena's size is known
(guarantees that sum above it). The two older modes are pools too: the shared token
(``--token-file``) is one tenant with no quotas (:meth:`Pool.shared`), and per-client
tokens (``--client-tokens``) are named tenants with no quotas (:meth:`Pool.clients`).

Only frozen values live here; what enforces them at run time is :class:`Tenancy` (which
session and worker belongs to which tenant, and each tenant's feeds) and the budgets in
``limits.py`` and ``leases.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hmac
import logging
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from sidecar._src.arena import shm
from sidecar._src.core import errors, options as options_lib

log = logging.getLogger(__name__)

POOL_FLAG = "--pool"
# A tenant's arena ceiling is one batch at least: below this nothing useful fits.
MIN_ARENA = 1 << 20
# The least ``inline_bytes`` a tenant may have: a call's small arguments travel inline.
MIN_INLINE = 64 << 10

_TENANT_KEYS = frozenset({
    "name", "token_file", "arena", "arena_ceiling", "sessions", "calls", "streams", "feeds",
    "feed_workers", "inline_bytes", "checkpoint_roots", "functions", "pipelines", "weight",
    "uids", "tls_names", "connections"})
_POOL_KEYS = frozenset({"tenants"})


@dataclasses.dataclass(frozen=True, slots=True)
class Share:
  """An arena share as the pool file gives it: a fraction of the arena, or bytes."""
  fraction: float | None = None
  nbytes: int | None = None

  def bytes_of(self, arena: int) -> int:
    """The share in bytes of an arena of ``arena`` bytes."""
    if self.fraction is not None:
      return int(arena * self.fraction)
    return int(self.nbytes or 0)

  def __str__(self) -> str:
    return f"{self.fraction:g}" if self.fraction is not None else shm.format_size(
        self.nbytes or 0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
  """One tenant of a pool: its name, token and quotas (None: no quota of that kind)."""
  name: str
  token: str = dataclasses.field(repr=False)
  token_file: str | None = None
  line: int = 0  # where the pool file names it (0: not from a file)
  arena: Share = Share(nbytes=0)  # guaranteed: nobody else may take it
  arena_ceiling: Share | None = None  # the most it may hold
  sessions: int | None = None  # handshake sessions kept at once
  calls: int | None = None  # unary calls at once
  streams: int | None = None  # gRPC streams at once
  feeds: int | None = None  # feeds at once
  feed_workers: int | None = None  # feed worker processes at once, all its feeds together
  inline_bytes: int | None = None  # bytes of large inline calls decoded at once
  connections: int | None = None  # worker-socket connections (attach, streams, calls)
  checkpoint_roots: tuple[str, ...] = ()  # resolved; empty: the sidecar's roots
  functions: frozenset[str] | None = None  # None: every registered one
  pipelines: frozenset[str] | None = None
  weight: float = 1.0
  # Workers whose process runs as one of these users belong to it without a token (the
  # kernel says who connected to the worker socket: SO_PEERCRED).
  uids: frozenset[int] = frozenset()
  # With mTLS (--tls-client-ca): client certificates whose common name (or a DNS name of
  # theirs) is one of these are this tenant's, with no token.
  tls_names: frozenset[str] = frozenset()

  def allows(self, kind: str, name: str) -> bool:
    """Whether its allowlist of ``kind`` ("function" or "pipeline") lets it run ``name``."""
    allowed = self.functions if kind == "function" else self.pipelines
    return allowed is None or name in allowed


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pool:
  """The tenants of one sidecar. ``path``: the pool file (None: made from tokens)."""
  tenants: tuple[Tenant, ...]
  path: str | None = None

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
      g = t.arena.bytes_of(arena)
      if g > arena:
        raise _error(self.path, t.line, f"tenant {t.name!r}: arena {t.arena} is more than the "
                     f"whole arena ({fmt(arena)}, --shm-size); lower it")
      if t.arena_ceiling is not None:
        c = t.arena_ceiling.bytes_of(arena)
        if c > arena:
          raise _error(self.path, t.line, f"tenant {t.name!r}: arena_ceiling "
                       f"{t.arena_ceiling} is more than the whole arena ({fmt(arena)}, "
                       "--shm-size); lower it, or leave it out for no ceiling")
        if c < max(g, MIN_ARENA):
          raise _error(self.path, t.line, f"tenant {t.name!r}: arena_ceiling "
                       f"{t.arena_ceiling} ({fmt(c)}) is below its guaranteed arena "
                       f"({fmt(g)}) or one batch ({fmt(MIN_ARENA)}); raise it")
      total += g
    if total > arena:
      shares = ", ".join(f"{t.name} {t.arena}" for t in self.tenants)
      raise _error(self.path, self.tenants[0].line if self.tenants else 0,
                   f"the tenants' guaranteed arena shares ({shares}) sum to {fmt(total)}, "
                   f"more than the arena ({fmt(arena)}, --shm-size); lower them or raise "
                   "--shm-size")

  def check_roots(self, roots: tuple[str, ...]) -> None:
    """Checks that every tenant's checkpoint roots lie under one of the sidecar's."""
    real = tuple(os.path.realpath(r) for r in roots)
    for t in self.tenants:
      for r in t.checkpoint_roots:
        if not any(r == s or r.startswith(s.rstrip(os.sep) + os.sep) for s in real):
          raise _error(self.path, t.line, f"tenant {t.name!r}: checkpoint root {r} is under "
                       f"no --checkpoint-root of the sidecar ({', '.join(real) or 'none'}); "
                       "add one that holds it")


def _error(path: str | None, line: int, message: str) -> errors.InvalidArgumentError:
  return errors.InvalidArgumentError(f"{path}:{line}: {message}" if path else message)


# ---- reading the file ----------------------------------------------------------------


def warn_if_readable(path: str, what: str) -> bool:
  """Warns (naming ``path`` and the fix) where others may read it; whether it did."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return False
  if not mode & (stat.S_IROTH | stat.S_IWOTH):
    return False
  log.warning("%s %s is readable by everyone (mode %o): anyone on this machine may read the "
              "tenants' tokens from it; chmod 600 %s", what, path, stat.S_IMODE(mode), path)
  return True


def load(path: str) -> Pool:
  """The pool in the YAML file ``path``, checked.

  Raises:
    OSError: the file (or a token file it names) cannot be read.
    InvalidArgumentError: the file is malformed; the message names the line.
  """
  warn_if_readable(path, "pool file")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    node = yaml.compose(text, Loader=yaml.SafeLoader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    raise _error(path, mark.line + 1 if mark else 0,
                 f"not YAML: {getattr(e, 'problem', e)}") from None
  if not isinstance(node, yaml.MappingNode):
    raise _error(path, node.start_mark.line + 1 if node else 1,
                 "a pool file is a mapping with 'tenants: [...]'")
  top = _mapping(path, node, _POOL_KEYS, "the pool file")
  if "tenants" not in top:
    raise _error(path, node.start_mark.line + 1, "the pool file has no 'tenants' list")
  seq = top["tenants"]
  if not isinstance(seq, yaml.SequenceNode) or not seq.value:
    raise _error(path, seq.start_mark.line + 1, "'tenants' must be a non-empty list")
  base = os.path.dirname(os.path.abspath(path))
  tenants: list[Tenant] = []
  for item in seq.value:
    tenant = _tenant(path, item, base)
    line = item.start_mark.line + 1
    for other in tenants:
      if other.name == tenant.name:
        raise _error(path, line, f"tenant name {tenant.name!r} is also the name of the tenant "
                     f"on line {other.line}; each tenant needs a name of its own")
      if other.tls_names & tenant.tls_names:
        raise _error(path, line, f"tenant {tenant.name!r} shares tls_names "
                     f"{sorted(other.tls_names & tenant.tls_names)} with tenant {other.name!r} "
                     f"(line {other.line}); a certificate can belong to one tenant only")
      if other.token and other.token == tenant.token:
        raise _error(path, line, f"tenant {tenant.name!r} has the same token as tenant "
                     f"{other.name!r} (line {other.line}); each tenant needs a token of its "
                     "own, e.g. `openssl rand -hex 32 > FILE`")
    for other in tenants:
      if other.uids & tenant.uids:
        raise _error(path, line, f"tenant {tenant.name!r} shares uids "
                     f"{sorted(other.uids & tenant.uids)} with tenant {other.name!r} (line "
                     f"{other.line}); a user's workers can belong to one tenant only")
    tenants.append(tenant)
  pool = Pool(tenants=tuple(tenants), path=path)
  fractions = sum(t.arena.fraction or 0.0 for t in pool.tenants)
  if fractions > 1.0 + 1e-9:
    raise _error(path, seq.start_mark.line + 1,
                 "the tenants' guaranteed arena shares ("
                 + ", ".join(f"{t.name} {t.arena}" for t in pool.tenants if t.arena.fraction)
                 + f") sum to {fractions:g} of the arena, more than all of it; lower them")
  return pool


def _mapping(path: str, node: yaml.Node, keys: frozenset[str], what: str
             ) -> dict[str, yaml.Node]:
  if not isinstance(node, yaml.MappingNode):
    raise _error(path, node.start_mark.line + 1, f"{what} must be a mapping of keys")
  out: dict[str, yaml.Node] = {}
  for k, v in node.value:
    key = k.value if isinstance(k, yaml.ScalarNode) else None
    line = k.start_mark.line + 1
    if key not in keys:
      raise _error(path, line, f"unknown key {key!r} in {what}; the keys are "
                   f"{', '.join(sorted(keys))} (docs/pool.md)")
    if key in out:
      raise _error(path, line, f"key {key!r} given twice in {what}")
    out[key] = v
  return out


def _scalar(path: str, node: yaml.Node, what: str) -> Any:
  if not isinstance(node, yaml.ScalarNode):
    raise _error(path, node.start_mark.line + 1, f"{what} must be a single value")
  return yaml.safe_load(yaml.serialize(node))


def _tenant(path: str, node: yaml.Node, base: str) -> Tenant:
  line = node.start_mark.line + 1
  m = _mapping(path, node, _TENANT_KEYS, f"a tenant (line {line})")
  name = _scalar(path, m["name"], "name") if "name" in m else None
  if not isinstance(name, str) or not name or not all(c.isalnum() or c in "._-" for c in name):
    raise _error(path, line, f"a tenant's name is letters, digits, '.', '_' or '-', got "
                 f"{name!r}")
  where = f"tenant {name!r}"

  def at(key: str) -> int:
    return m[key].start_mark.line + 1

  def count(key: str, least: int) -> int | None:
    if key not in m:
      return None
    v = _scalar(path, m[key], key)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
      raise _error(path, at(key), f"{where}: {key} must be an int >= {least}, got {v!r}")
    return v

  def share(key: str) -> Share | None:
    if key not in m:
      return None
    v = _scalar(path, m[key], key)
    if isinstance(v, float) and 0 < v <= 1:
      return Share(fraction=v)
    try:
      n = None if isinstance(v, (bool, float)) else shm.parse_size(v)
    except ValueError:
      n = None
    if n is None or n < 0:
      raise _error(path, at(key), f"{where}: {key} is a fraction of the arena in (0, 1] or a "
                   f"size such as 2GiB, got {v!r}")
    return Share(nbytes=n)

  def names(key: str) -> frozenset[str] | None:
    if key not in m:
      return None
    v = yaml.safe_load(yaml.serialize(m[key]))
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
      raise _error(path, at(key), f"{where}: {key} must be a list of registered names, got "
                   f"{v!r:.100}")
    return frozenset(v)

  tls_names = names("tls_names") or frozenset()
  token_file = _scalar(path, m["token_file"], "token_file") if "token_file" in m else None
  if token_file is None and tls_names:
    token = ""  # its certificate says who it is
  elif not isinstance(token_file, str) or not token_file:
    raise _error(path, line, f"{where} has no token_file: give the file that holds its token "
                 "(`openssl rand -hex 32 > FILE; chmod 600 FILE`), or its tls_names")
  else:
    token_file = os.path.join(base, os.path.expanduser(token_file))
    token = _read_token(path, at("token_file"), where, token_file)
  arena = share("arena") or Share(nbytes=0)
  ceiling = share("arena_ceiling")
  if ceiling is not None and (ceiling.nbytes or 0) < MIN_ARENA and ceiling.fraction is None:
    raise _error(path, at("arena_ceiling"), f"{where}: arena_ceiling {ceiling} is below one "
                 f"batch ({shm.format_size(MIN_ARENA)}); raise it")
  inline = None
  if "inline_bytes" in m:
    s = share("inline_bytes")
    inline = s.nbytes if s is not None else None
    if inline is None or inline < MIN_INLINE:
      raise _error(path, at("inline_bytes"), f"{where}: inline_bytes must be a size of at "
                   f"least {shm.format_size(MIN_INLINE)} (e.g. 256MiB), got "
                   f"{_scalar(path, m['inline_bytes'], 'inline_bytes')!r}")
  roots: tuple[str, ...] = ()
  if "checkpoint_roots" in m:
    v = yaml.safe_load(yaml.serialize(m["checkpoint_roots"]))
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
      raise _error(path, at("checkpoint_roots"), f"{where}: checkpoint_roots must be a list "
                   f"of directories, got {v!r:.100}")
    roots = tuple(os.path.realpath(os.path.join(base, x)) for x in v)
  uids: frozenset[int] = frozenset()
  if "uids" in m:
    v = yaml.safe_load(yaml.serialize(m["uids"]))
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
      raise _error(path, at("uids"), f"{where}: uids must be a list of user ids (ints >= 0), "
                   f"got {v!r:.100}")
    uids = frozenset(v)
  weight = 1.0
  if "weight" in m:
    w = _scalar(path, m["weight"], "weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
      raise _error(path, at("weight"), f"{where}: weight must be a positive number, got {w!r}")
    weight = float(w)
  return Tenant(
      name=name, token=token, token_file=token_file, line=line, arena=arena,
      arena_ceiling=ceiling, sessions=count("sessions", 1), calls=count("calls", 1),
      streams=count("streams", 1), feeds=count("feeds", 1),
      connections=count("connections", 1),
      feed_workers=count("feed_workers", 0), inline_bytes=inline, checkpoint_roots=roots,
      functions=names("functions"), pipelines=names("pipelines"), weight=weight, uids=uids,
      tls_names=tls_names)


def _read_token(path: str, line: int, where: str, token_file: str) -> str:
  try:
    with open(token_file, encoding="utf-8") as f:
      token = f.read().strip()
  except (OSError, UnicodeDecodeError) as e:
    raise _error(path, line, f"{where}: cannot read its token_file {token_file}: "
                 f"{getattr(e, 'strerror', None) or e}") from None
  try:
    options_lib.check_token(token, f"{where}'s token ({token_file})")
  except ValueError as e:
    raise _error(path, line, str(e)) from None
  warn_if_readable(token_file, f"{where}'s token file")
  return token


# ---- at run time ----------------------------------------------------------------------

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
  """

  def __init__(self, pool: Pool | None):
    self._lock = threading.Lock()
    self._pool = pool
    self._tenants: dict[str, Tenant] = pool.by_name() if pool else {}
    self._workers: dict[str, str] = {}  # worker session -> tenant
    self._feeds: dict[str, list[int]] = {}  # tenant -> [feeds, feed workers]
    self.revoked: dict[str, str] = {}  # tenant -> why (its token no longer works)

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
        user no tenant names.
    """
    with self._lock:
      pool = self._pool
    if pool is None:
      return None
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
          "this sidecar serves a pool of tenants (--pool): a worker must present its "
          "tenant's token at attach; set SIDECAR_TOKEN (or SIDECAR_TOKEN_FILE) in the "
          "trainer's environment, pass token= to the Worker, or name its user in the "
          "tenant's uids")
    return None

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

  # feeds
  @contextlib.contextmanager
  def feeding(self, tenant: str | None, workers: int) -> Iterator[None]:
    """Counts a feed of ``tenant`` with ``workers`` processes while the block runs.

    Raises:
      ResourceExhaustedError: the tenant runs as many feeds or feed workers as it may.
    """
    t = self.tenant(tenant)
    if t is None:
      yield
      return
    where = self._where(t)
    with self._lock:
      feeds, procs = self._feeds.setdefault(t.name, [0, 0])
      if t.feeds is not None and feeds >= t.feeds:
        raise errors.ResourceExhaustedError(
            f"tenant {t.name!r} already runs {feeds} feeds, its quota (feeds={t.feeds}, "
            f"{where}); close feeds that are done, or raise its quota")
      if t.feed_workers is not None and procs + workers > t.feed_workers:
        raise errors.ResourceExhaustedError(
            f"tenant {t.name!r} runs {procs} feed worker processes; {workers} more would "
            f"pass its quota (feed_workers={t.feed_workers}, {where}); ask for fewer "
            "workers=, or close feeds that are done")
      self._feeds[t.name] = [feeds + 1, procs + workers]
    try:
      yield
    finally:
      with self._lock:
        counts = self._feeds[t.name]
        counts[0] -= 1
        counts[1] -= workers

  def feed_counts(self) -> Mapping[str, tuple[int, int]]:
    with self._lock:
      return {n: (c[0], c[1]) for n, c in self._feeds.items()}

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
  def of(pool: Pool | None, peer_token: str | None) -> Tokens:
    """The tokens of ``pool`` (None: none; then nothing is asked), and the peers' token."""
    if pool is None:
      return Tokens({}, named=False)
    named = pool.quotas or any(t.name for t in pool.tenants)
    table = {f"Bearer {t.token}".encode(): t.name for t in pool.tenants if t.token}
    if named and peer_token:  # the peer sidecars authenticate with theirs
      table[f"Bearer {peer_token}".encode()] = ""
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
