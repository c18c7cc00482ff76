"""User arguments in ``args=``/``kwargs=``, apart from the controller's own options.

Tier 1 (no sockets) for the containers and the deprecated shorthand; tier 2 (one
in-process server) for a function parameter named ``timeout`` and a pipeline parameter
named ``seed`` going through.
"""

import warnings

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.controller import arguments
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.server


def named_like_ours(timeout, hosts=None, name=None, args=None, kwargs=None):
  return {"timeout": timeout, "hosts": hosts, "name": name, "args": args, "kwargs": kwargs}


def count(n: int, scale: float = 1.0, *rest: int, table: np.ndarray | None = None, free=None):
  return n * scale + sum(rest) + (0 if table is None else float(table.sum()))


def seeded(ctx: sidecar.PipelineContext, seed: int = 0, n: int = 8):
  """Example i is ``seed * 1000 + i``: the pipeline's own seed, not the feed's shuffle seed."""
  return grain.MapDataset.range(n).map(lambda i: {"id": np.int64(seed * 1000 + i)})


@pytest.fixture
def ctl(make_server):
  reg = registry_lib.Registry()
  reg.add("function", "named_like_ours", named_like_ours)
  reg.add("function", "add", lambda a, b=0: a + b)
  reg.add("pipeline", "seeded", seeded)
  reg.add("function", "count", count)
  server = make_server(registry=reg, device_ids=(0,))
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as c:
    yield c


@pytest.mark.parametrize("args,kwargs,match", [
    ("ab", None, r"ctl.call\('f'\): args must be a tuple .*got str 'ab'; write args=\(x,\)"),
    (np.zeros(2), None, "args must be a tuple"),
    ((), [("a", 1)], r"kwargs must be a mapping of parameter names \(str\) to values"),
    ((), {1: 2}, r"kwargs must be a mapping of parameter names \(str\)"),
], ids=["str-args", "array-args", "list-kwargs", "int-key"])
def test_containers_of_the_wrong_type_name_the_argument(args, kwargs, match):
  with pytest.raises(sidecar.InvalidArgumentError, match=match):
    arguments.check(args, kwargs, where="ctl.call('f')")


def test_the_containers_are_copied_into_a_tuple_and_a_dict():
  assert arguments.check([1, 2], None, where="w") == ((1, 2), {})
  assert arguments.check((), {"seed": 3}, where="w") == ((), {"seed": 3})


def test_the_shorthand_warns_with_the_new_spelling_and_both_at_once_is_refused():
  with pytest.warns(DeprecationWarning,
                    match=r"write ctl.call\('f', args=\(\.\.\.,\), "
                          r"kwargs=\{'b': \.\.\.\}, \.\.\.\)"):
    got = arguments.split_legacy("call", "f", (), None, (1,), {"b": 2}, stacklevel=2)
  assert got == ((1,), {"b": 2})
  with pytest.raises(TypeError, match=r"both in args=/kwargs= and as extra arguments"):
    arguments.split_legacy("call", "f", (1,), None, (2,), {}, stacklevel=2)


def test_a_function_parameter_named_timeout_or_hosts_goes_through(ctl):
  (got,) = ctl.call("named_like_ours", kwargs={"timeout": 7, "hosts": [9], "name": "n"},
                    hosts=[ctl.hosts[0].host_id], timeout=30)
  assert got == {"timeout": 7, "hosts": [9], "name": "n", "args": None, "kwargs": None}
  # Names that are our containers' names are the function's too, inside kwargs.
  (got,) = ctl.call("named_like_ours", args=(1,), kwargs={"args": (2,), "kwargs": {"k": 3}})
  assert (got["timeout"], got["args"], got["kwargs"]) == (1, (2,), {"k": 3})
  (f,) = ctl.call_async("named_like_ours", kwargs={"timeout": 0.5})
  assert f.result()["timeout"] == 0.5


def test_the_old_shorthand_still_works_with_a_warning_at_the_callers_line(ctl):
  with pytest.warns(DeprecationWarning, match=r"write ctl.call\('add', args=\(\.\.\., \.\.\.\)")\
      as caught:
    assert ctl.call("add", 2, 3) == [5]
  assert caught[0].filename == __file__
  with pytest.warns(DeprecationWarning, match=r"ctl.call_async\('add'"):
    assert ctl.call_async("add", 1, b=2)[0].result() == 3
  with pytest.raises(TypeError, match=r"pass them all in args=\(\.\.\.\) and kwargs="):
    ctl.call("add", 1, args=(2,))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the new spelling warns about nothing
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


def _sharding():
  return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def test_a_pipeline_parameter_named_seed_goes_through_apart_from_the_feed_seed(ctl):
  with ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), kwargs={"seed": 3},
                seed=11, num_epochs=1, options=sidecar.FeedOptions(prefetch=1)) as feed:
    ids = sorted(i for b in feed for i in np.asarray(b["id"]).tolist())
  assert ids == [3000 + i for i in range(8)]


def test_pipeline_arguments_are_checked_against_its_annotations(ctl):
  with ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), kwargs={"n": "ten"}) as feed:
    with pytest.raises(sidecar.InvalidArgumentError,
                       match=r"pipeline 'seeded': argument 'n' must be int \(as annotated\), "
                             r"got str 'ten'"):
      next(feed)


def test_the_old_feed_shorthand_still_works_with_a_warning(ctl):
  with pytest.warns(DeprecationWarning) as caught:
    feed = ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), num_epochs=1, seed=0,
                    prefetch=1, n=4)
  with feed:
    assert sorted(np.asarray(next(feed)["id"]).tolist()) == [0, 1, 2, 3]
  messages = sorted(str(w.message) for w in caught)
  assert "options=sidecar.FeedOptions(prefetch=1)" in messages[0]
  assert "ctl.feed('seeded', kwargs={'n': ...}, ...)" in messages[1]
  assert {w.filename for w in caught} == {__file__}
  with pytest.raises(TypeError, match=r"put all of the pipeline's arguments in kwargs="):
    ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), kwargs={"seed": 1}, n=4)
  with pytest.raises(TypeError, match=r"got options=\.\.\. and workers= too"):
    ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), kwargs={"seed": 1},
             options=sidecar.FeedOptions(), workers=2)
  with pytest.raises(sidecar.InvalidArgumentError, match="prefetch must be a positive int"), \
      pytest.warns(DeprecationWarning):
    ctl.feed("seeded", global_batch_size=4, sharding=_sharding(), prefetch=0)


def test_function_arguments_are_checked_against_its_annotations(ctl):
  # issue 35 item 14: a pipeline's were checked, a function's ran with whatever came.
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"function 'count': argument 'n' must be int \(as annotated\), "
                           r"got str 'x'"):
    ctl.call("count", args=("x",))
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"argument 'scale' must be float \(as annotated\), got str '2'"):
    ctl.call("count", args=(1,), kwargs={"scale": "2"})
  with pytest.raises(sidecar.InvalidArgumentError,
                     match=r"argument 'rest\[1\]' must be int \(as annotated\), got float 2.5"):
    ctl.call("count", args=(1, 1.0, 2, 2.5))
  # What the annotations allow goes through: numpy scalars for int, an int for float, an
  # array for np.ndarray, anything for an unannotated parameter.
  assert ctl.call("count", args=(np.int64(2), 3, 4),
                  kwargs={"table": np.ones(3), "free": object.__name__}) == [13.0]
