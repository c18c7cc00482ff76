"""The error tree that errors.py draws in its docstring is the one its classes form.

Callers catch by builtin (``except KeyError``, ``except TimeoutError``) as well as by
our base: every class subclasses :class:`SidecarError`, its parent in the drawing and
the builtin named beside it, and the drawing lists every class.
"""

import builtins
import pickle
import re

import pytest

from sidecar._src.core import errors

pytestmark = pytest.mark.unit

# "    │   └── ShardsLostError   ..." -> depth 2 (4 characters a level), name, builtin.
_LINE = re.compile(r"^    ((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+)(?:\((\w+)\))?\s")


def drawn_tree() -> dict[str, tuple[str | None, str | None]]:
  """``{class name: (parent drawn above it, builtin drawn beside it)}``."""
  doc = errors.__doc__
  assert doc is not None
  drawing = doc.split("The tree::", 1)[1].split("\n\n", 2)[1]
  out: dict[str, tuple[str | None, str | None]] = {}
  parents: list[str] = []
  for line in drawing.splitlines():
    match = _LINE.match(line + " ")
    assert match, f"cannot read this line of the drawn tree: {line!r}"
    indent, name, builtin = match.groups()
    depth = len(indent) // 4 + (name != "SidecarError")
    parents = parents[:depth]
    out[name] = (parents[-1] if parents else None, builtin)
    parents.append(name)
  return out


def error_classes() -> dict[str, type]:
  return {name: v for name, v in vars(errors).items()
          if isinstance(v, type) and issubclass(v, BaseException)}


def test_the_drawing_lists_every_error_class():
  assert set(drawn_tree()) == set(error_classes())


def test_every_error_subclasses_sidecar_error():
  classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
  assert all(issubclass(c, errors.SidecarError) for c in classes)
  assert len(classes) >= 14


@pytest.mark.parametrize("name", sorted(drawn_tree()), ids=str)
def test_each_class_has_the_parent_and_builtin_drawn(name):
  parent, builtin = drawn_tree()[name]
  cls = error_classes()[name]
  if parent is None:
    assert cls.__bases__ == (Exception,)
    return
  assert issubclass(cls, errors.SidecarError) and issubclass(cls, error_classes()[parent])
  # The builtins drawn beside it and its parent are all it inherits (so the nearest).
  named = [getattr(builtins, n) for n in (builtin, drawn_tree()[parent][1]) if n]
  assert all(issubclass(cls, b) for b in named)
  inherited = {b for b in cls.__mro__ if b.__module__ == "builtins"} - {
      BaseException, Exception, object}
  assert inherited <= {c for b in named for c in b.__mro__}, (name, inherited, named)


def test_a_missing_name_reads_as_its_message_not_as_a_quoted_key():
  e = errors.NotRegisteredError("no function 'f'; registered: g, h")
  assert str(e) == "no function 'f'; registered: g, h" and isinstance(e, KeyError)
  assert str(errors.NotRegisteredError()) == ""


def test_a_remote_error_carries_type_message_host_and_traceback():
  e = errors.RemoteError("ValueError", "bad seed", "Traceback ...\n  line 3\n\n", host_id=2)
  assert (e.remote_type, e.remote_message, e.host_id) == ("ValueError", "bad seed", 2)
  assert str(e) == "ValueError: bad seed on host 2\n\nRemote traceback:\nTraceback ...\n  line 3"
  assert str(errors.RemoteError("KeyError", "'x'")) == "KeyError: 'x'"


def test_a_pipeline_error_names_the_pipeline_host_type_and_message():
  e = errors.PipelineError("lm", "builtins.FileNotFoundError", "no corpus manifest at /d",
                           "Traceback ...\n", host_id=0)
  assert isinstance(e, errors.RemoteError) and (e.pipeline, e.kind) == ("lm", "pipeline")
  assert e.remote_type == "builtins.FileNotFoundError"
  assert str(e) == ("pipeline 'lm' on host 0 raised FileNotFoundError: no corpus manifest at "
                    "/d\n\nRemote traceback:\nTraceback ...")
  s = errors.PipelineError("items", "mymod.Bad", "x", kind="stream")
  assert str(s) == "stream 'items' raised mymod.Bad: x"


def test_a_lost_host_names_itself():
  e = errors.HostLostError("sidecar of host 3 is gone", host_id=3)
  assert e.host_id == 3 and isinstance(e, ConnectionError) and str(e) == "sidecar of host 3 is gone"
  assert errors.HostLostError("gone").host_id is None


@pytest.mark.parametrize("error", [
    errors.RemoteError("builtins.KeyError", "'k'", "Traceback ...", host_id=2),
    errors.PipelineError("lm", "builtins.OSError", "m", "Traceback ...", host_id=1,
                         kind="stream"),
    errors.HostLostError("sidecar gone", host_id=1),
    errors.InvalidArgumentError("step must be >= 0, got -1"),
    errors.PipelineError.of(errors.NotFoundError("no corpus manifest at /d"), "lm", host_id=0),
], ids=lambda e: type(e).__name__)
def test_errors_survive_pickling(error):
  # A user's process pool (concurrent.futures, multiprocessing) pickles what it raises.
  back = pickle.loads(pickle.dumps(error))
  assert type(back) is type(error) and str(back) == str(error)
  assert vars(back) == vars(error)


@pytest.mark.parametrize("refusal,kind", [
    (errors.NotFoundError, errors.PipelineNotFoundError),
    (errors.PermissionDeniedError, errors.PipelinePermissionDeniedError),
    (errors.InvalidArgumentError, errors.PipelineInvalidArgumentError),
], ids=lambda c: c.__name__)
def test_the_sidecars_refusal_about_a_pipeline_is_one_of_both_kinds(refusal, kind):
  # Issue 71 item 2: `except PipelineError` missed a mistyped --data (a NotFoundError).
  e = errors.PipelineError.of(refusal("no corpus manifest at /d"), "lm", host_id=0)
  assert type(e) is kind and isinstance(e, errors.PipelineError) and isinstance(e, refusal)
  assert (e.pipeline, e.kind, e.host_id, e.remote_type) == ("lm", "pipeline", 0,
                                                            refusal.__name__)
  assert str(e) == f"pipeline 'lm' on host 0 raised {refusal.__name__}: no corpus manifest at /d"
  assert errors.PipelineError.of(errors.ResourceExhaustedError("full"), "lm", host_id=0) is None
