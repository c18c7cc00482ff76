"""The libraries stock Orbax's layout needs (Orbax, TensorStore and, through them, JAX),
imported once for the whole process.

Python's imports are not safe to race. Threads that import a package with import cycles
(``orbax.checkpoint``) at once each find the other's modules half done: one ends with
"cannot import name ... from partially initialized module", and the package is left out of
``sys.modules``, so every later import of it fails (``KeyError: 'orbax.checkpoint'``)
until the process restarts. A burst of saves on a fresh sidecar did that to every
tenant: each step's writer thread imported Orbax on its own (issue 76, attack 2).

So nothing in ``ckptfmt/orbax/`` imports Orbax or TensorStore before :func:`load` did:
one import of everything a save or a read uses, once, under one lock. A pool's sidecar
calls it on its main thread at start, before it serves (``Registry.load_installed``, from
``server/server.py``), where the libraries are installed; any other caller (a one-job
sidecar's first save or read, a trainer's Orbax handler, a tool) calls it as it first
needs them, the others waiting for that one import: a burst of saves on a fresh sidecar
then waits for one import, and none of them finds it half done. A failure is kept and
raised to every caller alike: an ImportError naming the extra to install (or the import's
own error, for an install that is there but broken), never a half-imported module.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading

from sidecar._src.core import extras

log = logging.getLogger(__name__)
# Everything ``ckptfmt/orbax/`` imports, in an order that loads each package before its
# submodules; one import of these is all a save or a read needs.
MODULES = (
    "tensorstore",
    "orbax.checkpoint",
    "orbax.checkpoint._src.serialization.tensorstore_utils",
    "orbax.checkpoint._src.metadata.array_metadata_store",
    "orbax.checkpoint._src.metadata.tree",
    "orbax.checkpoint._src.metadata.value_metadata_entry",
    "orbax.checkpoint._src.metadata.pytree_metadata_options",
    "orbax.checkpoint._src.metadata.checkpoint",
    "orbax.checkpoint._src.metadata.step_metadata_serialization",
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler",
)
WHAT = "a checkpoint in Orbax's layout"
_lock = threading.Lock()
# [] until the one import ended; then [""] (loaded) or [its error's message, its missing
# module's name or None].
_outcome: list[tuple[str, str | None]] = []


def installed() -> bool:
  """Whether Orbax and TensorStore are installed (found: nothing is imported)."""
  for name in ("orbax", "tensorstore"):
    try:
      if importlib.util.find_spec(name) is None:
        return False
    except (ImportError, ValueError):  # (a finder that refuses it: as not installed)
      return False
  return True


def load() -> None:
  """Imports :data:`MODULES`, once for the process; waits for an import under way.

  Raises:
    ImportError: they could not be imported (now or at the first try): a
      ModuleNotFoundError naming the extra to install where one is missing, else the
      import's own error, in words.
  """
  if not _outcome:
    with _lock:
      if not _outcome:
        _outcome.append(_import())
  message, missing = _outcome[0]
  if message:
    if missing is not None:
      raise ModuleNotFoundError(message, name=missing)
    raise ImportError(message)


def _import() -> tuple[str, str | None]:
  """The one import: ("", None), or what to raise (its message, the missing module)."""
  try:
    for name in MODULES:
      importlib.import_module(name)
  except ImportError as e:
    found = extras.missing(e, WHAT)
    if found is not e:
      return str(found), e.name
    return _broken(e), None
  except Exception as e:  # noqa: BLE001 - an install that is there but broken, in words
    return _broken(e), None
  return "", None


def _broken(e: BaseException) -> str:
  message = (f"{WHAT} needs Orbax and TensorStore, whose import failed on this process "
             f"({type(e).__name__}: {e}); reinstall them (pip install "
             "'colocated-sidecar[jax]'), or save in DCP's layout")
  log.warning("%s", message)
  return message
