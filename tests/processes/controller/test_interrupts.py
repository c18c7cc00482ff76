"""Tier 3: Ctrl-C (a real SIGINT) in the middle of each operation on a LocalCluster.

As a notebook's interrupt does: the operation raises KeyboardInterrupt, its blocks go
back, a save in flight is finished or aborted and swept, and the next operation works.
"""

import contextlib
import gc
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import alive, eventually
from tests.support.paths import entries

pytestmark = pytest.mark.processes

FNS = ["tests.support.notebook_fns"]


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="128MiB",
                                    imports=FNS) as c:
    yield c


@pytest.fixture
def ctl(cluster):
  with cluster.controller() as ctl:
    yield ctl


@contextlib.contextmanager
def sigint_after(seconds: float):
  """Sends this process SIGINT after ``seconds`` (as a kernel interrupt does)."""
  timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
    timer.join()


def used(ctl) -> list[int]:
  """Each sidecar's arena bytes in use, but the feed batches it keeps for re-done steps."""
  return [s.arena_used - s.arena_kept for s in ctl.status()]


def back_to(ctl, baseline: list[int]) -> bool:
  # An exception and its traceback's frames make a reference cycle: what those frames
  # held goes when the collector runs (soon, in a notebook; now, here).
  gc.collect()
  return eventually(lambda: used(ctl) == baseline, timeout=10)


def sharding(n: int = 2) -> NamedSharding:
  return NamedSharding(Mesh(np.array(jax.devices()[:n]), ("d",)), P("d"))


def test_call_interrupted_drops_its_result_and_the_next_call_works(ctl):
  baseline = used(ctl)
  with pytest.raises(KeyboardInterrupt), sigint_after(0.2):
    ctl.call("slow_block", args=(4 << 20, 1.0), hosts=[0])  # one host: the blocking path
  with pytest.raises(KeyboardInterrupt), sigint_after(0.2):
    ctl.call("slow_block", args=(4 << 20, 1.0))  # every host: futures
  assert back_to(ctl, baseline)  # the results came and went back
  assert [a.nbytes for a in ctl.call("slow_block", args=(4 << 20, 0.0))] == [4 << 20] * 2


@pytest.mark.parametrize("attach", [True, False], ids=["unix-socket", "grpc"])
def test_stream_interrupted_goes_on_in_order(cluster, attach):
  with cluster.controller(attach=attach) as ctl:
    _stream_goes_on(ctl)


def _stream_goes_on(ctl):
  baseline = used(ctl)
  with ctl.stream("slow_items", args=(1 << 20, 0.05), host=0, prefetch=4) as s:
    seen = []
    with pytest.raises(KeyboardInterrupt), sigint_after(0.3):
      for item in s:
        seen.append(int(item[0]))
    item = None  # noqa: F841  (its block goes back)
    seen.append(int(next(s)[0]))
    assert seen == list(range(len(seen)))
  assert back_to(ctl, baseline)


def test_feed_interrupted_mid_batch_keeps_the_hosts_together(ctl):
  """Host 1 is slow, so the interrupt lands after host 0's part of a batch came."""
  baseline, sh = used(ctl), sharding()
  rows = dict(width=1024, seconds=0.02, slow_shard=1)
  for delay in (0.3,):
    with ctl.feed("slow_rows", global_batch_size=8, sharding=sh, kwargs=rows) as feed:
      with pytest.raises(KeyboardInterrupt), sigint_after(delay):
        for _batch in feed:
          pass
      _batch = None  # noqa: F841  (its blocks go back)
      state = feed.state()
      got = [np.array(next(feed)["x"]) for _ in range(2)]  # copies: no block held
    with ctl.feed("slow_rows", global_batch_size=8, sharding=sh, state=state,
                  kwargs={**rows, "seconds": 0.0}) as fresh:
      want = [np.array(next(fresh)["x"]) for _ in range(2)]
    assert all((a == b).all() for a, b in zip(got, want))
  assert back_to(ctl, baseline)


def _state(sh, value: float) -> dict:
  return {f"w{i}": jax.device_put(np.full((2048, 1024), value + i, np.float32), sh)
          for i in range(4)}  # 32 MiB


@pytest.mark.parametrize("delay", [0.01, 0.15], ids=["copy", "writes"])
def test_save_interrupted_is_finished_or_aborted_and_swept(ctl, tmp_path, delay):
  sh = sharding()
  ckpt = ctl.checkpointer(str(tmp_path), max_to_keep=2)
  ckpt.save(0, _state(sh, 0)).durable.result()
  baseline = used(ctl)
  state = _state(sh, 1)
  with pytest.raises(KeyboardInterrupt), sigint_after(delay):
    ckpt.save(1, state)
    ckpt.wait()
    time.sleep(1)  # the interrupt comes, here at the latest
  del state
  ckpt.wait()
  steps = ckpt.all_steps()
  assert steps in ([0], [0, 1])
  assert entries(tmp_path) == [str(s) for s in steps]  # no partial step left
  assert back_to(ctl, baseline)  # the RAM tier holds one step, of the same size
  ckpt.save(2, _state(sh, 2)).durable.result()
  got = ckpt.restore(target=_state(sh, 0))
  assert all(float(got[f"w{i}"][0, 0]) == 2 + i for i in range(4))


@pytest.mark.parametrize("delay", [0.01], ids=["reads"])
def test_restore_interrupted_gives_its_blocks_back(ctl, tmp_path, delay):
  sh = sharding()
  ckpt = ctl.checkpointer(str(tmp_path))
  ckpt.save(0, _state(sh, 5)).durable.result()
  baseline = used(ctl)
  with contextlib.suppress(KeyboardInterrupt), sigint_after(delay):
    ckpt.restore(target=_state(sh, 0))
    time.sleep(1)
  assert back_to(ctl, baseline)
  assert eventually(lambda: all(ctl.worker(h).live_blocks == 0 for h in (0, 1)))
  got = ckpt.restore(target=_state(sh, 0))
  assert float(got["w3"][0, 0]) == 8


# ---- bad input a notebook meets --------------------------------------------


def test_a_cell_rerun_that_drops_a_cluster_stops_its_sidecars():
  """``cluster = LocalCluster(...).start()`` run twice: both run meanwhile; the first,
  no longer referenced, stops its sidecars when collected."""
  first = sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB").start()
  pid = first.pid(0)
  second = sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="8MiB").start()
  try:
    assert "running" in repr(first) and first.addresses != second.addresses
    del first
    gc.collect()
    assert eventually(lambda: not alive(pid), timeout=15)
    with second.controller() as ctl:
      assert [h.host_id for h in ctl.hosts] == [0]
  finally:
    second.close()


def test_controller_on_two_jobs_sidecars_names_both():
  small = dict(devices_per_host=1, shm_size="8MiB")
  with sidecar.testing.LocalCluster(num_hosts=1, token="job-a", **small) as a, \
       sidecar.testing.LocalCluster(num_hosts=2, token="job-b", **small) as b, \
       sidecar.testing.LocalCluster(num_hosts=2, token="job-a", imports=FNS, **small) as c:
    with pytest.raises(sidecar.AuthenticationError, match="not of one job") as info:
      sidecar.jax.Controller([a.addresses[0], b.addresses[1]], token="job-a", connect_timeout=10)
    assert a.addresses[0] in str(info.value) and b.addresses[1] in str(info.value)
    with pytest.raises(sidecar.VersionMismatchError, match="different code") as info:
      sidecar.jax.Controller([a.addresses[0], c.addresses[1]], token="job-a", connect_timeout=10)
    assert a.addresses[0] in str(info.value) and c.addresses[1] in str(info.value)
