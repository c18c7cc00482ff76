"""Tier 3: a pipeline's error in a feed worker process (``FeedOptions(workers=N)``) reaches
the trainer as a PipelineError naming the pipeline, the host, the type and the message;
one whose workers keep dying too, never as a lost host (issue 62 item 1). The sidecar is
in this process (its log is caplog's); its feed workers are real processes."""

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.server.feeds import processes
from sidecar._src.user import registry as registry_lib
from tests.support import feed_fns

pytestmark = pytest.mark.processes

ROWS = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


@pytest.fixture
def connect(make_server):
  """A Controller of an in-process sidecar whose feed workers import feed_fns; over the
  worker socket (``attach``) or over gRPC."""
  reg = registry_lib.Registry()
  reg.add("pipeline", "raises", feed_fns.raises)
  reg.add("function", "sidecar_pid", feed_fns.sidecar_pid)
  server = make_server(registry=reg, device_ids=(0,), imports=("tests.support.feed_fns",))
  return lambda attach: sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=attach)


def failed(ctl, caplog, kwargs: dict, *, workers: int = 2) -> sidecar.PipelineError:
  """The PipelineError a feed of ``raises`` ends with, its ERROR line in the sidecar's log
  checked, and the sidecar's next call answered."""
  taken = 0
  with caplog.at_level(logging.INFO, logger="sidecar"), pytest.raises(
      sidecar.PipelineError) as info, ctl.feed(
          "raises", global_batch_size=1, sharding=ROWS, kwargs=kwargs, num_epochs=1,
          options=sidecar.FeedOptions(workers=workers)) as feed:
    for _ in feed:
      taken += 1
  assert taken < 100
  e = info.value
  assert not isinstance(e, sidecar.HostLostError)
  assert (e.pipeline, e.kind, e.host_id) == ("raises", "pipeline", 0)
  logged = [r for r in caplog.records
            if r.levelno == logging.ERROR and "'raises'" in r.getMessage()]
  assert len(logged) == 1 and logged[0].exc_info is not None
  assert e.remote_message in str(logged[0].exc_info[1])  # the worker's traceback, logged
  assert ctl.call("sidecar_pid")  # the sidecar serves on
  return e


# Every error over the worker socket; over gRPC, whose path from the feed is the same, one.
CASES = [(True, error, at) for error in feed_fns.ERRORS for at in (-1, 5)] + [
    (False, "FileNotFoundError", -1), (False, "PermissionError", 5)]


@pytest.mark.parametrize("attach,error,at", CASES, ids=[
    f"{'worker-socket' if attach else 'grpc'}-{error}-{'built' if at < 0 else 'at-a-batch'}"
    for attach, error, at in CASES])
def test_a_feed_workers_error_names_the_pipeline_host_type_and_message(connect, caplog, attach,
                                                                        error, at):
  with connect(attach) as ctl:
    e = failed(ctl, caplog, {"error": error, "at": at})
  assert e.remote_type == f"builtins.{error}"
  message = "cannot open the data in feed worker " if at < 0 else "example 5 is unreadable"
  assert str(e).startswith(f"pipeline 'raises' on host 0 raised {error}: {message}")
  assert "Remote traceback" in str(e) and "feeds/child.py" in e.remote_traceback  # the worker's
  assert "feed_fns.py" in e.remote_traceback


def test_workers_that_keep_dying_end_the_feed_naming_the_pipeline(connect, caplog, monkeypatch):
  monkeypatch.setattr(processes, "MAX_RESTARTS", 1)  # one restart, then the error
  with connect(True) as ctl:
    e = failed(ctl, caplog, {"error": "SIGKILL", "at": 5}, workers=1)
  assert e.remote_type == "FeedWorkerDied"
  assert str(e).startswith("pipeline 'raises' on host 0 raised FeedWorkerDied: feed worker 0 "
                           "of pipeline 'raises' died (killed by SIGKILL) and workers were "
                           "restarted 1 times")
