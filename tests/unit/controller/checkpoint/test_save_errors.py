"""Tier 1: a save's failure keeps its kind and host across trainer processes (fakes, threads)."""

import concurrent.futures
import errno
import threading

import numpy as np
import pytest

from sidecar._src.core import errors
from tests.support.fake_sidecars import DictPeers, FakeSidecars, checkpointer

pytestmark = pytest.mark.unit


class FullDisk(FakeSidecars):
  """Host 1's part of every step fails to write: its disk is full."""

  def prepared(self, host, final_dir, *, timeout):
    if host != 1:
      return super().prepared(host, final_dir, timeout=timeout)
    self.calls.append(("prepared", host))
    failed = concurrent.futures.Future()
    failed.set_exception(errors.CheckpointWriteError(
        "host 1 could not write step 4: No space left on device (ENOSPC) writing "
        "/ckpt/run/4.orbax-checkpoint-tmp/default/x/0", errno=errno.ENOSPC,
        path="/ckpt/run/4.orbax-checkpoint-tmp/default/x/0", host_id=1))
    return failed


def test_a_write_failure_on_another_process_keeps_its_kind_and_host():
  fake, store, outcomes = FullDisk(hosts=(0, 1)), {}, [None, None]

  def process(p: int) -> None:
    ckpt = checkpointer(fake, hosts=[0, 1], local=[p], peers=DictPeers(store, p, 2))
    with ckpt:
      try:
        ckpt.save(4, {"x": np.ones(3, np.float32)}).durable.result(30)
      except errors.SidecarError as e:
        outcomes[p] = e
  threads = [threading.Thread(target=process, args=(p,)) for p in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  for p, e in enumerate(outcomes):  # process 0 gathered it; process 1 raised it itself
    assert isinstance(e, errors.CheckpointWriteError), (p, repr(e))
    assert (e.errno, e.host_id, e.path) == (
        errno.ENOSPC, 1, "/ckpt/run/4.orbax-checkpoint-tmp/default/x/0")
    assert "No space left on device (ENOSPC)" in str(e)
  assert "the save of step 4 failed in process 1" in "".join(outcomes[0].__notes__)


def test_a_host_that_could_not_abort_is_logged_as_text_not_as_its_error(caplog):
  # A handler that keeps records (pytest's, a MemoryHandler) would otherwise keep the
  # error's traceback, its frames and the arrays in them (arena blocks) alive.
  from sidecar._src.controller.checkpoint.save_protocol import on_each

  def start(h):
    if h == 0:
      raise errors.HostLostError("host 0 is lost", host_id=0)
    f = concurrent.futures.Future()
    f.set_exception(errors.HostLostError("host 1 went away", host_id=1))
    return f

  with caplog.at_level("WARNING"):
    assert on_each(start, hosts=[0, 1], what="abort step 3") == []
  assert [r.getMessage() for r in caplog.records] == [
      "could not abort step 3 on host 0: host 0 is lost",
      "could not abort step 3 on host 1: host 1 went away"]
  assert not any(isinstance(a, BaseException) for r in caplog.records for a in r.args)
