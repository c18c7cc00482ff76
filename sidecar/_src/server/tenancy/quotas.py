"""A pool tenant's quotas, one policy object each.

A quota is declared once here: its pool-file key, how its value reads (and its least),
what a tenant without it gets (nothing, or its share by ``weight`` of the sidecar's total),
and, for a share of the arena, its check against the arena's size. ``pool_file`` reads every
quota in :data:`ALL` from a tenant's mapping into ``Tenant.quotas``; each part that enforces
one is handed its object and asks it (``CALLS.limit(...)``, ``RAM_TIER.bytes_of(...)``):
no part reads a tenant's fields by name or is subclassed for a quota.

Adding a quota (docs/pool.md, "Adding a quota"): one object here, added to ``ALL``; the
part it governs asks it; its row in docs/pool.md's table of keys.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import os
import resource
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from sidecar._src.arena import shm
from sidecar._src.core import errors

# A tenant's arena ceiling is one batch at least: below this nothing useful fits.
MIN_ARENA = 1 << 20
# The least ``inline_bytes`` a tenant may have: a call's small arguments travel inline.
MIN_INLINE = 64 << 10
# The CPUs a sidecar's feed worker processes may use (at least 2, at most 64): the most one
# feed may ask for, and a pool tenant's feed workers without its own ``feed_workers``.
CPUS = min(64, max(2, len(os.sched_getaffinity(0))))
# What the tenants' temporary directories share without their own ``tmp_bytes``: half of the
# 256 MiB the Kubernetes manifests give a sidecar's /tmp (docs/kubernetes.md).
TMP_TOTAL = 128 << 20
# ram_keep's units: a number is seconds; a string may end in one of these.
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Holder(Protocol):
  """What a quota is read from: a tenant (``tenants.Tenant``)."""

  @property
  def name(self) -> str: ...

  @property
  def weight(self) -> float: ...

  @property
  def quotas(self) -> Mapping[str, Any]: ...


class Pooled(Protocol):
  """What a share by weight is drawn from: the pool (``tenants.Pool``)."""

  @property
  def tenants(self) -> tuple[Any, ...]: ...

  @property
  def quotas(self) -> bool: ...

  def where(self, tenant: Any) -> str: ...


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


@dataclasses.dataclass(frozen=True, slots=True)
class Limit:
  """A quota resolved for one tenant: the most it may hold, and what sets it (for
  messages: ``calls=4, pool.yaml:3`` or ``its share by weight of 28, pool.yaml:3``)."""
  most: int
  why: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Quota(abc.ABC):
  """One key of a tenant in the pool file that bounds what it may hold or keep."""
  key: str
  default: Any = None  # what a tenant without it has (None: no quota of this kind)

  @abc.abstractmethod
  def read(self, value: Any) -> Any:
    """The quota's value from the YAML ``value``.

    Raises:
      ValueError: naming the key, what it takes and the value (the caller adds the line).
    """

  def of(self, tenant: Holder) -> Any:
    """``tenant``'s value of this quota (``default`` where it has none)."""
    return tenant.quotas.get(self.key, self.default)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Count(Quota):
  """How many of a thing a tenant may hold at once (sessions, calls, feeds...).

  ``share_of``: what a pool file's tenant without it gets its share by weight of (the
  sidecar's total of that kind, named in messages); None: nothing, no quota.
  """
  least: int = 1
  share_of: str | None = None

  def read(self, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < self.least:
      raise ValueError(f"{self.key} must be an int >= {self.least}, got {value!r}")
    return value

  def limit(self, tenant: Holder, pool: Pooled | None, *, total: int | None = None,
            total_name: str | None = None) -> Limit | None:
    """The most ``tenant`` may hold at once and what sets it: its quota, else (a pool
    file's tenant, ``share_of``) its share by weight of ``total``; None: no bound."""
    where = pool.where(tenant) if pool is not None else "the sidecar's tokens"
    mine = tenant.quotas.get(self.key)
    if mine is not None:
      return Limit(mine, f"{self.key}={mine}, {where}")
    if self.default is not None and pool is not None and pool.quotas:
      return Limit(self.default, f"{self.key}={self.default}, its default ({where})")
    if self.share_of is None or total is None or pool is None or not pool.quotas:
      return None
    weights = sum(t.weight for t in pool.tenants)
    name = total_name if total_name is not None else self.share_of
    return Limit(max(1, int(total * tenant.weight / weights)),
                 f"its share by weight of {f'{name}=' if name else ''}{total}, {where}")


class Held:
  """What each tenant holds of one :class:`Count` quota's things at once; past its limit,
  a tenant's next is refused (``ResourceExhaustedError``), never another tenant's.

  The part a count quota governs makes one and holds each thing through it, e.g.::

      feeds = quotas.Held(quotas.FEEDS, "feeds", lambda: tenancy.pool,
                          fix="close feeds that are done, or raise its quota")
      with feeds.hold(tenant):  # a Tenant, or None: nobody's, no bound
        ...

  Args:
    quota: the quota it holds tenants to.
    what: the things counted, as messages name them ("feeds").
    pool: the pool in force (its tenants' weights, where each is named).
    fix: what a refused tenant may do.
    total: the sidecar's total of the things, of which a pool file's tenant without the
      quota gets its share by weight (``Count.share_of``); None: no share.
  """

  def __init__(self, quota: Count, what: str, pool: Callable[[], Pooled | None], *, fix: str,
               total: int | None = None):
    self.quota, self.what, self._pool, self._fix, self._total = quota, what, pool, fix, total
    self._lock = threading.Lock()
    self._held: collections.Counter[str] = collections.Counter()

  @contextlib.contextmanager
  def hold(self, tenant: Holder | None, n: int = 1) -> Iterator[None]:
    """Counts ``n`` things of ``tenant`` while the block runs.

    Raises:
      ResourceExhaustedError: they would pass the tenant's limit; naming it and the fix.
    """
    if tenant is None:
      yield
      return
    limit = self.quota.limit(tenant, self._pool(), total=self._total)
    with self._lock:
      held = self._held[tenant.name]
      if limit is not None and held + n > limit.most:
        raise errors.ResourceExhaustedError(
            f"tenant {tenant.name!r} holds {held} {self.what}; {n} more would pass its quota "
            f"({limit.why}); {self._fix}")
      self._held[tenant.name] = held + n
    try:
      yield
    finally:
      with self._lock:
        self._held[tenant.name] -= n

  def counts(self) -> dict[str, int]:
    """What each tenant that held any holds now (0 once its things are gone)."""
    with self._lock:
      return dict(self._held)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Size(Quota):
  """Bytes a tenant may hold (a size such as ``500GiB``; not a fraction of the arena).

  ``share_of``: bytes of which a pool file's tenant without it gets its share by weight
  (:meth:`limit`); None: its ``default``, or no quota.
  """
  least: int
  example: str
  share_of: int | None = None

  def read(self, value: Any) -> int:
    share = ArenaShare(key=self.key).read(value)
    if share.nbytes is None or share.nbytes < self.least:
      raise ValueError(f"{self.key} must be a size of at least {shm.format_size(self.least)} "
                       f"(e.g. {self.example}), got {value!r}")
    return share.nbytes

  def limit(self, tenant: Holder, pool: Pooled | None) -> Limit | None:
    """The most bytes ``tenant`` may hold and what sets it: its quota, else its default,
    else (a pool file's tenant, ``share_of``) its share by weight; None: no bound."""
    where = pool.where(tenant) if pool is not None else "the sidecar's tokens"
    fmt = shm.format_size
    mine = tenant.quotas.get(self.key)
    if mine is not None:
      return Limit(mine, f"{self.key}={fmt(mine)}, {where}")
    if pool is None or not pool.quotas:
      return None
    if self.default is not None:
      return Limit(self.default, f"{self.key}={fmt(self.default)}, its default ({where})")
    if self.share_of is None:
      return None
    weights = sum(t.weight for t in pool.tenants)
    most = max(self.least, int(self.share_of * tenant.weight / weights))
    return Limit(most, f"{self.key}={fmt(most)}, its share by weight of "
                 f"{fmt(self.share_of)}, {where}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArenaShare(Quota):
  """A share of the arena: a fraction of it in (0, 1] or a size; at most all of it.

  ``least``: the least bytes a size may be (a fraction is checked once the arena's size is
  known, :meth:`check`); ``fix``: what the message of one above the arena advises.
  """
  least: int = 0
  fix: str = "; lower it"

  def read(self, value: Any) -> Share:
    share = None
    if isinstance(value, float) and 0 < value <= 1:
      share = Share(fraction=value)
    else:
      try:
        n = None if isinstance(value, (bool, float)) else shm.parse_size(value)
      except ValueError:
        n = None
      if n is not None and n >= 0:
        share = Share(nbytes=n)
    if share is None:
      raise ValueError(f"{self.key} is a fraction of the arena in (0, 1] or a size such as "
                       f"2GiB, got {value!r}")
    if share.fraction is None and (share.nbytes or 0) < self.least:
      raise ValueError(f"{self.key} {share} is below one batch "
                       f"({shm.format_size(self.least)}); raise it")
    return share

  def bytes_of(self, tenant: Holder, arena: int) -> int | None:
    """``tenant``'s share in bytes of an arena of ``arena`` bytes; None: no quota."""
    share = self.of(tenant)
    return None if share is None else share.bytes_of(arena)

  def check(self, tenant: Holder, arena: int) -> str | None:
    """Why ``tenant``'s share does not fit an arena of ``arena`` bytes; None: it fits."""
    n = self.bytes_of(tenant, arena)
    if n is None or n <= arena:
      return None
    return (f"tenant {tenant.name!r}: {self.key} {self.of(tenant)} is more than the whole "
            f"arena ({shm.format_size(arena)}, --shm-size){self.fix}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Duration(Quota):
  """Seconds: a number, or a string such as ``90s``, ``10m``, ``2h``."""

  def read(self, value: Any) -> float:
    seconds = _duration(value)
    if seconds is None:
      raise ValueError(f"{self.key} is seconds >= 0 or a duration such as 90s, 10m or 2h, "
                       f"got {value!r}")
    return seconds


def open_files_total() -> int:
  """The open files the tenants' pipelines share (``OPEN_FILES``): half of this process's
  descriptor limit (its soft RLIMIT_NOFILE, which the sidecar raises at its start); the
  other half stays the server's own (its connections, arena, checkpoints)."""
  return max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


def _duration(v: Any) -> float | None:
  """Seconds from a number or a string such as ``90s``, ``10m``, ``2h``; None if neither."""
  if isinstance(v, bool):
    return None
  if isinstance(v, str) and v[-1:] in _DURATION_UNITS:
    scale, v = _DURATION_UNITS[v[-1]], v[:-1]
    try:
      v = float(v)
    except ValueError:
      return None
    v *= scale
  if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
    return None
  return float(v)


# ---- the quotas (docs/pool.md, "The pool file") ----------------------------------------

# Guaranteed: no other tenant may allocate the share of it this tenant does not use yet.
ARENA = ArenaShare(key="arena", default=Share(nbytes=0))
# The most arena bytes it may hold at once; also the size of its own arena (memfd).
ARENA_CEILING = ArenaShare(key="arena_ceiling", least=MIN_ARENA,
                          fix="; lower it, or leave it out for no ceiling")
# Handshake sessions kept at once.
SESSIONS = Count(key="sessions", share_of="max_sessions")
# Unary calls at once, all its sessions and workers together.
CALLS = Count(key="calls", share_of="")
# gRPC streams at once.
STREAMS = Count(key="streams", share_of="")
# The Checkpoint service's rpcs at once: no key of the pool file, its share by weight only.
CHECKPOINT_RPCS = Count(key="checkpoint rpcs", share_of="")
# Feeds at once; feed worker processes at once, all its feeds together.
FEEDS = Count(key="feeds")
FEED_WORKERS = Count(key="feed_workers", least=0, default=CPUS)
# Files its feeds' pipelines hold open at once in one process (readers' files, TFDS views'),
# all its feeds together; a pool file's tenant without it: its share by weight of
# ``open_files_total()``.
OPEN_FILES = Count(key="open_files", share_of="open files (half the sidecar's RLIMIT_NOFILE)")
# Worker-socket connections at once (its Workers' attach, stream and call connections).
CONNECTIONS = Count(key="connections", share_of="max_worker_connections")
# Bytes of large inline calls decoded at once.
INLINE_BYTES = Size(key="inline_bytes", least=MIN_INLINE, example="256MiB")
# How long the RAM-tier copies of its steps stay after its job left.
RAM_KEEP = Duration(key="ram_keep")
# Bytes of RAM-tier copies of its committed steps kept at once (own and replicas held).
RAM_TIER = ArenaShare(key="ram_tier", fix=", which holds the RAM tier; lower it")
# Bytes its checkpoint directories may hold on a sidecar's storage.
CHECKPOINT_BYTES = Size(key="checkpoint_bytes", least=MIN_ARENA, example="500GiB")
# What its worker sessions append to their goodput ledgers, all together: bytes a second on
# average, and at once; without them, the sidecar's (``goodput.ledgers.RATE_BYTES_S``,
# ``BURST_BYTES``: 4 KiB/s, 64 KiB).
LEDGER_BYTES_PER_S = Size(key="ledger_bytes_per_s", least=1 << 10, example="16KiB")
LEDGER_BURST_BYTES = Size(key="ledger_burst_bytes", least=4 << 10, example="256KiB")

# What its processes may take (server/tenant_procs/limits.py, applied by the kernel): each
# process's memory (RLIMIT_DATA: heap and private mappings; the shared arena is not counted);
# its temporary directory, files and directories together (each file RLIMIT_FSIZE too; the
# total measured by the sidecar), without it its share by weight of TMP_TOTAL; the processes
# and threads its user runs at once (RLIMIT_NPROC, where it has a uid of its own).
MEMORY = Size(key="memory", least=128 << 20, example="4GiB", default=4 << 30)
TMP_BYTES = Size(key="tmp_bytes", least=1 << 20, example="256MiB", share_of=TMP_TOTAL)
PROCESSES = Count(key="processes", least=16, default=512)

# Every quota a pool file's tenant may have, in the order the file's keys are read.
ALL: tuple[Quota, ...] = (ARENA, ARENA_CEILING, SESSIONS, CALLS, STREAMS, FEEDS, FEED_WORKERS,
                          OPEN_FILES,
                          CONNECTIONS, INLINE_BYTES, RAM_KEEP, RAM_TIER, CHECKPOINT_BYTES,
                          LEDGER_BYTES_PER_S, LEDGER_BURST_BYTES, MEMORY, TMP_BYTES, PROCESSES)
BY_KEY: Mapping[str, Quota] = {q.key: q for q in ALL}
# The parts of the arena, checked against its size once it is known (``Pool.check_arena``).
ARENA_SHARES: tuple[ArenaShare, ...] = tuple(q for q in ALL if isinstance(q, ArenaShare))
