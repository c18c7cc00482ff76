"""The checkpoint formats by name: :data:`DEFAULT`, the registry a sidecar uses.

A format is one line here (and its sub-package, ``ckptfmt/<name>/``). Its name
(``Format.name``) is its one spelling: the key here, what a trainer chooses
(``CheckpointOptions(format=...)``), what Begin carries and what a step's manifest says.
A restore names no format: a committed directory's is the one its manifest names
(:meth:`Registry.of_committed`). Importing this imports every format's ``Format`` class,
none of which imports Orbax, TensorStore, JAX or torch at import time
(tests/processes/ckptfmt/test_no_orbax.py saves with them unimportable).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Mapping

from sidecar._src.ckptfmt.dcp.format import DcpFormat
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.ckptfmt.records import MANIFEST_FILE, Manifest
from sidecar._src.core import errors

log = logging.getLogger(__name__)
ORBAX = OrbaxFormat.name  # a JAX save's format unless chosen
DCP = DcpFormat.name  # a PyTorch save's


@dataclasses.dataclass(frozen=True, slots=True)
class Registry:
  """Formats by name; tests make their own (a format whose write records, waits or fails)."""

  formats: Mapping[str, Format]
  # Every format's markers, each once (:meth:`has_markers`, asked of each directory above
  # a staged step at every Stage): worked out once, here.
  markers: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    object.__setattr__(self, "markers", tuple(dict.fromkeys(
        m for f in self.formats.values() for m in f.markers)))

  @property
  def names(self) -> list[str]:
    return sorted(self.formats)

  def get(self, name: str) -> Format:
    """The format ``name``; InvalidArgumentError naming it and the registered ones."""
    found = self.formats.get(name)
    if found is None:
      raise errors.InvalidArgumentError(
          f"format must be one of the registered formats {self.names}, got {name!r:.100}")
    return found

  def of_tmp(self, path: pathlib.Path) -> tuple[Format, Uncommitted] | None:
    """The format whose uncommitted step ``path`` is or lies in, and where it lies; None
    if it lies in no format's."""
    for fmt in self.formats.values():
      found = fmt.final_of(path)
      if found is not None:
        return fmt, found
    return None

  def of_committed(self, final_dir: str) -> Format:
    """The format of the committed ``final_dir``: the one its manifest names; where it has
    no manifest (an item stock Orbax wrote), the first format that says it is one of its
    own. InvalidArgumentError if neither."""
    path = pathlib.Path(final_dir)
    try:
      st = (path / MANIFEST_FILE).stat()
    except (FileNotFoundError, NotADirectoryError):
      found = next((f for f in self.formats.values() if f.is_checkpoint(path)), None)
      if found is None:
        raise errors.InvalidArgumentError(
            f"{final_dir} is not a committed checkpoint: it has no {MANIFEST_FILE}, and no "
            f"format of {self.names} knows it") from None
      return found
    name = _named(final_dir, (st.st_ino, st.st_mtime_ns, st.st_size))
    try:
      return self.get(name)
    except errors.InvalidArgumentError:
      raise errors.InvalidArgumentError(
          f"{final_dir}: its {MANIFEST_FILE} names format {name!r:.100}, which is not one of "
          f"this sidecar's registered formats {self.names}; restore it with a sidecar that "
          "has that format") from None

  def check_read(self, final_dir: str) -> None:
    """WrongFormatError if ``final_dir`` (no manifest in it) lies in, or is, a committed
    step of a format whose readers would not ask for it: a reader of another format's,
    told which format it found and the API that reads that one, before it reads."""
    for fmt in self.formats.values():
      found = fmt.misread(pathlib.Path(final_dir))
      if found is not None:
        step, shown = found
        what = (f"step {step.name} in {step.parent}" if step.name.isdigit() else str(step))
        raise errors.WrongFormatError(
            f"{what} is {fmt.title} ({', '.join(shown)}); restore it with {fmt.readers}")

  def scratch_suffixes(self) -> tuple[str, ...]:
    """The endings of every format's scratch directories (``Format.scratch_suffixes``):
    uncommitted steps, a replaced checkpoint until its removal."""
    return tuple(dict.fromkeys(s for f in self.formats.values() for s in f.scratch_suffixes()))

  def has_markers(self, path: pathlib.Path) -> bool:
    """Whether a format's markers (``Format.markers``) lie in ``path`` itself: it is a
    committed step or item, whatever lies below it."""
    return any((path / m).is_file() for m in self.markers)

  def is_checkpoint(self, path: pathlib.Path) -> bool:
    """Whether ``path`` is a committed checkpoint of any format."""
    return any(f.is_checkpoint(path) for f in self.formats.values())

  def load_installed(self) -> list[str]:
    """Loads (``Format.load``) every format whose libraries are installed, on the calling
    thread: a sidecar's main thread at start, before it serves, so that no request's
    thread imports them (concurrent imports of one package break it: issue 76). Returns
    the names of the formats it could not load; each is logged, and its saves and reads
    say why. A format not installed is left unloaded: its first save says what to
    install."""
    failed = []
    for fmt in self.formats.values():
      if not fmt.installed():
        continue
      try:
        fmt.load()
      except errors.SidecarError as e:
        log.warning("checkpoint format %r is installed but could not be loaded: %s",
                    fmt.name, e)
        failed.append(fmt.name)
    return failed

  def replacing(self, fmt: Format) -> Registry:
    """This registry with ``fmt`` in place of the format of its name."""
    return Registry({**self.formats, fmt.name: fmt})


@functools.lru_cache(maxsize=64)
def _named(final_dir: str, stamp: tuple[int, int, int]) -> str:
  """The format the manifest of ``final_dir`` names (read once per version of the file:
  a restore asks for each of its shards)."""
  del stamp  # in the key only: a rewritten manifest is read again
  path = pathlib.Path(final_dir) / MANIFEST_FILE
  return Manifest.from_json(path.read_bytes(), final_dir).format


DEFAULT = Registry({f.name: f for f in (OrbaxFormat(), DcpFormat())})


def is_checkpoint(path: pathlib.Path, registry: Registry = DEFAULT) -> bool:
  """Whether ``path`` is a committed checkpoint of any format of ``registry``."""
  return registry.is_checkpoint(path)
