"""User arguments in their own containers, apart from the controller's options.

``ctl.call("f", args=(x,), kwargs={"timeout": 5})`` passes ``timeout`` to ``f``;
``ctl.call("f", x, timeout=5)`` (the old shorthand) meant the call's deadline. Keeping
what the user's function takes in ``args``/``kwargs``, as Orbax's dispatch keeps
``func_args``/``func_kwargs``, means no parameter name of a user's function or pipeline
(``seed``, ``timeout``, ``hosts``, ``name``) can collide with ours.

The shorthand still works, with a ``DeprecationWarning`` that shows the new spelling:
``split_legacy`` turns it into the containers.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar._src.core import errors, options as options_lib

# The names of FeedOptions' fields: the deprecated keywords of a feed that go to options.
FEED_OPTIONS = [f.name for f in dataclasses.fields(options_lib.FeedOptions)]

# warnings.warn's stacklevel from split_legacy to the user's line: split_legacy, the
# Controller method, interrupts.deferring's wrapper.
_STACKLEVEL = 4


def check(args: Any, kwargs: Any, *, where: str) -> tuple[tuple, dict[str, Any]]:
  """``args`` as a tuple and ``kwargs`` as a dict of str keys.

  Raises:
    InvalidArgumentError: ``args`` is not a tuple or list, or ``kwargs`` not a mapping
      with str keys; the message names the argument of ``where``.
  """
  if not isinstance(args, (tuple, list)):
    raise errors.InvalidArgumentError(
        f"{where}: args must be a tuple of the function's positional arguments, got "
        f"{type(args).__name__} {args!r:.80}; write args=(x,) for one")
  if kwargs is None:
    kwargs = {}
  if not isinstance(kwargs, Mapping) or any(not isinstance(k, str) for k in kwargs):
    raise errors.InvalidArgumentError(
        f"{where}: kwargs must be a mapping of parameter names (str) to values, got "
        f"{kwargs!r:.80}")
  return tuple(args), dict(kwargs)


def _spell(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
  parts = []
  if args:
    parts.append("args=(...,)" if len(args) == 1 else f"args=({', '.join('...' for _ in args)})")
  if kwargs:
    parts.append("kwargs={" + ", ".join(f"{k!r}: ..." for k in kwargs) + "}")
  return ", ".join(parts)


def split_legacy(method: str, name: str, args: Any, kwargs: Any, legacy_args: tuple,
                 legacy_kwargs: dict[str, Any], *, stacklevel: int = _STACKLEVEL
                 ) -> tuple[tuple, dict[str, Any]]:
  """The user's arguments, from ``args``/``kwargs`` or the deprecated shorthand.

  Args:
    method: ``"call"``, ``"call_async"`` or ``"stream"``, for the messages.
    name: the registered function's name, for the messages.
    args: the ``args=`` container (``()`` when not given).
    kwargs: the ``kwargs=`` container (None when not given).
    legacy_args: positional arguments after ``name`` (the shorthand).
    legacy_kwargs: keyword arguments the method does not know (the shorthand).
    stacklevel: frames from here up to the user's line, for the warning.

  Raises:
    TypeError: both spellings at once.
    InvalidArgumentError: a container of the wrong type.
  """
  where = f"ctl.{method}({name!r})"
  if not legacy_args and not legacy_kwargs:
    return check(args, kwargs, where=where)
  if args or kwargs:
    raise TypeError(
        f"{where} got user arguments both in args=/kwargs= and as extra arguments "
        f"({_spell(legacy_args, legacy_kwargs)}); pass them all in args=(...) and kwargs={{...}}")
  warnings.warn(
      f"{where} with the function's arguments given directly is deprecated: write "
      f"ctl.{method}({name!r}, {_spell(legacy_args, legacy_kwargs)}, ...); a parameter "
      "named like an option of ours (hosts, timeout, ...) can only be passed that way",
      DeprecationWarning, stacklevel=stacklevel)
  return check(legacy_args, legacy_kwargs, where=where)


def split_legacy_feed(name: str, kwargs: Any, options: Any, legacy_kwargs: dict[str, Any],
                      option_names: Sequence[str]
                      ) -> tuple[dict[str, Any], options_lib.FeedOptions | None]:
  """The pipeline's kwargs and the feed options given the old way, from ``ctl.feed``.

  The old ``ctl.feed(name, ..., prefetch=, workers=, **pipeline_kwargs)`` took both in
  one namespace; each part still works, with a ``DeprecationWarning`` naming the new one.

  Returns:
    The pipeline's keyword arguments, and the options: ``options``, or those (of
    ``option_names``) given as keywords.

  Raises:
    TypeError: both spellings of the same thing at once.
    InvalidArgumentError: ``kwargs`` is not a mapping with str keys; a bad option.
  """
  where = f"ctl.feed({name!r})"
  old_options = {k: v for k, v in legacy_kwargs.items() if k in option_names}
  old_kwargs = {k: v for k, v in legacy_kwargs.items() if k not in option_names}
  if old_options:
    if options is not None:
      raise TypeError(f"{where} got options=... and {', '.join(old_options)}= too; put "
                      "them all in options=sidecar.FeedOptions(...)")
    spelled = ", ".join(f"{k}={v!r}" for k, v in old_options.items())
    warnings.warn(f"{where} with {', '.join(old_options)}= is deprecated: write "
                  f"options=sidecar.FeedOptions({spelled})", DeprecationWarning, stacklevel=3)
    try:
      options = options_lib.FeedOptions(**old_options)
    except ValueError as e:
      raise errors.InvalidArgumentError(str(e)) from None
  if old_kwargs:
    if kwargs is not None:
      raise TypeError(
          f"{where} got kwargs=... and extra keyword arguments ({', '.join(old_kwargs)}); "
          "put all of the pipeline's arguments in kwargs={...}")
    warnings.warn(
        f"{where} with the pipeline's arguments given directly is deprecated: write "
        f"ctl.feed({name!r}, {_spell((), old_kwargs)}, ...); a parameter named like an "
        "option of ours (seed, state, ...) can only be passed that way",
        DeprecationWarning, stacklevel=3)
    kwargs = old_kwargs
  _, kwargs = check((), kwargs, where=where)
  return kwargs, options
