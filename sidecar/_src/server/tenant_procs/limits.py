"""What the kernel holds a tenant's process to: its limits, taken from the pool file in the
sidecar and applied by the tenant process itself, first thing, before any module of the
user's is imported; then its user (ARCHITECTURE.md, "Tenant processes").

Each limit is a soft and hard rlimit at once (the process cannot raise it back):

- ``RLIMIT_NOFILE``: its ``open_files`` and ``OWN_FILES`` more, its own (the interpreter's,
  its sockets, its arenas' memfds);
- ``RLIMIT_DATA``: its ``memory`` (heap and private mappings; the shared arena is not
  counted);
- ``RLIMIT_FSIZE``: its ``tmp_bytes`` (each file; ``SIGXFSZ`` ignored, so a write past it
  fails with ``EFBIG`` instead of killing the process);
- ``RLIMIT_NPROC``: its ``processes``, where it runs as a ``uid`` of its own (the count is
  the user's: with the sidecar's user it would count the sidecar's threads too);
- ``RLIMIT_CORE``: 0 (no core file holds a tenant's memory);
- its user and group: its ``uid`` and ``gid``, where it has them (the sidecar starts it
  as itself; it changes user once the operator's modules are imported, before anything
  a tenant sends reaches it: :meth:`ProcessLimits.become`);
- its ``nice``: from its ``weight`` (CPU by weight, as the scheduler shares it).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import resource
import signal
from typing import Any

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

# Descriptors a tenant process holds of its own beside its pipelines' files: the
# interpreter's and its libraries', its control and job sockets, its arenas' memfds.
OWN_FILES = 128
# The scheduler's weight of one nice level (CFS: about 1.25x a level): a tenant of half
# another's weight runs about 3 levels nicer.
_NICE_STEP = 1.25
MAX_NICE = 19
# What a library says where a process's descriptor table is full, beside EMFILE (an
# ArrayRecord reader's C++ RuntimeError, say).
_NO_FILES = "Too many open files"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcessLimits:
  """A tenant process's limits, and what set each (for the error that names it).

  ``whys``: for each pool-file key (``open_files``, ``memory``, ``tmp_bytes``,
  ``processes``), what set its value (``memory=4.0 GiB, its default (pool.yaml:3)``).
  ``processes`` None: no ``RLIMIT_NPROC`` (no ``uid`` of its own).
  """
  tenant: str
  open_files: int
  memory: int
  tmp_bytes: int
  processes: int | None
  nice: int
  uid: int | None
  gid: int | None
  whys: tuple[tuple[str, str], ...] = ()

  @classmethod
  def of(cls, tenant: tenants_lib.Tenant, pool: tenants_lib.Pool) -> ProcessLimits:
    """``tenant``'s limits in ``pool`` (a pool file's)."""
    files = quotas_lib.OPEN_FILES.limit(tenant, pool, total=quotas_lib.open_files_total())
    memory = quotas_lib.MEMORY.limit(tenant, pool)
    tmp = quotas_lib.TMP_BYTES.limit(tenant, pool)
    processes = quotas_lib.PROCESSES.limit(tenant, pool)
    assert files is not None and memory is not None and tmp is not None  # a pool file's
    assert processes is not None
    heaviest = max(t.weight for t in pool.tenants)
    nice = min(MAX_NICE, round(math.log(heaviest / tenant.weight, _NICE_STEP)))
    whys = (("open_files", files.why), ("memory", memory.why), ("tmp_bytes", tmp.why),
            ("processes", processes.why))
    return cls(tenant=tenant.name, open_files=files.most, memory=memory.most,
               tmp_bytes=tmp.most, processes=processes.most if tenant.uid else None,
               nice=nice, uid=tenant.uid, gid=tenant.gid, whys=whys)

  def why(self, key: str) -> str:
    """What set limit ``key`` (``memory=4.0 GiB, pool.yaml:3``)."""
    return dict(self.whys).get(key, key)

  def exhausted(self, key: str, what: str) -> errors.ResourceExhaustedError:
    """The error of a tenant whose process met its limit ``key`` (``what`` happened)."""
    fix = {"open_files": "close feeds that are done, read fewer files at once, or ask the "
                         "pool's operator to raise its open_files",
           "memory": "use less memory in one process (smaller batches, fewer elements at "
                     "once), or ask the pool's operator to raise its memory",
           "tmp_bytes": "write less to its temporary directory (fewer feeds of TFDS "
                        "datasets at once), or ask the pool's operator to raise its tmp_bytes",
           "processes": "start fewer feed workers and threads, or ask the pool's operator "
                        "to raise its processes"}[key]
    why = self.why(key)
    if not why.startswith(f"{key}="):  # its share by weight: the key and value first
      value = getattr(self, key)
      shown = shm.format_size(value) if key in ("memory", "tmp_bytes") else value
      why = f"{key}={shown}: {why}"
    return errors.ResourceExhaustedError(
        f"tenant {self.tenant!r}'s process {what}: past its limit ({why}); {fix}")

  def typed(self, exc: BaseException) -> BaseException:
    """``exc``, raised in this tenant's process (or one of its feed workers, a RemoteError),
    as the ResourceExhaustedError it is where it says the kernel held the process to a
    limit: its descriptors (``EMFILE``, or a library's "Too many open files"), its memory
    (``MemoryError``), a file's size (``EFBIG``); else as it is."""
    if isinstance(exc, errors.RemoteError):  # a feed worker's (a process of the tenant's)
      kind, text = exc.remote_type, exc.remote_message
    elif isinstance(exc, errors.SidecarError) and not isinstance(
        exc, errors.ResourceExhaustedError):
      return exc
    else:  # user code's; or ours, that met a limit it could not name (data_paths' EMFILE)
      kind, text = type(exc).__name__, str(exc)
    if isinstance(exc, MemoryError) or kind in ("MemoryError", "builtins.MemoryError"):
      return self.exhausted("memory", f"ran out of memory ({kind}: {text[:200]})")
    number = getattr(exc, "errno", None)
    if number == errno.EMFILE or _NO_FILES in text:
      return self.exhausted("open_files", f"has no descriptor left ({kind}: {text[:200]})")
    if isinstance(exc, errors.SidecarError):
      return exc
    if number == errno.EFBIG:
      return self.exhausted("tmp_bytes", f"wrote a file past its size limit "
                            f"({shm.format_size(self.tmp_bytes)}, RLIMIT_FSIZE)")
    return exc

  def to_dict(self) -> dict[str, Any]:
    return {"tenant": self.tenant, "open_files": self.open_files, "memory": self.memory,
            "tmp_bytes": self.tmp_bytes, "processes": self.processes, "nice": self.nice,
            "uid": self.uid, "gid": self.gid, "whys": [list(w) for w in self.whys]}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ProcessLimits:
    """The limits ``to_dict`` wrote (the sidecar's own message to its child: checked for
    form only)."""
    try:
      return cls(tenant=str(d["tenant"]), open_files=int(d["open_files"]),
                 memory=int(d["memory"]), tmp_bytes=int(d["tmp_bytes"]),
                 processes=None if d["processes"] is None else int(d["processes"]),
                 nice=int(d["nice"]), uid=None if d["uid"] is None else int(d["uid"]),
                 gid=None if d["gid"] is None else int(d["gid"]),
                 whys=tuple((str(k), str(v)) for k, v in d["whys"]))
    except (KeyError, TypeError, ValueError) as e:
      raise errors.InvalidArgumentError(f"malformed process limits: {e!r:.200}") from None

  @property
  def nofile(self) -> int:
    """Its ``RLIMIT_NOFILE``: its pipelines' files and its own."""
    return self.open_files + OWN_FILES

  def apply(self) -> None:
    """Holds this process (a tenant's, started by the sidecar: its first act) to the
    limits, for good: each soft and hard limit set, its nice level raised. A hard limit
    lowered is raised again by privilege only, which it gives up next (:meth:`become`).

    Raises:
      OSError: the kernel refused one (a limit above what this process may have).
    """
    _set(resource.RLIMIT_NOFILE, self.nofile)
    _set(resource.RLIMIT_DATA, self.memory)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    _set(resource.RLIMIT_FSIZE, self.tmp_bytes)
    _set(resource.RLIMIT_CORE, 0)
    if self.processes is not None:
      _set(resource.RLIMIT_NPROC, self.processes)
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if self.nice > now:  # only ever nicer: lowering it needs privilege
      os.setpriority(os.PRIO_PROCESS, 0, self.nice)

  def become(self) -> None:
    """Runs this process as the tenant's user and group from now on, where it has a
    ``uid``: no supplementary group, every id of the process (none is ever taken back).
    Called once the operator's modules are imported (the sidecar imported them as its
    own user too) and before anything a tenant sends reaches the process.

    Its credentials changed, the kernel marks it not dumpable: another process of the same
    user may neither trace it nor read its memory (``/proc/PID/mem``), nor its files under
    ``/proc/PID``.

    Raises:
      OSError: the kernel refused (a user this process may not become).
    """
    if self.uid is None:
      return
    os.setgroups([])
    gid = self.gid if self.gid is not None else self.uid
    os.setresgid(gid, gid, gid)
    os.setresuid(self.uid, self.uid, self.uid)


def _set(which: int, most: int) -> None:
  """Sets rlimit ``which`` to ``most`` (soft and hard), within the hard limit it has."""
  _, hard = resource.getrlimit(which)
  if hard != resource.RLIM_INFINITY:
    most = min(most, hard)
  resource.setrlimit(which, (most, most))
