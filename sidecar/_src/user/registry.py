"""The registry: what a sidecar may run, and nothing else.

``@sidecar.function`` (and later ``@sidecar.pipeline``) put user callables into
a :class:`Registry`. The sidecar only ever runs what is registered, by name;
nothing is unpickled from the network.

A pipeline may look a function up by a name among its arguments (``arrayrecord``'s
``parse=``): the feed that opens it does so within its tenant's ``functions`` allowlist
(:func:`allowing`), so a name from a client reaches only what that client may run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import marshal
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from sidecar._src.core import errors, extras

F = TypeVar("F", bound=Callable[..., Any])

PLUGIN_GROUP = "sidecar.plugins"
FUNCTION = "function"
PIPELINE = "pipeline"
KINDS = (FUNCTION, PIPELINE)


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
  """One registered callable.

  ``identity`` (pipelines only): what names the data a feed of it reads, called as the
  pipeline is, with its context and keyword arguments (a digest of its files' manifest,
  read through ``ctx.data_path``, say); a feed's state
  records it, and a feed resumed from a state made from other data is refused.
  """
  kind: str
  name: str
  fn: Callable[..., Any]
  code_hash: str
  signature: inspect.Signature | None  # None where Python cannot tell (some builtins)
  identity: Callable[..., str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Allowlist:
  """The functions a pipeline being opened may look up by name: its feed's tenant's
  ``functions`` allowlist (``where``: the pool file's line, for messages)."""
  names: frozenset[str]
  tenant: str = ""
  where: str = ""


# Set while a feed opens its pipeline (``allowing``); None: every registered function.
_ALLOWED: contextvars.ContextVar[Allowlist | None] = contextvars.ContextVar(
    "sidecar_allowed_functions", default=None)


@contextlib.contextmanager
def allowing(allowed: Allowlist | None) -> Iterator[None]:
  """Lookups of functions by name (``Registry.get``) reach only ``allowed`` while the block
  runs (None: no bound); a pipeline's arguments come from its client."""
  token = _ALLOWED.set(allowed)
  try:
    yield
  finally:
    _ALLOWED.reset(token)


def code_hash(fn: Callable[..., Any]) -> str:
  """A short hash of ``fn``'s code: its source when available, else bytecode."""
  target = inspect.unwrap(fn)
  try:
    text = inspect.getsource(target).encode()
  except (OSError, TypeError):
    code = getattr(target, "__code__", None)
    text = marshal.dumps(code) if code is not None else repr(target).encode()
  return hashlib.sha256(text).hexdigest()[:16]


class Registry:
  """Names to callables, by kind. Thread-safe; one default instance."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._entries: dict[tuple[str, str], Entry] = {}

  def add(self, kind: str, name: str, fn: Callable[..., Any], *,
          identity: Callable[..., str] | None = None) -> Entry:
    if kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if identity is not None and (kind != PIPELINE or not callable(identity)):
      raise TypeError(f"identity= names the data a pipeline reads: a callable of the "
                      f"pipeline's keyword arguments, for @sidecar.pipeline only; got "
                      f"{identity!r:.100} for a {kind}")
    if not callable(fn):
      raise TypeError(f"@sidecar.{kind} needs a callable, got {type(fn).__name__} {fn!r}")
    if not isinstance(name, str) or not name:
      raise TypeError(f"a {kind} name must be a non-empty str, got {name!r}")
    if name.startswith("sidecar.") and self is _default:
      raise ValueError(f"{kind} names starting with 'sidecar.' are the sidecar's own; "
                       f"rename {name!r}")
    try:
      signature = inspect.signature(fn)
    except (TypeError, ValueError):
      signature = None
    entry = Entry(kind, name, fn, code_hash(fn), signature, identity)
    with self._lock:
      old = self._entries.get((kind, name))
      if old is not None:
        raise errors.AlreadyRegisteredError(
            f"{kind} {name!r} is already registered (by {_where(old.fn)}); "
            f"pass name=... to register {_where(fn)} under another name")
      self._entries[(kind, name)] = entry
    return entry

  def get(self, kind: str, name: str) -> Entry:
    """The entry of ``kind`` named ``name``.

    Raises:
      PermissionDeniedError: within :func:`allowing`, a function outside the allowlist
        (whether or not it is registered: the answer tells nothing of what is).
      NotRegisteredError: no such entry, naming those registered (that may be run).
    """
    allowed = _ALLOWED.get() if kind == FUNCTION else None
    if allowed is not None and name not in allowed.names:
      raise errors.PermissionDeniedError(
          f"tenant {allowed.tenant!r} may not run function {name!r:.100}, named in a "
          f"pipeline's arguments: its functions allowlist ({allowed.where}) holds "
          f"{', '.join(sorted(allowed.names)) or 'nothing'}; add it there")
    with self._lock:
      entry = self._entries.get((kind, name))
      if entry is None:
        known = sorted(n for k, n in self._entries if k == kind
                       and (allowed is None or n in allowed.names))
    if entry is None:
      raise errors.NotRegisteredError(
          f"no {kind} named {name!r} is registered; registered {kind}s: "
          f"{', '.join(known) or '(none)'}. Register it with @sidecar.{kind} in a module "
          "the sidecar imports (sidecar serve --import MODULE)")
    return entry

  def has(self, kind: str, name: str) -> bool:
    with self._lock:
      return (kind, name) in self._entries

  def names(self, kind: str) -> list[str]:
    with self._lock:
      return sorted(n for k, n in self._entries if k == kind)

  def __iter__(self) -> Iterator[Entry]:
    with self._lock:
      entries = sorted(self._entries.values(), key=lambda e: (e.kind, e.name))
    return iter(entries)

  def fingerprint(self) -> str:
    """A hash of every (kind, name, code hash): equal registries, equal fingerprints."""
    digest = hashlib.sha256()
    for e in self:
      digest.update(f"{e.kind}\0{e.name}\0{e.code_hash}\n".encode())
    return digest.hexdigest()[:16]


def _where(fn: Callable[..., Any]) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_default = Registry()


def default_registry() -> Registry:
  return _default


def set_default_registry(registry: Registry) -> Registry:
  """Replaces the default registry (for tests); returns the previous one."""
  global _default
  if not isinstance(registry, Registry):
    raise TypeError(f"registry must be a Registry, got {type(registry).__name__}")
  previous, _default = _default, registry
  return previous


def load_modules(modules: Sequence[str]) -> None:
  """Imports ``modules`` and every ``sidecar.plugins`` entry point, so decorators register."""
  for module in modules:
    try:
      importlib.import_module(module)
    except ImportError as e:
      extra = extras.extra_of(e)
      hint = f"; pip install 'colocated-sidecar[{extra}]'" if extra else _where_hint(module, e)
      raise ImportError(f"cannot import {module!r} given with --import: {e}{hint}") from e
  for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
    ep.load()


def _where_hint(module: str, e: ImportError) -> str:
  """Where Python looked, when the module named (or a package above it) is not found at
  all: the usual cause is a sidecar started from another directory than the user's code."""
  top = module.split(".")[0]
  if not isinstance(e, ModuleNotFoundError) or getattr(e, "name", None) != top:
    return ""  # its package was found; something in it, or something it imports, is not
  head = [p or "." for p in sys.path[:3]]
  more = ", ..." if len(sys.path) > 3 else ""
  return (f"; Python looked on sys.path ({', '.join(head)}{more}) from the working "
          f"directory {os.getcwd()}: start the sidecar from the directory that holds "
          f"{top}.py or {top}/, or set PYTHONPATH to that directory")


def _decorator(kind: str):
  @overload
  def register(fn: F, /) -> F: ...
  @overload
  def register(*, name: str | None = None, registry: Registry | None = None,
               identity: Callable[..., str] | None = None) -> Callable[[F], F]: ...

  def register(fn=None, /, *, name=None, registry=None, identity=None):
    def apply(f):
      (registry or _default).add(kind, name if name is not None else f.__name__, f,
                                 identity=identity)
      return f
    if fn is None:
      return apply
    if not callable(fn):
      raise TypeError(f"@sidecar.{kind} needs a callable, got {type(fn).__name__} {fn!r}; "
                      f"to name it, write @sidecar.{kind}(name=...)")
    return apply(fn)
  register.__name__ = kind
  register.__doc__ = (
      f"Registers a {kind} with the sidecar under its ``__name__`` or ``name``.\n\n"
      f"Use as ``@sidecar.{kind}`` or ``@sidecar.{kind}(name=\"...\")``; returns the "
      "callable unchanged."
      + ("\n\n``identity=f``: ``f(ctx, **kwargs)`` (called as the pipeline is) names the "
         "data a feed of it reads, a digest of its files' manifest, say (read through "
         "``ctx.data_path``, as the pipeline's files are); ``feed.state()`` records it, and "
         "a feed resumed from a state made from other data is refused, naming both::\n\n"
         "  @sidecar.pipeline(identity=lambda ctx, *, path: digest_of(ctx.data_path(path)))\n"
         "  def records(ctx, *, path): ..." if kind == PIPELINE else ""))
  return register


function = _decorator(FUNCTION)
pipeline = _decorator(PIPELINE)
