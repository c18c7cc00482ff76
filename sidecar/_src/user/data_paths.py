"""The files a pipeline reads: beneath its tenant's data roots in a pool, anywhere outside one.

A feed runs its pipeline with arguments its client chose, in the sidecar's processes and
with their permissions: in a pool (``sidecar serve --pool``), a path among them is one
tenant asking the sidecar to read a file for it. So a pipeline opens every path through
``ctx.data_path(path)``, a :class:`DataPath` bound to its tenant's ``data_roots.DataRoots``
(``data_roots`` in the pool file, else its ``checkpoint_roots``):

- a path is placed under a root by its components as written, before anything is looked
  up: a path under no root is refused without a filesystem call, so the answer says
  nothing of what exists outside (a missing file inside answers NotFoundError);
- below the root it is resolved by ``core/beneath.open_within`` from the root's
  descriptor: symlinks and ``..`` are followed only while they stay beneath the root, and
  one that leads out is refused before anything outside is looked up. A symlink swapped in
  at any moment changes which of the tenant's own entries is reached, never whether it is
  beneath the root. Names read from a manifest or index (``path / name``) may not be
  absolute or hold ``..``;
- a library that opens files by path itself (pyarrow, ArrayRecord, TFDS) is handed a path
  through a descriptor already opened so (``DataFile.library_path``,
  ``/proc/PID/fd/N``: it reaches that very file, whatever is renamed or swapped), or, for
  a directory, a private tree of such paths (:meth:`DataPath.view`).

Outside a pool (``DataRoots.roots`` None) a DataPath reads whatever the sidecar may, as
``open()`` does, and libraries get the paths as written.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fnmatch
import io
import os
import re
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from sidecar._src.core import beneath, errors
from sidecar._src.user.data_roots import ANYWHERE, OPEN_FILES, DataRoots

_MAGIC = re.compile(r"[*?[]")  # what makes a component a glob pattern (as ``glob``'s)
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK  # a FIFO must not block the open
# Entries (files and directories) of one view: each file holds a descriptor while the view
# lives (the sidecar raises its RLIMIT_NOFILE to 65,536).
MAX_VIEW_ENTRIES = 10_000
# A glob in a pool: the most directories it lists (each once) and the most entries it
# matches; past either it is refused rather than walked.
MAX_GLOB_DIRS = 10_000
MAX_GLOB_MATCHES = 100_000
# A pool glob asks whether its caller is still there at its first directory and after each
# this many more (``while_alive``).
ALIVE_EVERY_DIRS = 64
# Whether the caller of what runs now is still there (``while_alive``); None: not asked.
_ALIVE: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "sidecar_data_paths_alive", default=None)


@contextlib.contextmanager
def while_alive(alive: Callable[[], bool] | None) -> Iterator[None]:
  """While the block runs (a feed's pipeline opening), a pool glob's walk stops once
  ``alive()`` is false: ``ClosedError``, its caller (the feed's client) gone. None: it is
  never asked."""
  token = _ALIVE.set(alive)
  try:
    yield
  finally:
    _ALIVE.reset(token)


class DataFile(io.FileIO):
  """A file a pipeline opened for reading (:meth:`DataPath.open`): a binary file object.

  ``name`` is its path as the pipeline named it; :attr:`library_path` is the path to hand
  a library that opens files by name (pyarrow, ArrayRecord): in a pool, a path through
  this file's own descriptor, which reaches this very file while it is open (keep the
  DataFile open as long as the library may open it again). It closes itself when its last
  reference goes; in a pool, it counts against its tenant's ``open_files`` until then.
  """

  def __init__(self, fd: int, path: str, *, library_path: str, rooted: bool,
               tenant: str | None = None):
    """``tenant``: whose count of open files (``OPEN_FILES``) this file is in; None: none."""
    self._tenant = tenant
    super().__init__(fd, "rb", closefd=True)
    self.name = path
    self._library_path = library_path
    self._rooted = rooted

  def close(self) -> None:
    tenant, self._tenant = getattr(self, "_tenant", None), None
    try:
      super().close()
    finally:
      if tenant is not None:
        OPEN_FILES.give(tenant, 1)

  @property
  def library_path(self) -> str:
    """The path a library that opens files by name should be given (see the class)."""
    if self.closed:
      raise ValueError(f"the data file {self.name!r} is closed: its library_path would "
                       "name whatever file takes its descriptor next")
    return self._library_path

  def __reduce__(self) -> Any:
    if self._rooted:
      raise TypeError(f"the data file {self.name!r}, opened beneath a pool tenant's data "
                      "roots, cannot cross to another process: open it there")
    return _reopen, (self.name,)

  def __del__(self) -> None:
    # Whoever held it (a dataset) went: closing is the expected end, not a leak to warn of.
    with contextlib.suppress(Exception):
      self.close()


def _reopen(path: str) -> DataFile:
  return DataPath(path).open()


class DataView:
  """A directory tree for a library that opens its files by path (TFDS), as
  :meth:`DataPath.view` made it; :attr:`path` is the directory to hand it.

  In a pool it is a private tree (in a directory of the sidecar's own, mode 0700): the same
  directories, and for each file a symlink to a descriptor of the file opened beneath the
  data roots (``/proc/PID/fd/N``), all held until :meth:`close` or its last reference;
  nothing renamed or swapped in the data afterwards reaches it. It keeps the directory's
  name, alone in its private parent (``os.path.dirname(view.path)``: a ``data_dir`` that
  holds this one dataset). Outside a pool, :attr:`path` is the directory itself.
  """

  def __init__(self, path: str, *, mirror: str | None = None, fds: tuple[int, ...] = (),
               tenant: str | None = None):
    """``tenant``: whose count of open files (``OPEN_FILES``) ``fds`` are in; None: none."""
    self._path = path
    self._mirror = mirror
    self._release = weakref.finalize(self, _remove, mirror, fds, tenant)

  @property
  def path(self) -> str:
    if not self._release.alive:
      raise ValueError(f"the view {self._path!r} is closed")
    return self._path

  def close(self) -> None:
    """Closes its descriptors and removes its private tree; idempotent."""
    self._release()

  def __enter__(self) -> DataView:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __reduce__(self) -> Any:
    if self._mirror is not None:
      raise TypeError(f"the view {self._path!r} of a pool tenant's data cannot cross to "
                      "another process: make it there")
    return DataView, (self._path,)


def _remove(mirror: str | None, fds: tuple[int, ...], tenant: str | None = None) -> None:
  for fd in fds:
    with contextlib.suppress(OSError):
      os.close(fd)
  if tenant is not None:
    OPEN_FILES.give(tenant, len(fds))
  if mirror is not None:
    shutil.rmtree(mirror, ignore_errors=True)


class DataPath:
  """A path a pipeline reads: a file, a directory or a glob; ``ctx.data_path(path)`` makes
  one (see the module's docstring for what a pool holds it to).

  Example::

    corpus = ctx.data_path(data)                       # refused here if outside the roots
    with (corpus / "manifest.json").open() as f:       # a name: no '/'-leading, no '..'
      manifest = json.load(f)
    files = ctx.data_path("/data/bob/*.parquet").expand()
  """

  __slots__ = ("_path", "_roots")

  def __init__(self, path: str | os.PathLike, roots: DataRoots = ANYWHERE):
    """``path`` as a pipeline names it; ``roots``: where it may read (outside a pool,
    anywhere the sidecar may: a plain path).

    Raises:
      PermissionDeniedError: in a pool, ``path`` is under none of ``roots``.
    """
    path = os.fspath(path)
    if not isinstance(path, str) or not path or "\0" in path:
      raise errors.InvalidArgumentError(f"a data path must be a non-empty str with no NUL, "
                                        f"got {path!r:.200}")
    self._roots = roots
    self._path = path if roots.roots is None else os.path.join(os.getcwd(), path)
    if roots.roots is not None:
      roots.place(self._path)

  def __str__(self) -> str:
    return self._path

  def __repr__(self) -> str:
    return f"DataPath({self._path!r})"

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, DataPath) and other._path == self._path
            and other._roots == self._roots)

  def __hash__(self) -> int:
    return hash((self._path, self._roots))

  def __truediv__(self, name: str) -> DataPath:
    """The entry ``name`` inside this directory: a name read from a manifest or an index,
    so relative, with no ``..`` (or empty) component and no NUL.

    Raises:
      InvalidArgumentError: ``name`` is absolute or climbs with ``..``, naming it.
    """
    if (not isinstance(name, str) or not name or "\0" in name or name.startswith("/")
        or any(p in ("", "..") for p in name.split("/"))):
      raise errors.InvalidArgumentError(
          f"{name!r:.200} is no name inside {self._path!r:.200}: a file named by a manifest "
          "or an index is relative to its directory, with no '..' or empty component; "
          "write the names relative (as pipelines.lm.write_corpus does)")
    return DataPath(os.path.join(self._path, name), self._roots)

  def open(self) -> DataFile:
    """The file, opened for reading (see :class:`DataFile`).

    Raises:
      NotFoundError: nothing is there (beneath the roots, in a pool).
      PermissionDeniedError: it leads out of its root (a symlink or ``..``), or the
        sidecar may not read it.
      InvalidArgumentError: it is a directory (or, in a pool, no regular file).
    """
    tenant = None
    if self._roots.roots is None:
      fd = self._plain_open(self._path)
      library = self._path
    else:
      OPEN_FILES.take(self._roots, 1, f"opening {self._path!r:.200}")
      tenant = self._roots.tenant
      try:
        fd = self._open_within(_FILE_FLAGS)
      except BaseException:
        OPEN_FILES.give(tenant, 1)
        raise
      library = f"/proc/{os.getpid()}/fd/{fd}"
    try:
      st = os.fstat(fd)
      if stat.S_ISDIR(st.st_mode):
        raise errors.InvalidArgumentError(f"{self._path!r:.300} is a directory; name a file")
      if self._roots.roots is not None:
        if not stat.S_ISREG(st.st_mode):
          raise errors.InvalidArgumentError(
              f"{self._path!r:.300} is no regular file ({stat.filemode(st.st_mode)}); a pool "
              "tenant's pipelines read plain files only")
        os.set_blocking(fd, True)
      return DataFile(fd, self._path, library_path=library,
                      rooted=self._roots.roots is not None, tenant=tenant)
    except BaseException:
      os.close(fd)
      if tenant is not None:
        OPEN_FILES.give(tenant, 1)
      raise

  def expand(self, *, what: str = "file") -> list[DataPath]:
    """The files this path names: itself, or, where a component holds ``*``, ``?`` or
    ``[``, the files it matches in sorted order (as ``glob``: a leading ``.`` matched only
    by a pattern that starts with one; in a pool, only matches beneath the roots).

    Raises:
      NotFoundError: no file (``what`` names the kind in the message).
    """
    if self._roots.roots is None:
      found = self._plain_expand()
    else:
      found = self._expand_within()
    if not found:
      raise errors.NotFoundError(
          f"no {what} at {self._path!r:.300}{self._under()}; check the path, or the glob if "
          "it is one")
    return found

  def view(self) -> DataView:
    """This directory, for a library that opens its files by path (see :class:`DataView`).

    Raises (in a pool):
      NotFoundError: no directory is there.
      PermissionDeniedError: an entry leads out of its root.
      InvalidArgumentError: more than ``MAX_VIEW_ENTRIES`` entries, or no directory.
    """
    if self._roots.roots is None:
      return DataView(self._path)  # the library opens it, and says what is missing
    root, rest = self._roots.place(self._path)
    return _View(self, root, rest).make()

  # ---- inside -------------------------------------------------------------------------

  def _under(self) -> str:
    return "" if self._roots.roots is None else f" under {self._roots.describe()}"

  def _plain_open(self, path: str) -> int:
    try:
      return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
      raise errors.NotFoundError(f"no file at {path!r:.300}") from None
    except PermissionError as e:
      raise errors.PermissionDeniedError(
          f"the sidecar may not read {path!r:.300}: {e.strerror}") from None

  def _open_within(self, flags: int, rest: str | None = None) -> int:
    """A descriptor of this path (or of ``rest`` below its root) opened beneath its root.
    OSErrors become SidecarErrors naming the path and the roots (:meth:`_refusal`)."""
    root, mine = self._roots.place(self._path)
    shown = self._path if rest is None else os.path.join(root, rest)
    try:
      root_fd = beneath.open_dir(root, what="data root")
    except OSError as e:
      raise self._refusal(e, root, shown) from None
    try:
      return beneath.open_within(root_fd, mine if rest is None else rest, flags, top=root)
    except OSError as e:
      raise self._refusal(e, root, shown) from None
    finally:
      os.close(root_fd)

  def _refusal(self, e: OSError, root: str, shown: str) -> Exception:
    """The SidecarError for ``e``, met opening ``shown`` beneath ``root``."""
    if isinstance(e, errors.SidecarError):
      return e
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
      return errors.NotFoundError(f"no file or directory at {shown!r:.300}{self._under()}")
    if e.errno == errno.EXDEV:
      return errors.PermissionDeniedError(
          f"{shown!r:.300} leads out of its data root {root!r} (a symlink or '..' on its way "
          f"goes outside it); {self._roots.describe()} are all its pipelines may read: keep "
          "the data, and the symlinks that lead to it, beneath them")
    if e.errno in (errno.EACCES, errno.EPERM):
      return errors.PermissionDeniedError(
          f"the sidecar may not read {shown!r:.300} ({e.strerror}); let its user read it")
    if e.errno == errno.ELOOP:
      return errors.InvalidArgumentError(
          f"{shown!r:.300}: more than {beneath.MAX_HOPS} symlinks on its way")
    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
      return errors.ResourceExhaustedError(
          f"opening {shown!r:.300}: {e.strerror}; this process holds too many files")
    return e

  def _plain_expand(self) -> list[DataPath]:
    import glob  # only outside a pool: a pool's globs walk beneath the roots
    matches = sorted(glob.glob(self._path)) if _MAGIC.search(self._path) else [self._path]
    return [DataPath(m) for m in matches if os.path.isfile(m)]

  def _expand_within(self) -> list[DataPath]:
    root, rest = self._roots.place(self._path)
    rest = os.path.normpath(rest) if rest else ""
    if rest.startswith(".."):
      raise self._refusal(OSError(errno.EXDEV, "'..' above it"), root, self._path)
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    if not any(_MAGIC.search(p) for p in parts):
      try:
        self.open().close()
      except (errors.NotFoundError, errors.InvalidArgumentError):
        return []
      return [self]
    return self._walk(root, parts)

  def _walk(self, root: str, parts: list[str]) -> list[DataPath]:
    """The files beneath ``root`` that the components ``parts`` match, level by level.
    Bounded whatever the tree holds: each directory (by device and inode) is listed once
    in a walk, so a symlink loop (``a -> .``) ends it, and past ``MAX_GLOB_DIRS``
    directories listed or ``MAX_GLOB_MATCHES`` matches it is refused. Within
    :func:`while_alive`, it stops (``ClosedError``) once its caller is gone."""
    prefixes: list[list[str]] = [[]]
    seen: set[tuple[int, int]] = set()
    matched = 0
    for i, part in enumerate(parts):
      last, nxt = i == len(parts) - 1, []
      for prefix in prefixes:
        for name in self._matches(root, prefix, part, seen):
          if self._is(root, [*prefix, name], stat.S_ISREG if last else stat.S_ISDIR):
            nxt.append([*prefix, name])
            matched += 1
            if matched > MAX_GLOB_MATCHES:
              raise self._too_big(f"matches more than {MAX_GLOB_MATCHES} entries")
      prefixes = nxt
    return sorted((DataPath(os.path.join(root, *p), self._roots) for p in prefixes), key=str)

  def _too_big(self, what: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(
        f"the glob {self._path!r:.300} {what}, more than a pool tenant's glob may; name "
        "fewer files (a narrower pattern, or a list of paths)")

  def _matches(self, root: str, prefix: list[str], part: str,
               seen: set[tuple[int, int]]) -> list[str]:
    """The names in directory ``prefix`` (below ``root``) that the component ``part``
    matches; none where it is no directory beneath the root, or one this walk listed
    already (``seen``: by device and inode, added to here)."""
    if not _MAGIC.search(part):
      return [part]
    try:
      fd = self._open_within(os.O_RDONLY | os.O_DIRECTORY, "/".join(prefix) or ".")
    except (errors.SidecarError, OSError):
      return []
    try:
      st = os.fstat(fd)
      if (st.st_dev, st.st_ino) in seen:
        return []  # reached again (a symlink to it): its matches are in the walk already
      seen.add((st.st_dev, st.st_ino))
      if len(seen) > MAX_GLOB_DIRS:
        raise self._too_big(f"walks more than {MAX_GLOB_DIRS} directories")
      alive = _ALIVE.get()
      if alive is not None and (len(seen) - 1) % ALIVE_EVERY_DIRS == 0 and not alive():
        raise errors.ClosedError(
            f"the glob {self._path!r:.300} stopped after {len(seen)} directories: the "
            "feed's client is gone")
      names = os.listdir(fd)
    finally:
      os.close(fd)
    return [n for n in names if fnmatch.fnmatchcase(n, part)
            and (not n.startswith(".") or part.startswith("."))]

  def _is(self, root: str, rel: list[str], kind: Any) -> bool:
    """Whether ``rel`` (below ``root``) is, beneath the root, a ``kind`` (S_ISREG, S_ISDIR)."""
    try:
      fd = self._open_within(_FILE_FLAGS, "/".join(rel))
    except (errors.SidecarError, OSError):
      return False  # missing, or leading out: no match either way
    try:
      return kind(os.fstat(fd).st_mode)
    finally:
      os.close(fd)


class _View:
  """Makes one :class:`DataView` of a directory beneath a root (see its docstring)."""

  def __init__(self, path: DataPath, root: str, rest: str):
    self._path, self._root, self._rest = path, root, rest
    self._fds: list[int] = []
    self._entries = 0

  def make(self) -> DataView:
    fd = self._path._open_within(_FILE_FLAGS, self._rest or ".")
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
      os.close(fd)
      raise errors.InvalidArgumentError(f"{str(self._path)!r:.300} is no directory")
    parent = tempfile.mkdtemp(prefix="sidecar-view-")  # mode 0700, this user's
    mirror = os.path.join(parent, os.path.basename(os.path.join(self._root, self._rest)))
    try:
      os.mkdir(mirror, 0o700)
      self._copy(fd, self._rest, mirror, frozenset())
    except BaseException:
      _remove(parent, tuple(self._fds), self._path._roots.tenant)
      raise
    return DataView(mirror, mirror=parent, fds=tuple(self._fds),
                    tenant=self._path._roots.tenant)

  def _copy(self, dir_fd: int, rel: str, into: str,
            above: frozenset[tuple[int, int]]) -> None:
    """Mirrors the directory ``dir_fd`` (``rel`` below the root; closed here) into
    ``into``: directories made, files as symlinks to their descriptors. ``above``: the
    directories it lies in (a symlink to one of them is a loop, left out)."""
    st = os.fstat(dir_fd)
    above = above | {(st.st_dev, st.st_ino)}
    try:
      names = sorted(os.listdir(dir_fd))
    finally:
      os.close(dir_fd)
    for name in names:
      self._entries += 1
      if self._entries > MAX_VIEW_ENTRIES:
        raise errors.InvalidArgumentError(
            f"{str(self._path)!r:.300} holds more than {MAX_VIEW_ENTRIES} entries, more than "
            "a view of the data roots may (each file stays open while it lives); name a "
            "smaller directory (a dataset's own)")
      child = os.path.join(rel, name) if rel else name
      try:
        fd = self._path._open_within(_FILE_FLAGS, child)
      except errors.NotFoundError:
        continue  # gone meanwhile
      mode = os.fstat(fd).st_mode
      if stat.S_ISDIR(mode):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in above:  # a symlink back up the tree
          os.close(fd)
          continue
        os.mkdir(os.path.join(into, name), 0o700)
        self._copy(fd, child, os.path.join(into, name), above)
      elif stat.S_ISREG(mode):
        try:
          OPEN_FILES.take(self._path._roots, 1, f"one more file for the view of "
                          f"{str(self._path)!r:.200} (which holds {len(self._fds)} so far)")
        except BaseException:
          os.close(fd)
          raise
        os.set_blocking(fd, True)
        self._fds.append(fd)
        os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(into, name))
      else:
        os.close(fd)  # a FIFO, a socket: nothing a library should read
