"""A pool's policies: what its tenants may run, and where and how much they checkpoint.

The call runner and the checkpoint store are each handed one (``policies.CallPolicy``,
``policies.CheckpointPolicy``) by the server: these hold the tenants to their allowlists
and checkpoint quotas (``tenants.py`` is who is whose; these only enforce it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import direct_io, registry as formats_lib
from sidecar._src.core import errors, paths
from sidecar._src.server import policies
from sidecar._src.server.pool import shares as shares_lib
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

# Pieces of files (direct_io.TURN_BYTES) the saves of a pool's tenants write at once on
# one sidecar: two large direct writes keep a disk busy (benchmarks/pool_writes.py: three
# equal tenants write as fast as with no turns), and a tenant that asks for one gets half
# the storage at once whatever the others ask (three gave a hog a third always).
WRITE_TURNS = 2
# Where a format writes a save beside its directory instead of in it (DCP's).
_TMP_SUFFIXES = tuple(f.tmp_suffix for f in formats_lib.DEFAULT.formats.values())


class TenantCalls(policies.CallPolicy):
  """Runs a function only if the tenant it runs for (``tenants.CURRENT``, set by the way
  in) may: its ``functions`` (or ``pipelines``) allowlist, and only with the arena of a
  worker of its own."""

  def __init__(self, tenancy: tenants_lib.Tenancy):
    self._tenancy = tenancy

  def check(self, kind: str, name: str, worker_session: str) -> None:
    tenant = tenants_lib.CURRENT.get()
    self._tenancy.check_allowed(tenant, kind, name)
    self._tenancy.check_worker(tenant, worker_session)


class TenantCheckpoints(policies.CheckpointPolicy):
  """Holds each pool tenant to its checkpoint quotas:

  - ``checkpoint_roots``: it opens and acts in checkpoint directories under those only (the
    sidecar's roots still hold for everyone; the roots in force at each call, so a reload
    that narrows them holds at once), and never in, at or above another tenant's root;
  - ``ram_tier``: the RAM-tier copies of the committed steps of the directories it opened
    keep within it together (the RAM tier's group of those directories), newest first;
  - ``checkpoint_bytes``: a part of a save is refused where what its directories hold on
    this sidecar's storage, with what its saves here have still to write, would pass it;
    checked and reserved under one lock (``storage_reserved``), a step's pending bytes
    counted by its tmp directory as the server derived it, not by a field the client sent;
  - ``weight``: its saves write in turns at the storage (``write_bandwidth``, max-min fair
    by weight among the tenants writing: ``shares.Bandwidth``).

  ``arena_bytes``: the arena's size (``ram_tier`` may be a fraction of it);
  ``tenant_of``: the tenant of a handshake session (a save's owner).
  """

  def __init__(self, tenancy: tenants_lib.Tenancy, *, arena_bytes: int = 0,
               tenant_of: Callable[[str], str | None] = lambda session: None):
    self._tenancy = tenancy
    self._arena_bytes = arena_bytes
    self._tenant_of = tenant_of
    self.write_bandwidth = shares_lib.Bandwidth(WRITE_TURNS)
    self._storage_locks: dict[str, threading.Lock] = {}  # by tenant: check and reserve

  def write_turn(self, owner: str) -> direct_io.Turn | None:
    t = self._tenancy.tenant(self._tenant_of(owner)) if self._tenancy.quotas else None
    return None if t is None else functools.partial(self.write_bandwidth.turn, t.name,
                                                    weight=t.weight)

  def ram_budget(self, group: str) -> int | None:
    t = self._tenancy.tenant(group)
    return None if t is None else quotas_lib.RAM_TIER.bytes_of(t, self._arena_bytes)

  def ram_group(self, client: str) -> str | None:
    t = self._tenancy.tenant(client)
    return t.name if t is not None and self._tenancy.quotas else None

  def _check_roots(self, t: tenants_lib.Tenant | None, path: str, name: str) -> None:
    """PermissionDeniedError unless ``path`` lies under ``t``'s checkpoint roots (in force
    now: a reload that narrowed them holds at the next call of an open directory)."""
    if t is not None and t.checkpoint_roots and isinstance(path, str):
      resolved = os.path.realpath(path)
      if not any(paths.inside(resolved, r) for r in t.checkpoint_roots):
        raise errors.PermissionDeniedError(
            f"tenant {t.name!r} may checkpoint only under its checkpoint_roots "
            f"({', '.join(t.checkpoint_roots)}, {self._tenancy.where(t.name)}), not in "
            f"{name} {path!r:.200}; checkpoint there, or add the directory to its roots")

  def check_open(self, store: policies.Store, client: str, directory: str) -> None:
    self._check_roots(self._tenancy.tenant(client), directory, "directory")
    if isinstance(directory, str) and (pool := self._tenancy.pool) is not None:
      resolved = os.path.realpath(directory)
      for other in pool.tenants:  # another's root, or a directory that holds it, is not ours
        held = [r for r in other.checkpoint_roots if paths.overlap(r, resolved)]
        if other.name != client and held:
          how = ("is" if resolved == held[0] else
                 "lies in" if paths.inside(resolved, held[0]) else "holds")
          raise errors.PermissionDeniedError(
              f"checkpoint directory {directory!r:.200} {how} {held[0]!r:.200}, a checkpoint "
              f"root of tenant {other.name!r} ({self._tenancy.where(other.name)}); checkpoint "
              "in a directory of your own, beside the other tenants' roots, not in or above "
              "them")

  def clients_mode(self) -> str | None:
    pool = self._tenancy.pool
    return None if pool is None else pool.mode()

  def replica_owner(self, tenant: str | None, directory: str) -> str | None:
    """A replica is some tenant of the pool's, in its checkpoint roots; its committed
    copies count in that tenant's RAM-tier group here (``ram_tier``), whether or not the
    tenant opened the directory on this host."""
    if not self._tenancy.quotas:
      return None
    t = self._tenancy.tenant(tenant)
    if t is None:
      raise errors.PermissionDeniedError(
          f"a replica of {directory!r:.200} for tenant {tenant!r}, which is not in this "
          f"sidecar's pool ({self._tenancy.where(tenant or '')}): every replica is a "
          "tenant's; give every sidecar of the pool the same pool file")
    return t.name  # its roots, its directories, its RAM-tier group

  def check_path(self, client: str, path: str, name: str) -> None:
    self._check_roots(self._tenancy.tenant(client), path, name)

  @contextlib.contextmanager
  def storage_reserved(self, store: policies.Store, client: str | None, directory: str,
                       nbytes: int) -> Iterator[None]:
    t = self._tenancy.tenant(client)
    if t is None or quotas_lib.CHECKPOINT_BYTES.of(t) is None:
      yield
      return
    with self._storage_locks.setdefault(t.name, threading.Lock()):
      self.check_storage(store, client, directory, nbytes)
      yield  # the Stage records its bytes (a pending step's) before the next check

  def check_storage(self, store: policies.Store, client: str | None, directory: str,
                    nbytes: int) -> None:
    t = self._tenancy.tenant(client)
    quota = None if t is None else quotas_lib.CHECKPOINT_BYTES.of(t)
    if t is None or quota is None:
      return
    mine = {os.path.realpath(d) for d in store.opened_by(t.name)}
    outer = [d for d in mine if not any(paths.beneath(d, o) for o in mine)]
    stored = sum(_stored(d) for d in outer)  # a directory inside another is counted there
    writing = store.writing()  # staged here, not yet on storage
    # A step counts where the server put it (its resolved tmp directory), whatever
    # directory its Stage named; what of it is on storage already is counted there.
    pending = sum(max(n - _stored(d, siblings=False), 0) for d, n in writing
                  if any(paths.inside(d, m) for m in outer))
    total = stored + pending + nbytes
    if total > quota or (nbytes == 0 and stored >= quota):
      fmt = shm.format_size
      held = (f"tenant {t.name!r} holds {fmt(stored)} of checkpoints on the storage of host "
              f"{store.host_id}" + (f", {fmt(pending)} more being written" if pending else ""))
      limit = f"checkpoint_bytes={fmt(quota)}, {self._tenancy.where(t.name)}"
      if nbytes:  # the bytes past the quota, not only those asked for
        why = (f"; {fmt(nbytes)} more of step data in {directory!r:.200} would bring it to "
               f"{fmt(total)}, {fmt(total - quota)} past its quota ({limit})")
      else:  # a Begin (nothing asked yet), and the quota full or passed already
        why = ((f", {fmt(total - quota)} past its quota ({limit})" if total > quota
                else f", all of its quota ({limit})")
               + f": no more step data may be written in {directory!r:.200} until it holds "
               "less")
      raise errors.ResourceExhaustedError(
          f"{held}{why}; keep fewer steps (max_to_keep=), delete old ones, or raise its quota")


def _stored(directory: str, *, siblings: bool = True) -> int:
  """The bytes of the files under ``directory`` and (``siblings``) beside it in uncommitted
  step directories of it (a DCP save's ``<directory>.dcp-checkpoint-tmp``)."""
  total = 0
  stack = [directory, *(directory + suffix for suffix in _TMP_SUFFIXES if siblings)]
  while stack:
    try:
      entries = os.scandir(stack.pop())
    except OSError:  # gone meanwhile, or never made
      continue
    with entries:
      for entry in entries:
        try:
          if entry.is_dir(follow_symlinks=False):
            stack.append(entry.path)
          elif entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
        except OSError:
          continue
  return total
