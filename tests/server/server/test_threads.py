"""Tier 2: the threads of a sidecar's worker socket, its gRPC servers and a Worker end with
their owner's close(), joined there (tests/conftest.py's no_thread_leak checks every test)."""

import gc
import threading

import numpy as np
import pytest

import sidecar
from tests.conftest import eventually

pytestmark = pytest.mark.server


def test_the_worker_sockets_accept_thread_is_joined_by_the_servers_stop(make_server):
  server = make_server()
  (accept,) = [t for t in threading.enumerate() if t is server.workers._thread]
  assert accept.name == "sidecar-workers" and accept.is_alive()
  server.stop(grace=0)
  assert not accept.is_alive()  # it was blocked in accept() for good


def test_the_grpc_servers_thread_pools_are_joined_by_the_servers_stop(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
  pools = [t for p in server._executors for t in p._threads]
  assert {t.name.rsplit("_", 1)[0] for t in pools} >= {"sidecar-rpc"} and all(
      t.is_alive() for t in pools)
  server.stop(grace=0)
  assert not any(t.is_alive() for t in pools)  # an idle pool's threads had waited for ever


def test_a_workers_releasing_thread_is_joined_by_close_once_no_block_is_read(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    worker = ctl.worker(0)
    releaser = worker._releaser
    assert releaser.name == "sidecar-worker-free" and releaser.is_alive()
    (kept,) = ctl.call("echo", args=(np.arange(1 << 16, dtype=np.int64),))  # in the arena
    assert eventually(lambda: worker.live_blocks == 1)  # the argument's went back
  assert releaser.is_alive()  # it sends the frees of the arrays still read
  del kept
  gc.collect()
  assert eventually(lambda: worker.live_blocks == 0)
  worker.close()  # closed already: joins the thread, which ended with the last block
  assert not releaser.is_alive()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    worker = ctl.worker(0)
    releaser = worker._releaser
  assert not releaser.is_alive()
