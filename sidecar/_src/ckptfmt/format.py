"""The format seam: what a checkpoint format does (``registry.py`` has them by name).

A format is known everywhere by its one name (``Format.name``): a trainer chooses it
(``CheckpointOptions(format=...)``), Begin carries it, a step's manifest records it and a
restore finds it there. The sidecar's save calls (``server/checkpoint/save.py``), its reads
(``server/checkpoint/read.py``) and the wire (``wire/checkpoint_wire.py``) know a format
only by its name and its typed extras; everything else that differs between formats is
a :class:`Format`:

- its directories: where a step is written before its commit (:meth:`Format.create_tmp`,
  ``tmp_suffix``, ``item``), where a tmp path goes once committed (:meth:`Format.final_of`;
  :meth:`Format.staged_dirs`, what a trainer stages into and commits, from Begin's answer;
  :meth:`Format.final_dir`, a step's committed directory as the trainer names it),
  what a sweep removes or puts back (:meth:`Format.sweep`), what marks a committed one
  (:meth:`Format.is_checkpoint`, ``markers``) and which directories of a save are scratch
  (:meth:`Format.scratch_suffixes`): the sidecar's checks on paths (``server/checkpoint/
  roots.py``) ask the registry these, and name no format;
- how a step's staged shards are numbered (:meth:`Format.numbering`: an Orbax step's
  shards name its leaves, a DCP rank's its items) and the typed extras a save carries
  (``stage_extra`` at Stage, ``commit_extra`` at Commit);
- the write engine (:meth:`Format.write`), the finalize and commit (:meth:`Format.commit`)
  and what the format adds to the manifest (:meth:`Format.manifest_extras`);
- reading an item back (:meth:`Format.read`), its stored metadata checked against its
  manifest (:meth:`Format.check_stored`), and the manifest of a committed directory that
  has no manifest file (:meth:`Format.stock_manifest`: one a stock tool wrote; one a
  sidecar wrote has lost its checksums, and is refused).

**Directories by descriptor.** What a format renames or removes (a leftover of a save that
never committed, a sweep's partial steps, the commit's renames) it names relative to
``at``, the directory its step's uncommitted directory lies in, opened once
(``ckptfmt/dir_fd.DirFd``): the sidecar opens it from its checkpoint root with no symlink
followed and hands it down, so a directory swapped for a symlink after the sidecar checked
the path cannot move the act to another tenant's directory (issue 76). Called with a path
alone (``at`` None: a test, a tool), a format opens it itself (``dir_fd.held``).

Adding a format (safetensors, say) is one sub-package, ``ckptfmt/<name>/``, whose
``Format`` subclass implements these, one line in ``registry.py`` and one driver in
``tests/server/ckptfmt/test_conformance.py`` (ARCHITECTURE.md, "Where a new format goes");
a trainer then saves in it with ``CheckpointOptions(format="<name>")`` (a JAX save makes
leaves and shards, all a format without extras needs). A format whose save needs more
(DCP's items and metadata) has typed extras: a message in the ``format_part`` oneofs of
``checkpoint.proto``, an entry in ``wire/checkpoint_wire.py``, and the framework adapter
that makes them (``torch/storage.py`` for DCP's). A format imports its heavy libraries
only inside its methods: the registry imports every format, and a PyTorch-only sidecar
serves DCP with no Orbax, TensorStore or JAX importable (tests/unit/test_layers.py).
"""

from __future__ import annotations

import abc
import dataclasses
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from sidecar._src.ckptfmt import dir_fd
from sidecar._src.ckptfmt.dir_fd import DirFd
from sidecar._src.ckptfmt.direct_io import Turn
from sidecar._src.ckptfmt.records import MANIFEST_FILE, Manifest, ShardRecord, Staged
from sidecar._src.ckptfmt.save_values import Commit
from sidecar._src.ckptfmt.spec import LeafSpec
from sidecar._src.core import errors

Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class Numbering(abc.ABC):
  """How one step's staged shards are numbered: each record's number checked against the
  step's leaves (or a DCP rank's items), so that its id keys the RAM tier and its number
  its writer.

  One per step on a sidecar; its writer thread reads what :meth:`take` recorded, so
  every rank's (or leaf's) description arrives before that part's shards.
  """

  @abc.abstractmethod
  def take(self, extra: Any, shards: Sequence[Staged]) -> list[Staged]:
    """One Stage: ``extra`` (the format's ``stage_extra``, or None) and its
    ``shards``, their records as the format numbers them (what the RAM tier keeps and the
    writer gets, the same records where they say so already). InvalidArgumentError if a
    record's number is out of range or names another shard; nothing is recorded then."""


@dataclasses.dataclass(frozen=True, slots=True)
class Uncommitted:
  """A path in an uncommitted step: the step's tmp directory, where that directory goes
  once committed, and where the path goes."""

  tmp: pathlib.Path
  committed: pathlib.Path
  final: pathlib.Path


class Format(abc.ABC):
  """A checkpoint format on the sidecar. See the module's docstring."""

  # The format's one name: the registry's key, what a trainer chooses
  # (``CheckpointOptions.format``) and Begin carries, and the manifest's "format".
  name: ClassVar[str]
  tmp_suffix: ClassVar[str]  # an uncommitted step directory's name ends with it
  # Files whose presence in a directory itself marks it a committed step or item of this
  # format: the sidecar's manifest, which every format's commit writes, and the format's
  # own. Nothing is written into such a directory, and no walk for owners enters one.
  markers: ClassVar[tuple[str, ...]] = (MANIFEST_FILE,)
  # The directory inside a step a save writes (Orbax's item "default"); "": the step's own.
  item: ClassVar[str] = ""
  overwrites: ClassVar[bool]  # a commit replaces a committed checkpoint at its path
  stage_extra: ClassVar[type | None] = None  # the typed extra a Stage carries, if any
  commit_extra: ClassVar[type | None] = None  # the typed extra a Commit carries, if any
  # In a message: what a step of this format is ("a PyTorch DCP checkpoint"), and the
  # APIs that restore it, for a reader of another format that opened one.
  title: ClassVar[str] = "a checkpoint of another format"
  readers: ClassVar[str] = "the API that saved it"

  # ---- its libraries ------------------------------------------------------

  def installed(self) -> bool:
    """Whether the libraries :meth:`load` imports are installed (found; none imported)."""
    return True

  def load(self) -> None:  # noqa: B027 - a format that needs no library overrides nothing
    """Imports what this format's engine needs, once for the process: Python's imports
    are not safe to race (``ckptfmt/orbax/libs.py``). A sidecar that serves checkpoints
    loads every installed format on its main thread at start, before it serves
    (:meth:`Registry.load_installed`), and asks this again before a save of the format
    begins, so that one that cannot be written says so at once. This default needs
    nothing.

    Raises:
      InvalidArgumentError: they cannot be imported here, naming the format, what is
        missing and the fix (the extra to install, or another format).
    """

  # ---- directories --------------------------------------------------------

  @abc.abstractmethod
  def create_tmp(self, directory: str, step: int, *, at: DirFd | None = None
                 ) -> pathlib.Path:
    """Creates (anew) the directory ``step`` of ``directory`` is written into, in ``at``
    (the directory it lies in, opened: see the module's docstring), removing a leftover
    there first."""

  def begin_tmp(self, directory: str, step: int, *, at: DirFd | None = None
                ) -> tuple[pathlib.Path, Callable[[], None]]:
    """:meth:`create_tmp` in two halves: makes the directory now (anew, refusing what
    :meth:`create_tmp` refuses), and returns it with what finishes it, to run later: the
    files of the step's own that only this host writes, any time before the commit (a
    Stage that begins its step leaves them to the step's writer thread, off the trainer's
    wait). What another host writes its part into is made now: it is told to once this
    returned. This default makes all of it now."""
    return self.create_tmp(directory, step, at=at), lambda: None

  @abc.abstractmethod
  def tmp_of(self, directory: str, step: int) -> str:
    """Where :meth:`create_tmp` would create it, made of ``directory`` as given (the
    sidecar gives it resolved; :meth:`final_dir`, the trainer's own spelling): no file
    system lookup."""

  def staged_dirs(self, tmp: str) -> tuple[str, str]:
    """Where a save whose Begin made ``tmp`` writes (its ``tmp_dir``) and where that is once
    committed (its ``final_dir``: the manifest's directory, what a restore reads, the RAM
    tier's key), made of ``tmp`` as given. A trainer's ``Target`` stages into the first of
    Begin's answer; its ``final_dir`` is the second of :meth:`tmp_of` (:meth:`final_dir`),
    as the client spells the path, not as the sidecar resolved it."""
    staged = pathlib.Path(tmp) / self.item if self.item else pathlib.Path(tmp)
    where = self.final_of(staged)
    if where is None:
      raise errors.InvalidArgumentError(
          f"{tmp!r:.200} is not an uncommitted step directory of format {self.name!r} "
          f"(*{self.tmp_suffix}); pass the directory its Begin answered")
    return str(staged), str(where.final)

  def final_dir(self, path: str, step: int) -> str:
    """Where step ``step`` of ``path`` (what Begin is given) is once committed, made of
    ``path`` as given, never resolved (:meth:`staged_dirs` of :meth:`tmp_of`): a trainer's
    ``final_dir``, which stays the client's own spelling of it (a symlinked or relative
    ``path`` too), while its tmp directories are Begin's answer."""
    return self.staged_dirs(self.tmp_of(path, step))[1]

  @abc.abstractmethod
  def final_of(self, path: pathlib.Path) -> Uncommitted | None:
    """Where ``path`` (resolved) lies if it is in (or is) an uncommitted step of this
    format; None if it lies in none."""

  def sweep(self, directory: pathlib.Path, *, at: DirFd | None = None) -> list[pathlib.Path]:
    """Puts back what a commit cut short left in ``directory`` (``at``, opened); returns
    its uncommitted directories, each a directory (no symlink) in it (the caller removes
    those no save in flight writes)."""
    with dir_fd.held(at, directory) as d:
      return [pathlib.Path(d.join(n)) for n in d.names()
              if n.endswith(self.tmp_suffix) and d.is_dir(n)]

  def made_here(self, tmp: pathlib.Path, *, at: DirFd | None = None) -> bool:
    """Whether the uncommitted step directory ``tmp`` (in ``at``, opened) is one a save
    made, so that an abort may remove it (a format whose tmp directory lies beside the one
    opened marks its own)."""
    del tmp, at
    return True

  def scratch_suffixes(self) -> tuple[str, ...]:
    """The endings of the names of the directories a save of this format makes that hold
    no committed checkpoint: its uncommitted steps (``tmp_suffix``), and any it keeps
    while a commit runs (DCP's replaced checkpoint)."""
    return (self.tmp_suffix,)

  @abc.abstractmethod
  def is_checkpoint(self, path: pathlib.Path) -> bool:
    """Whether ``path`` is a committed checkpoint of this format."""

  def misread(self, final_dir: pathlib.Path) -> tuple[pathlib.Path, list[str]] | None:
    """Where a reader of another format asked for ``final_dir`` (which has no manifest)
    inside, or at, a committed step of this format: that step and the files that show
    its format (named then with :attr:`title` and :attr:`readers`); None otherwise."""
    del final_dir
    return None

  # ---- save ---------------------------------------------------------------

  @abc.abstractmethod
  def numbering(self, leaves: Sequence[LeafSpec]) -> Numbering:
    """A step's numbering, from the leaves its first part carries."""

  @abc.abstractmethod
  def write(self, tmp_dir: str, host_id: int, numbering: Numbering, incoming: Iterator[Any],
            *, progress: Callable[[int], None], turn: Turn) -> list[ShardRecord]:
    """Writes what ``incoming`` yields (what :meth:`Numbering.take` returned) as it comes,
    until the step is staged whole; returns every shard's record, written (its crc32c
    set). Its
    bytes are written in ``turn``s (``direct_io.Turn``): the storage's write bandwidth,
    which a pool's tenants share."""

  def manifest_extras(self, extra: Any) -> Mapping[str, Any]:
    """What this format adds to a step's manifest, from the commit ``extra``."""
    del extra
    return {}

  @abc.abstractmethod
  def commit(self, commit: Commit, manifest: Manifest, *, swapping: Callable[[], None],
             at: DirFd | None = None) -> str:
    """Writes ``manifest`` and the format's metadata in ``commit.tmp_dir`` (resolved),
    checks every host's part is there (``commit.num_hosts``, ``leaves``), and commits (with
    ``commit.whole_step``, the step's rename, relative to ``at``: the directory the step's
    uncommitted directory lies in, opened). ``commit`` is the trainer's value, whole
    (``ckptfmt/save_values``): its ``extra`` the format's own. Returns the committed
    directory.
    ``swapping`` is a fault point inside the commit, its files in place: between the two
    renames of an overwrite, or just before the step's one rename."""

  # ---- restore ------------------------------------------------------------

  @abc.abstractmethod
  def read(self, final_dir: str, record: ShardRecord, *, allocate: Allocate,
           manifest: Manifest | None) -> np.ndarray:
    """The stored bytes of the shard ``record`` describes (as the manifest lists it: its
    id says which) of the committed ``final_dir``, into ``allocate``;
    the metadata the read uses is checked against ``manifest`` first, CorruptCheckpointError
    naming the file that differs. ``manifest`` None: the directory has no manifest file,
    and is read as a stock tool wrote it, unless a sidecar did (CorruptCheckpointError)."""

  def check_stored(self, final_dir: str, manifest: Manifest) -> None:
    """CorruptCheckpointError unless the committed ``final_dir``'s metadata files (the
    format's and the stored files' sizes) are those ``manifest`` says its save wrote;
    reads no shard's bytes. Each error names the file, relative to the step. A format
    with no metadata but the manifest has nothing more to check."""
    del final_dir, manifest

  def stock_manifest(self, final_dir: str) -> Manifest:
    """The manifest of a committed directory that has no manifest file: where a stock
    tool (Orbax, DCP) wrote it, one made from its metadata (``Manifest.stock``: no
    checksum); where a sidecar wrote it (the format's own marker says so; a format
    no stock tool writes, always), its checksums are gone: CorruptCheckpointError,
    never a read unchecked."""
    raise errors.CorruptCheckpointError(
        f"{final_dir}: its {MANIFEST_FILE} is missing, and a step of format {self.name!r} "
        "is always written with one: its checksums are gone with it, so it is not restored "
        "unchecked; restore an older step (restore(..., fallback=True) skips it)")
