"""Tier 3: a sidecar that stops answering (SIGSTOP) ends what waits on it with HostLostError.

Over the worker's Unix socket (a feed, a call, an arena request) and over gRPC (a feed without a
worker), with a short peer timeout. Each wait is guarded: a watchdog SIGCONTs the sidecar
after a while, so a regression shows as a feed that goes on (a failure), never a hang.
"""

import contextlib
import gc
import os
import signal
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from tests.conftest import eventually

pytestmark = pytest.mark.processes

# Long enough that a sidecar that merely waits for a core (a load of 4 on 2 cores) still
# answers the attach, the handshake and gRPC's keepalive pings (half of it each) in time.
PEER_TIMEOUT = 3.0
WATCHDOG_S = 60.0  # far past PEER_TIMEOUT: a hang would be this long, then a failure


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.feed_fns",
                                             "tests.support.sidecar_fns"]) as c:
    yield c


@contextlib.contextmanager
def stopped(cluster):
  """The sidecar SIGSTOPped for the body; SIGCONTed after it, or by the watchdog."""
  pid = cluster.pid(0)
  resumed = threading.Event()

  def resume():
    if not resumed.is_set():
      resumed.set()
      os.kill(pid, signal.SIGCONT)

  watchdog = threading.Timer(WATCHDOG_S, resume)
  os.kill(pid, signal.SIGSTOP)
  watchdog.start()
  # The stop reaches each thread as it next runs: one running on the other core could
  # still answer a request sent at once (.ci/run saw an alloc answered "after" SIGSTOP).
  assert eventually(lambda: all_threads_stopped(pid), timeout=10)
  try:
    yield
  finally:
    watchdog.cancel()
    resume()


def all_threads_stopped(pid: int) -> bool:
  """Whether every thread of ``pid`` is stopped (state T in /proc)."""
  states = []
  for task in os.listdir(f"/proc/{pid}/task"):
    try:
      with open(f"/proc/{pid}/task/{task}/stat") as f:
        states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:  # a thread that ended meanwhile
      pass
  return all(state in ("T", "t") for state in states)


def sharding():
  return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


@pytest.mark.parametrize("attach", [True, False], ids=["unix-socket", "grpc"])
def test_a_stopped_sidecar_ends_a_feed_with_host_lost(cluster, attach):
  with cluster.controller(attach=attach, silence_timeout=PEER_TIMEOUT) as ctl:
    assert (ctl.worker(0) is not None) == attach
    with ctl.feed("ids", kwargs={"n": 4096}, global_batch_size=4, sharding=sharding()) as feed:
      next(feed)
      with stopped(cluster), pytest.raises(sidecar.HostLostError) as info:
        for _ in range(1000):  # more than the prefetch: it must wait on the sidecar
          next(feed)
      assert info.value.host_id == 0
      with pytest.raises(sidecar.ClosedError):
        next(feed)
  gc.collect()  # the traceback's frames held the last batch's arrays in a cycle
  # SIGCONTed, the sidecar serves again, and the lost worker's blocks came back.
  with cluster.controller() as ctl:
    assert ctl.call("sidecar_pid") == [cluster.pid(0)]
    assert eventually(lambda: (s := ctl.status()[0]).arena_used == s.arena_kept  # (re-done
                      and s.workers == 1)  # steps' batches, kept)


def test_a_stopped_sidecar_ends_a_call_over_its_socket_with_host_lost(cluster):
  # The call's own timeout is far longer: the sidecar is found silent, not waited out.
  with cluster.controller(silence_timeout=PEER_TIMEOUT, timeout=WATCHDOG_S) as ctl:
    assert ctl.worker(0) is not None and ctl.call("sidecar_pid") == [cluster.pid(0)]
    with stopped(cluster), pytest.raises(sidecar.HostLostError) as info:
      ctl.call("sidecar_pid")
    assert info.value.host_id == 0 and "call 'sidecar_pid' on host 0" in str(info.value)
  with cluster.controller() as ctl:  # SIGCONTed, it serves again
    assert ctl.call("sidecar_pid") == [cluster.pid(0)]


def test_a_call_longer_than_the_peer_timeout_is_waited_for(cluster):
  # A busy sidecar answers the ping while the call runs: slow is not lost.
  with cluster.controller(silence_timeout=PEER_TIMEOUT, timeout=WATCHDOG_S) as ctl:
    assert ctl.worker(0) is not None
    assert ctl.call("sleep", args=(2.5 * PEER_TIMEOUT,)) == [2.5 * PEER_TIMEOUT]
    [future] = ctl.call_async("sleep", args=(1.5 * PEER_TIMEOUT,))
    assert future.result() == 1.5 * PEER_TIMEOUT


def test_a_stopped_sidecar_fails_an_arena_request_and_every_later_one(cluster):
  w = sidecar.jax.Worker(cluster.socket(0))  # attached with the default timeout, then
  w.timeout = PEER_TIMEOUT                # the short one for the request that hangs
  try:
    with stopped(cluster):
      with pytest.raises(sidecar.HostLostError, match="did not answer 'alloc'"):
        w.put(np.zeros(16, np.uint8))
    with pytest.raises(sidecar.HostLostError, match="counts as lost"):
      w.put(np.zeros(16, np.uint8))  # its late answer is never taken for this one's
  finally:
    w.close()
