"""Tier 2: a pipeline's own error reaches the trainer as a PipelineError naming the pipeline,
the host, the exception's type and message, never as a lost host; the sidecar logs it at
ERROR with its traceback and serves on (issue 62 item 1). An OSError of the pipeline's
(FileNotFoundError, PermissionError) once closed the worker socket's stream unanswered:
``HostLostError: ... the peer closed the socket`` with the sidecar alive."""

import logging
import pickle

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from pipelines import lm as lm_lib, parquet as parquet_lib
from sidecar._src.user import registry as registry_lib
from tests.support.pool_files import BOB, controller as pool_controller, write_pool

pytestmark = pytest.mark.server

ERRORS = {e.__name__: e for e in (FileNotFoundError, PermissionError, ValueError)}


def raises(ctx, error: str, at: int = -1, iterable: bool = False):
  """Raises ``error`` while built (``at`` -1), else at example ``at``: of a plain iterable
  (``iterable``, its iterator: 0 is before the first batch) or of a MapDataset."""
  def element(i):
    if i == at:
      raise ERRORS[error](f"example {i} is unreadable")
    return {"x": np.int64(i)}
  if at < 0:
    raise ERRORS[error](f"cannot open the data of {ctx.shard_index}")
  if iterable:
    return map(element, range(100))
  return grain.MapDataset.range(100).map(element)


def items(error: str, at: int = -1):
  if at < 0:
    raise ERRORS[error]("cannot open the items")
  for i in range(10):
    if i == at:
      raise ERRORS[error](f"item {i} is unreadable")
    yield i


def opens(path: str):
  with open(path):
    return 0


def add(a, b):
  return a + b


@pytest.fixture(params=[True, False], ids=["worker-socket", "grpc"])
def ctl(make_server, request):
  reg = registry_lib.Registry()
  reg.add("pipeline", "raises", raises)
  reg.add("pipeline", "lm", lm_lib.lm)
  reg.add("pipeline", "parquet", parquet_lib.parquet)
  reg.add("function", "items", items)
  reg.add("function", "opens", opens)
  reg.add("function", "add", add)
  server = make_server(registry=reg, device_ids=(0,))
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=request.param) as c:
    assert (c.worker(0) is not None) is request.param
    yield c


ROWS = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def feed(ctl, name: str, kwargs: dict, taken: list | None = None) -> None:
  """Reads a feed of ``name`` (batches of one) to its end; each batch's "x" into ``taken``."""
  with ctl.feed(name, global_batch_size=1, sharding=ROWS, kwargs=kwargs, num_epochs=1) as f:
    for batch in f:
      if taken is not None:
        taken.append(int(np.asarray(batch["x"])[0]))


def pipeline_failed(ctl, caplog, run, *, name: str, error: str, message: str,
                    kind: str = "pipeline") -> sidecar.PipelineError:
  """``run()``'s PipelineError, checked; the sidecar's ERROR line with the traceback
  checked, and the sidecar's next call answered."""
  with caplog.at_level(logging.INFO, logger="sidecar"):
    with pytest.raises(sidecar.PipelineError) as info:
      run()
  e = info.value
  assert isinstance(e, sidecar.RemoteError) and not isinstance(e, sidecar.HostLostError)
  assert (e.pipeline, e.kind, e.host_id) == (name, kind, 0)
  assert e.remote_type == f"builtins.{error}"
  assert str(e).startswith(f"{kind} {name!r} on host 0 raised {error}: ")
  assert message in e.remote_message and message in str(e)
  assert "Remote traceback" in str(e)  # where in the pipeline it raised
  logged = [r for r in caplog.records if r.levelno == logging.ERROR and name in r.getMessage()]
  assert len(logged) == 1, [r.getMessage() for r in caplog.records]
  assert f"raised {error}: " in logged[0].getMessage() and message in logged[0].getMessage()
  assert logged[0].exc_info is not None  # with its traceback
  assert ctl.call("add", args=(2, 3)) == [5]  # the sidecar serves on
  return e


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("at,iterable,taken", [(-1, False, []), (0, True, []), (2, True, [0, 1]),
                                               (2, False, None)],
                         ids=["built", "iterator-first", "iterable-3rd", "map-3rd"])
def test_a_pipelines_error_names_the_pipeline_host_type_and_message(ctl, caplog, error, at,
                                                                     iterable, taken):
  got = []
  run = lambda: feed(ctl, "raises", {"error": error, "at": at, "iterable": iterable},  # noqa: E731
                     got)
  message = "cannot open the data of 0" if at < 0 else f"example {at} is unreadable"
  pipeline_failed(ctl, caplog, run, name="raises", error=error, message=message)
  if taken is not None:  # the batches before it came (a map's order is shuffled)
    assert got == taken
  else:
    assert len(got) < 100


@pytest.mark.parametrize("error", ERRORS)
def test_a_feed_length_question_gets_the_pipelines_error(ctl, caplog, error):
  pipeline_failed(ctl, caplog, lambda: ctl.feed_length(
      "raises", global_batch_size=1, kwargs={"error": error}, num_epochs=1),
                  name="raises", error=error, message="cannot open the data of 0")


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("at", [-1, 2], ids=["built", "3rd"])
def test_a_streams_error_names_the_function(ctl, caplog, error, at):
  got = []

  def run():
    with ctl.stream("items", kwargs={"error": error, "at": at}) as s:
      got.extend(s)

  message = "cannot open the items" if at < 0 else "item 2 is unreadable"
  pipeline_failed(ctl, caplog, run, name="items", error=error, message=message, kind="stream")
  assert got == list(range(max(at, 0)))


def not_found(ctl, caplog, run, *, name: str, message: str) -> sidecar.PipelineError:
  """``run()``'s PipelineNotFoundError (a path the pipeline was given is not there: the
  data paths' own error), one type to catch with the pipeline's own errors (issue 71 item
  2), and still a NotFoundError and a FileNotFoundError; named with the pipeline and the
  host; the sidecar's ERROR line with the traceback (as PipelineError says), and the
  sidecar's next call answered."""
  with caplog.at_level(logging.INFO, logger="sidecar"):
    with pytest.raises(sidecar.PipelineError) as info:
      run()
  e = info.value
  assert type(e) is sidecar.PipelineNotFoundError
  assert isinstance(e, sidecar.NotFoundError) and isinstance(e, FileNotFoundError)
  assert not isinstance(e, sidecar.HostLostError)
  assert (e.pipeline, e.kind, e.host_id, e.remote_type) == (name, "pipeline", 0, "NotFoundError")
  assert str(e).startswith(f"pipeline {name!r} on host 0 raised NotFoundError: "), str(e)
  assert message in str(e) and message in e.remote_message
  assert pickle.loads(pickle.dumps(e)).args == e.args  # a user's process pool keeps its kind
  assert type(pickle.loads(pickle.dumps(e))) is sidecar.PipelineNotFoundError
  logged = [r for r in caplog.records if r.levelno >= logging.WARNING and name in r.getMessage()]
  assert [r.levelno for r in logged] == [logging.ERROR], [r.getMessage() for r in logged]
  assert "raised NotFoundError: " in logged[0].getMessage() and message in logged[0].getMessage()
  assert logged[0].exc_info is not None  # with its traceback
  assert ctl.call("add", args=(2, 3)) == [5]  # the sidecar serves on
  return e


def test_lm_on_a_mistyped_directory_says_to_prepare_the_corpus(ctl, caplog, tmp_path):
  corpus = tmp_path / "lm-data"  # a real corpus, and --data with a typo
  lm_lib.write_corpus(corpus, [bytes(range(256)) * 8], record_bytes=256, shard_bytes=1024)
  typo = tmp_path / "lm-dta"
  not_found(ctl, caplog, lambda: feed(ctl, "lm", {"data": str(typo), "seq_len": 8}),
            name="lm", message=f"no corpus manifest at {typo}/manifest.json: run "
                               f"examples/lm/prepare.py --out {typo}")
  with ctl.feed("lm", global_batch_size=1, sharding=ROWS,  # the right one feeds
                kwargs={"data": str(corpus), "seq_len": 8}) as f:
    assert np.asarray(next(f)["tokens"]).shape == (1, 9)


def test_lm_on_a_directory_that_is_no_corpus_says_to_prepare_the_corpus(ctl, caplog, tmp_path):
  (tmp_path / "notes.txt").write_text("not a corpus")
  not_found(ctl, caplog, lambda: feed(ctl, "lm", {"data": str(tmp_path), "seq_len": 8}),
            name="lm", message=f"no corpus manifest at {tmp_path}/manifest.json")


def test_parquet_on_a_missing_path_names_it(ctl, caplog, tmp_path):
  missing = tmp_path / "train" / "part-0.parquet"
  not_found(ctl, caplog, lambda: feed(ctl, "parquet", {"paths": str(missing)}),
            name="parquet", message=f"no Parquet file at {str(missing)!r}")


def test_a_calls_oserror_is_its_remote_error_not_a_lost_host(ctl, tmp_path):
  for path in (tmp_path / "missing", tmp_path):  # FileNotFoundError, IsADirectoryError
    with pytest.raises(sidecar.RemoteError, match=r"builtins\.(FileNotFoundError|IsADirectory"
                                                  r"Error): \[Errno \d+\] .* on host 0") as info:
      ctl.call("opens", args=(str(path),))
    assert not isinstance(info.value, sidecar.PipelineError)
  assert ctl.call("add", args=(2, 3)) == [5]


def test_the_sidecars_own_permission_error_in_a_stream_is_answered(make_server, tmp_path):
  # PermissionDeniedError is an OSError: the worker socket's stream once took it for its
  # own closed socket, and bob read "HostLostError: ... the peer closed the socket".
  server = make_server(pool=write_pool(tmp_path))
  with pool_controller(server, BOB, attach=True) as bob:
    assert bob.worker(0) is not None
    with pytest.raises(sidecar.PermissionDeniedError, match="tenant 'bob' may not run function "
                                                            "'count'") as info:
      list(bob.stream("count", kwargs={"n": 3}))
    assert isinstance(info.value, sidecar.PipelineError)  # one type for a stream's errors
    assert bob.call("add", args=(2, 3)) == [5]
