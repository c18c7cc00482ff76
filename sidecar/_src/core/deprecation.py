"""Public names that moved: the old spelling works for one release, with a warning.

A public module that lost a name keeps a table of :class:`Moved` and hands its PEP 562
``__getattr__`` to :func:`resolve`; ``sidecar.X`` and ``from sidecar import X`` then both
return the name from its new home, with a ``DeprecationWarning`` that names it. The new
home is imported only then: a moved JAX name loads JAX on its first use, not at
``import sidecar``. CHANGELOG.md lists every moved name.

Example::

  _MOVED = {"initialize": Moved("sidecar.jax.initialize")}

  def __getattr__(name):
    return deprecation.resolve(__name__, name, _MOVED)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from sidecar._src.core import extras

# The release that moved the names, and the one that removes their old spellings.
DEPRECATED_IN = "0.2.0"
REMOVED_IN = "0.3.0"
# The same for the names CHANGELOG.md's Unreleased section deprecates (the next release).
NEXT_DEPRECATED_IN = "0.3.0"
NEXT_REMOVED_IN = "0.4.0"


@dataclasses.dataclass(frozen=True, slots=True)
class Moved:
  """Where a public name went: ``new``, a dotted path (``"sidecar.jax.Controller"``);
  ``note``, what else the warning says (another framework's spelling)."""
  new: str
  note: str = ""


def message(old: str, moved: Moved, *, since: str = DEPRECATED_IN,
            until: str = REMOVED_IN) -> str:
  """The warning's text: the old spelling, the new one, when the old one goes."""
  note = f" ({moved.note})" if moved.note else ""
  return f"{old} is deprecated since {since} and goes in {until}: use {moved.new}{note}"


def warn(old: str, moved: Moved, *, stacklevel: int = 2) -> None:
  """Warns that ``old``, a public method's spelling (``"Checkpointer.save_to"``), is
  deprecated since the next release: its caller's line is ``stacklevel`` frames up from
  the caller of this function (2: the deprecated method's caller).

  Example::

    def record(self, kind):
      deprecation.warn("Retry.record", Moved("Retry.note"))
      return self.note(kind)
  """
  warnings.warn(message(old, moved, since=NEXT_DEPRECATED_IN, until=NEXT_REMOVED_IN),
                DeprecationWarning, stacklevel=stacklevel + 1)


def resolve(module: str, name: str, moved: Mapping[str, Moved]) -> Any:
  """``module.name`` from its new home, with a ``DeprecationWarning`` (for a module's
  ``__getattr__``; every use warns, so none is cached).

  Raises:
    AttributeError: ``name`` never was ``module``'s.
    ImportError: the new home needs an extra that is not installed (named).
  """
  if (to := moved.get(name)) is None:
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
  old = f"{module}.{name}"
  if not _probed_by_import():
    # 1: here; 2: the module's __getattr__; 3: the user's line (``from m import x`` too).
    warnings.warn(message(old, to), DeprecationWarning, stacklevel=3)
  home, _, attr = to.new.rpartition(".")
  try:
    return getattr(importlib.import_module(home), attr)
  except ImportError as e:
    raise extras.missing(e, f"{old} (now {to.new})") from e


def _probed_by_import() -> bool:
  """Whether the import system asks (``from package import x`` first checks that the
  package has ``x`` before it takes it): the taking warns, so ``from sidecar import
  Controller`` warns once, as ``sidecar.Controller`` does."""
  try:
    asker = sys._getframe(3)  # 0: here; 1: resolve; 2: the module's __getattr__
  except ValueError:  # __getattr__ called by hand at a script's top
    return False
  return (asker.f_code.co_name == "_handle_fromlist"
          and asker.f_globals.get("__name__") == "importlib._bootstrap")
