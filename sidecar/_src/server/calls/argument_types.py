"""A registered function's or pipeline's arguments checked against its annotations.

A value of the wrong type for a parameter annotated with a plain type (``n: int``)
would fail somewhere inside the function or pipeline as a remote TypeError, or not at
all and make other data; it is refused at the start, naming the parameter and the type.
Only what the codec can carry is checked: bool, int, float, str, bytes, None, the
containers (list, tuple, dict) by their own type, ``Literal``, ``Optional`` and
unions of those. Any other annotation (a class of the user's, ``np.ndarray``,
``Sequence[int]``) is the pipeline's to check.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sidecar._src.core import errors

_UNCHECKED = object()  # an annotation this module does not judge


def check(fn: Callable[..., Any], kwargs: Mapping[str, Any], *, what: str) -> None:
  """Raises InvalidArgumentError for the first of ``kwargs`` its annotation refuses.

  ``what`` names ``fn`` in the message, e.g. ``"pipeline 'ids'"``.
  """
  hints = _hints(fn)
  for name, value in kwargs.items():
    _check_one(hints.get(name, _UNCHECKED), name, value, what=what)


def check_call(fn: Callable[..., Any], signature: inspect.Signature, args: tuple,
               kwargs: Mapping[str, Any], *, what: str) -> None:
  """As :func:`check`, for positional and keyword arguments both, bound to ``signature``
  (which must accept them): each element of ``*args`` and each value of ``**kwargs``
  against their parameter's annotation.
  """
  hints = _hints(fn)
  for name, value in signature.bind(*args, **kwargs).arguments.items():
    hint = hints.get(name, _UNCHECKED)
    kind = signature.parameters[name].kind
    if kind is inspect.Parameter.VAR_POSITIONAL:
      for i, v in enumerate(value):
        _check_one(hint, f"{name}[{i}]", v, what=what)
    elif kind is inspect.Parameter.VAR_KEYWORD:
      for key, v in value.items():
        _check_one(hint, key, v, what=what)
    else:
      _check_one(hint, name, value, what=what)


def _check_one(hint: Any, name: str, value: Any, *, what: str) -> None:
  if hint is _UNCHECKED or _accepts(hint, value) is not False:
    return
  raise errors.InvalidArgumentError(
      f"{what}: argument {name!r} must be {_describe(hint)} (as annotated), got "
      f"{type(value).__name__} {value!r:.60}")


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
  try:
    return _cached_hints(fn)
  except TypeError:  # unhashable callable
    return _resolve(fn)


@functools.lru_cache(maxsize=256)
def _cached_hints(fn: Callable[..., Any]) -> dict[str, Any]:
  return _resolve(fn)


def _resolve(fn: Callable[..., Any]) -> dict[str, Any]:
  try:
    return typing.get_type_hints(fn)
  except Exception:  # a name the annotations use is not importable here: check none
    return {}


_PLAIN: dict[Any, Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, (bool, np.bool_)),
    int: lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float, np.integer, np.floating))
    and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, bytes),
    type(None): lambda v: v is None,
    list: lambda v: isinstance(v, list),
    tuple: lambda v: isinstance(v, tuple),
    dict: lambda v: isinstance(v, dict),
}


def _accepts(hint: Any, value: Any) -> bool | None:
  """Whether ``hint`` accepts ``value``; None where it is no annotation judged here."""
  if hint is None:
    hint = type(None)
  if hint in _PLAIN:
    return _PLAIN[hint](value)
  origin = typing.get_origin(hint)
  if origin is typing.Literal:
    return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
  if origin is typing.Union or origin is types.UnionType:
    verdicts = [_accepts(h, value) for h in typing.get_args(hint)]
    return True if True in verdicts or None in verdicts else False
  if origin in (list, tuple, dict):
    return _PLAIN[origin](value)
  return None


def _describe(hint: Any) -> str:
  if hint is None or hint is type(None):
    return "None"
  if isinstance(hint, type):
    return hint.__name__
  return str(hint).replace("typing.", "")
