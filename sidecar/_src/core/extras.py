"""The optional dependencies (pyproject.toml's extras), and the error that names one.

The base install runs a sidecar, the controller core and numpy-only trainers. JAX,
Grain, Orbax and TensorStore come with ``colocated-sidecar[jax]``, PyTorch with
``[torch]``; a PyTorch-only install has none of the first four. Where a missing one is
needed, the error says which extra brings it.
"""

from __future__ import annotations

# Top-level module -> the extra that installs it.
EXTRA_OF = {
    "jax": "jax", "jaxlib": "jax", "grain": "jax", "orbax": "jax", "tensorstore": "jax",
    "torch": "torch",
    "matplotlib": "bench",  # sidecar goodput --plot (the lm extra brings it too)
}


def extra_of(e: ImportError) -> str | None:
  """The extra that installs the module ``e`` did not find, where one does (a module
  that is there but fails to import is no missing extra)."""
  if not isinstance(e, ModuleNotFoundError):
    return None
  return EXTRA_OF.get((e.name or "").split(".")[0])


def missing(e: ImportError, what: str) -> ImportError:
  """``e`` as an ImportError that names the extra to install, where an extra brings the
  missing module; ``e`` itself otherwise.

  Example::

    try:
      import jax
    except ImportError as e:
      raise extras.missing(e, "sidecar.jax.Controller") from e
  """
  extra = extra_of(e)
  if extra is None:
    return e
  out = ModuleNotFoundError(
      f"{what} needs {e.name}, which is not installed: pip install 'colocated-sidecar[{extra}]'")
  out.name = e.name
  return out
