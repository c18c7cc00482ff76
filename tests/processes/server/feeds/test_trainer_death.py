"""A trainer SIGKILLed with a feed of worker processes open: its feed ends in the sidecar at
once, over the worker socket (attached) or gRPC (not), and with ``--feed-idle-s 0`` (no
worker kept idle for a next feed of the same work, ``server/feeds/idle.py``) its workers are
gone within a second (5 s allowed), also when they are busy in a batch (killed after
STOP_GRACE). With the default, they stay idle for a restarted trainer's feed
(tests/processes/server/feeds/test_idle_workers.py), but where busy in a batch that does
not end (``idle.DRAIN_S``): then they go as here."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import sidecar
from tests.conftest import alive, eventually
from tests.support.feed_restarts import feed_workers
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TRAINER = """
    import sys, time, numpy as np, jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import sidecar
    ctl = sidecar.jax.Controller({addresses!r}, attach={attach})
    rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    feed = ctl.feed({name!r}, kwargs={kwargs!r}, global_batch_size=8, sharding=rows,
                    options=sidecar.FeedOptions(workers=2))
    next(feed)
    print("READY", flush=True)
    if {busy}:
      open({marker!r}, "w").close()
      list(feed)  # waits while the workers sleep in their examples
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="32MiB",
                                    imports=["tests.support.feed_fns"],
                                    extra_args=["--feed-idle-s", "0"]) as c:
    yield c


@pytest.mark.parametrize("attach", [True, False], ids=["worker-socket", "grpc"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle-workers", "busy-workers"])
def test_a_killed_trainers_feed_and_workers_end_at_once(cluster, tmp_path, attach, busy):
  marker = str(tmp_path / "slow")
  code = TRAINER.format(addresses=cluster.addresses, attach=attach, busy=busy, marker=marker,
                        name="slow_while", kwargs={"marker": marker, "n": 10_000})
  trainer = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  try:
    assert "READY" in trainer.stdout.readline()
    sidecar_pid = cluster.pid(0)
    assert eventually(lambda: len(feed_workers(sidecar_pid)) == 2), feed_workers(sidecar_pid)
    workers = feed_workers(sidecar_pid)
    if busy:  # the marker made, the workers are asleep in their next examples
      assert eventually(lambda: os.path.exists(marker))
      time.sleep(1.0)
  finally:
    t0 = time.monotonic()
    trainer.kill()
    trainer.wait()
  assert eventually(lambda: not any(map(alive, workers)), timeout=5.0), workers
  took = time.monotonic() - t0
  print(f"feed workers ({'busy' if busy else 'idle'}, {'attached' if attach else 'gRPC'}) "
        f"gone {took:.3f} s after the trainer's SIGKILL")
  with cluster.controller(attach=False) as ctl:
    assert eventually(lambda: not ctl.status()[0].feeds)
    # The feed's blocks come back (over gRPC, a batch's pinned blocks as its RPC ends), but
    # those the sidecar keeps for a restarted trainer's re-done steps.
    assert eventually(lambda: (s := ctl.status()[0]).arena_used == s.arena_kept), \
        ctl.status()[0]
  assert not any(map(alive, workers))
