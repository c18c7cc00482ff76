"""Where a pool tenant's pipelines may read, and how many files they may hold open at once.

A feed's pipeline opens its files through ``user/data_paths.DataPath``, bound to its
tenant's :class:`DataRoots`: in a pool (``sidecar serve --pool``) the pool file's
``data_roots`` (else its ``checkpoint_roots``) and its ``open_files`` quota, counted in
each process by :data:`OPEN_FILES`; outside a pool :data:`ANYWHERE`, no bound.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from sidecar._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DataRoots:
  """Where a feed's pipeline may read: beneath ``roots`` only (a pool tenant's, resolved
  absolute directories; empty: nowhere), or, ``roots`` None, wherever the sidecar may.

  ``tenant`` and ``where`` (the pool file's line) are for messages. ``functions``: the
  registered functions its pipeline may look up by a name among its arguments (its
  tenant's ``functions`` allowlist, ``registry.allowing``); None: any. ``open_files``: the
  most files its pipelines may hold open at once in one process, all its feeds together
  (a reader's ``data_paths.DataFile``, a ``DataView``'s files; None: no bound), and
  ``open_files_why`` what sets it (the pool file's ``open_files``, or its share)."""
  roots: tuple[str, ...] | None = None
  tenant: str = ""
  where: str = ""
  functions: tuple[str, ...] | None = None
  open_files: int | None = None
  open_files_why: str = ""

  def __post_init__(self):
    if self.roots is not None and not all(isinstance(r, str) and r.startswith("/")
                                          for r in self.roots):
      raise ValueError(f"data roots must be absolute directories, got {self.roots!r}")

  def describe(self) -> str:
    """``tenant 'bob''s data roots (/data/bob; pool.yaml:5)``, for messages."""
    return (f"tenant {self.tenant!r}'s data roots ({', '.join(self.roots or ()) or 'none'}"
            f"{'; ' + self.where if self.where else ''})")

  def to_dict(self) -> dict[str, Any]:
    return {"roots": None if self.roots is None else list(self.roots),
            "tenant": self.tenant, "where": self.where,
            "functions": None if self.functions is None else list(self.functions),
            "open_files": self.open_files, "open_files_why": self.open_files_why}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> DataRoots:
    roots = d.get("roots")
    functions = d.get("functions")
    most = d.get("open_files")
    return cls(roots=None if roots is None else tuple(roots), tenant=str(d.get("tenant", "")),
               where=str(d.get("where", "")),
               functions=None if functions is None else tuple(map(str, functions)),
               open_files=None if most is None else int(most),
               open_files_why=str(d.get("open_files_why", "")))

  def place(self, path: str) -> tuple[str, str]:
    """``(root, rest)``: the outermost root ``path`` (absolute) lies under and the rest of
    it below that root, compared by components as written; nothing is looked up.

    Raises:
      PermissionDeniedError: ``path`` is under none of the roots, naming them and the fix.
    """
    assert self.roots is not None
    have = _components(path)
    for root in sorted(self.roots, key=len):
      want = _components(root)
      if have[:len(want)] == want:
        return root, "/".join(have[len(want):])
    if not self.roots:
      raise errors.PermissionDeniedError(
          f"{path!r:.300}: {self.describe()} are none, so its pipelines may read no file; a "
          "pool tenant's pipelines read files only beneath its data roots: ask the pool's "
          "operator to give it data_roots (or checkpoint_roots) in the pool file")
    raise errors.PermissionDeniedError(
        f"{path!r:.300} is not under {self.describe()}; a pool tenant's pipelines read "
        "files only beneath its data roots: name a path under one of them (as written, not "
        "through a symlink to it), or ask the pool's operator to add its directory to the "
        "tenant's data_roots")


ANYWHERE = DataRoots()
GIVE_BACK_S = 2.0  # how long an open past open_files waits for files given back


class _OpenFiles:
  """The files each tenant's pipelines hold open in this process (``data_paths.DataFile``\\ s,
  ``DataView``\\ s' files), against ``DataRoots.open_files``: past it, a tenant's
  next open is refused, so its feeds use up their own share of the descriptor table,
  never the sidecar's or another tenant's. An open past it first waits up to
  :data:`GIVE_BACK_S` for files given back: a feed the client just closed gives its files
  back once its pipeline ends on the sidecar, which may come after the client's next feed
  asks (close a feed, open another)."""

  def __init__(self) -> None:
    # Reentrant: a file whose last reference goes (a collection, on any thread, a waiting
    # one included) gives its count back under it.
    self._cond = threading.Condition(threading.RLock())
    self._held: collections.Counter[str] = collections.Counter()

  def take(self, roots: DataRoots, n: int, what: str) -> None:
    """Counts ``n`` more files of ``roots.tenant``.

    Raises:
      ResourceExhaustedError: past ``roots.open_files`` for :data:`GIVE_BACK_S`; naming
        the limit and the fix.
    """
    tenant, most = roots.tenant, roots.open_files
    with self._cond:
      if most is not None and not self._cond.wait_for(
          lambda: self._held[tenant] + n <= most, timeout=GIVE_BACK_S):
        raise errors.ResourceExhaustedError(
            f"tenant {tenant!r}'s feeds hold {self._held[tenant]} open files; {what} would "
            f"pass its quota ({roots.open_files_why or f'open_files={most}'}); close "
            "feeds that are done, read fewer files at once (a dataset of fewer, larger "
            "files), or ask the pool's operator to raise its open_files in the pool file")
      self._held[tenant] += n

  def give(self, tenant: str, n: int) -> None:
    with self._cond:
      self._held[tenant] -= n
      self._cond.notify_all()

  def held(self, tenant: str) -> int:
    """How many files ``tenant``'s pipelines hold open now."""
    with self._cond:
      return self._held[tenant]


OPEN_FILES = _OpenFiles()


def _components(path: str) -> list[str]:
  return [p for p in path.split("/") if p not in ("", ".")]
