"""The checkpoint formats by name: :data:`DEFAULT`, the registry a sidecar uses.

A format is one line here (and its sub-package, ``ckptfmt/<name>/``). Importing this
imports every format's ``Format`` class, none of which imports Orbax, TensorStore, JAX
or torch at import time (tests/processes/ckptfmt/test_no_orbax.py saves with them
unimportable).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping

from sidecar._src.ckptfmt.dcp.format import DcpFormat
from sidecar._src.ckptfmt.format import Format, Uncommitted
from sidecar._src.ckptfmt.orbax.format import OrbaxFormat
from sidecar._src.core import errors

ORBAX = OrbaxFormat.name  # the wire's empty format name means it, as before formats had names


@dataclasses.dataclass(frozen=True, slots=True)
class Registry:
  """Formats by name; tests make their own (a format whose write records, waits or fails)."""

  formats: Mapping[str, Format]

  def get(self, name: str) -> Format:
    """The format ``name`` ('' is Orbax's); InvalidArgumentError naming the known ones."""
    found = self.formats.get(name or ORBAX)
    if found is None:
      raise errors.InvalidArgumentError(
          f"format must be one of {sorted(self.formats)} ('' is {ORBAX!r}), got {name!r:.100}")
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
    """The format of the committed ``final_dir``: the first other than Orbax's that says it
    is one of its own, else Orbax's (ours, or one stock Orbax wrote)."""
    path = pathlib.Path(final_dir)
    for fmt in self.formats.values():
      if fmt.name != ORBAX and fmt.is_checkpoint(path):
        return fmt
    return self.get(ORBAX)

  def replacing(self, fmt: Format) -> Registry:
    """This registry with ``fmt`` in place of the format of its name."""
    return Registry({**self.formats, fmt.name: fmt})


DEFAULT = Registry({f.name: f for f in (OrbaxFormat(), DcpFormat())})


def is_checkpoint(path: pathlib.Path, registry: Registry = DEFAULT) -> bool:
  """Whether ``path`` is a committed checkpoint of any format."""
  return any(f.is_checkpoint(path) for f in registry.formats.values())
