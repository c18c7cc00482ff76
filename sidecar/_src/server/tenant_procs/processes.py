"""A pool sidecar's tenant processes: one per tenant, started at its first job, restarted
after a death, stopped at a reload that removes the tenant and at the sidecar's stop; and
the thread that watches them (ARCHITECTURE.md, "Tenant processes").

:class:`TenantProcesses` is the sidecar's ``isolation.Isolation`` with a pool file: the
call and stream runners ask it for a tenant's work (``jobs.Work``) and it runs there. Its
watcher measures each process's temporary directory every ``tmp.MEASURE_S`` and stops a
process past its ``tmp_bytes`` (its jobs fail naming the limit), reaps a process that died,
and stops one whose limits a reload changed once its last job ended.
"""

from __future__ import annotations

import logging
import threading

from sidecar._src.core import errors
from sidecar._src.server import isolation
from sidecar._src.server.arenas.arena_io import ArenaIO
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.server.tenant_procs import jobs, limits as limits_lib, tmp as tmp_lib
from sidecar._src.server.tenant_procs.process import State, TenantProcess
from sidecar._src.user import registry as registry_lib

log = logging.getLogger(__name__)


def imports_of(imports: tuple[str, ...], registry: registry_lib.Registry) -> tuple[str, ...]:
  """The modules a tenant's process imports: the sidecar's ``--import`` (``imports``), and
  those its ``registry``'s functions and pipelines live in (an in-process sidecar's
  registry)."""
  found = [*imports]
  for entry in registry:
    module = getattr(entry.fn, "__module__", None)
    if module and module != "__main__" and module not in found:
      found.append(module)
  return tuple(found)


class TenantProcesses(isolation.Isolation):
  """The tenant processes of one pool sidecar; ``close`` stops them all.

  Args:
    tenancy: the pool in force (its tenants, their limits).
    arena_io: the sidecar's arenas' blocks, which the jobs are given from.
    imports: the modules a tenant process imports (the sidecar's ``--import`` and those
      its registry's entries live in).
    inline_limit: arrays up to this many bytes travel in a message, not the arena.
    limit: the most bytes of a response or an item (the sidecar's max_message_size).
    tmp_parent: where the tenants' temporary directories are made (the sidecar's
      temporary directory by default).
  """

  def __init__(self, tenancy: tenants_lib.Tenancy, arena_io: ArenaIO, *,
               imports: tuple[str, ...], inline_limit: int, limit: int,
               tmp_parent: str | None = None):
    self._tenancy = tenancy
    self._io = arena_io
    self._imports = imports
    self._inline_limit = inline_limit
    self._limit = limit
    self._tmp = tmp_lib.TmpBase(tmp_parent)
    self._lock = threading.Lock()
    self._procs: dict[str, TenantProcess] = {}
    self._retiring: list[TenantProcess] = []  # a reload changed their limits: once idle, go
    self._starting: dict[str, threading.Lock] = {}  # one start at a time per tenant
    self._closed = threading.Event()
    self._watcher = threading.Thread(target=self._watch, name="sidecar-tenant-watch",
                                     daemon=True)
    self._watcher.start()

  def work_of(self, tenant: str | None) -> jobs.Work | None:
    """``tenant``'s work in its process; None for no pool tenant (run here)."""
    if tenant is None or not self._tenancy.quotas or self._tenancy.tenant(tenant) is None:
      return None
    return jobs.Work(lambda: self.process(tenant), self._io, inline_limit=self._inline_limit,
                     limit=self._limit, imports=self._imports)

  def process(self, tenant: str) -> TenantProcess:
    """``tenant``'s process, running: the one it has, else a new one (started, waited for).

    Raises:
      ClosedError: the sidecar is stopping. AuthenticationError: no such tenant now.
      What the new process's start raised (a limit named, an import that failed).
    """
    with self._lock:
      if self._closed.is_set():
        raise errors.ClosedError("the sidecar is stopping: no tenant process starts")
      starting = self._starting.setdefault(tenant, threading.Lock())
    with starting:
      t = self._tenancy.tenant(tenant)
      pool = self._tenancy.pool
      if t is None or pool is None:
        raise errors.AuthenticationError(f"tenant {tenant!r} is not in the pool file now")
      limits = limits_lib.ProcessLimits.of(t, pool)
      with self._lock:
        current = self._procs.get(tenant)
      if current is not None:
        if current.state is State.RUNNING and current.alive() and current.limits == limits:
          return current
        self._let_go(tenant, current)
      proc = TenantProcess(limits, imports=self._imports, tmp_base=self._tmp).start()
      with self._lock:
        if self._closed.is_set():
          closing = True
        else:
          closing = False
          self._procs[tenant] = proc
      if closing:
        proc.stop()
        raise errors.ClosedError("the sidecar is stopping: no tenant process starts")
      return proc

  def _let_go(self, tenant: str, proc: TenantProcess) -> None:
    """``proc`` is ``tenant``'s no more: stopped now if it is dead or idle, else once its
    last job ends (a reload changed its limits; its jobs keep theirs)."""
    with self._lock:
      if self._procs.get(tenant) is proc:
        del self._procs[tenant]
      if proc.alive() and proc.jobs > 0:
        self._retiring.append(proc)
        return
    proc.stop()

  def revoke(self, tenant: str, why: str) -> None:
    """Stops ``tenant``'s process at once (a reload removed the tenant, or changed its
    token): its jobs in flight fail with ``why``."""
    with self._lock:
      proc = self._procs.pop(tenant, None)
    if proc is not None:
      proc.stop(errors.AuthenticationError(why))

  def pids(self) -> dict[str, int]:
    """Each tenant's running process's pid (for Status, tests)."""
    with self._lock:
      return {t: p.pid for t, p in self._procs.items() if p.state is State.RUNNING}

  def _watch(self) -> None:
    while not self._closed.wait(tmp_lib.MEASURE_S):
      with self._lock:
        procs = list(self._procs.items())
        retiring = list(self._retiring)
      for tenant, proc in procs:
        try:
          self._check(tenant, proc)
        except Exception:  # the watch goes on for the others
          log.exception("watching tenant %r's process", tenant)
      for proc in retiring:
        if proc.jobs <= 0 or not proc.alive():
          with self._lock:
            if proc in self._retiring:
              self._retiring.remove(proc)
          proc.stop()

  def _check(self, tenant: str, proc: TenantProcess) -> None:
    """Reaps ``proc`` if it died; stops it if its temporary directory holds more than its
    ``tmp_bytes`` (its jobs in flight fail naming the limit; its directory is emptied)."""
    if proc.state is not State.RUNNING:
      return
    if not proc.alive():
      log.warning("tenant %r's process (pid %d) ended: %s", tenant, proc.pid, proc.death())
      self._let_go(tenant, proc)
      return
    most = proc.limits.tmp_bytes
    used = tmp_lib.measure(proc.tmp, most)
    if used > most:
      why = proc.limits.exhausted("tmp_bytes", "held more than its temporary directory may "
                                  f"(more than {most} bytes, files and directories)")
      log.warning("%s; stopping it", why)
      with self._lock:
        if self._procs.get(tenant) is proc:
          del self._procs[tenant]
      proc.stop(why)

  def close(self) -> None:
    """Stops every tenant process and the watcher; removes their directories. Idempotent."""
    with self._lock:
      if self._closed.is_set():
        return
      self._closed.set()
      procs = list(self._procs.values()) + self._retiring
      self._procs, self._retiring = {}, []
    self._watcher.join(10)
    for proc in procs:
      proc.stop()
    self._tmp.close()
