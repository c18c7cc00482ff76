import gc

import numpy as np
import pytest

import sidecar
from sidecar._src.arena import worker as worker_lib
from sidecar._src.streams import consumer, socket_transport
from tests.conftest import eventually

pytestmark = pytest.mark.server


@pytest.mark.parametrize("address,path", [
    ("unix:///run/s.sock", "/run/s.sock"), ("unix:/run/s.sock", "/run/s.sock"),
    ("/tmp/x.sock", "/tmp/x.sock")], ids=["unix-3-slash", "unix-1-slash", "path"])
def test_socket_path(address, path):
  assert worker_lib.socket_path(address) == path


def test_socket_path_errors(monkeypatch):
  monkeypatch.delenv("SIDECAR_ADDRESS", raising=False)
  with pytest.raises(sidecar.InvalidArgumentError, match="set SIDECAR_ADDRESS"):
    worker_lib.socket_path(None)
  with pytest.raises(sidecar.InvalidArgumentError, match="is not a Unix socket"):
    worker_lib.socket_path("10.0.0.1:8470")


def test_no_sidecar_at_the_path(tmp_path):
  with pytest.raises(sidecar.HostLostError,
                     match="cannot attach to the sidecar at .*sidecar serve"):
    sidecar.jax.Worker(str(tmp_path / "none.sock"), timeout=1)


def test_worker_from_env_allocates_and_frees(make_server, monkeypatch):
  server = make_server(host_id=4)
  monkeypatch.setenv("SIDECAR_ADDRESS", f"unix://{server.options.socket_path}")
  with sidecar.jax.Worker() as w:
    assert w.host_id == 4 and w.identity["device_ids"] == []
    a, ref = w.put(np.arange(1000, dtype=np.int64))
    assert np.shares_memory(a, w.arena.buffer) and ref.offset % 4096 == 0
    assert server.leases.allocator.used_bytes > 0
    with pytest.raises(sidecar.ResourceExhaustedError, match="cannot fit an arena"):
      w.empty((64 << 20,), np.uint8)
    del a
    gc.collect()
  # close() ended the session: everything it held went back.
  assert eventually(lambda: server.leases.allocator.used_bytes == 0)
  with pytest.raises(sidecar.ClosedError):
    w.empty((4,), np.uint8)


def test_a_saves_blocks_come_in_one_request_all_or_none(make_server, monkeypatch):
  server = make_server()
  with sidecar.jax.Worker(server.options.socket_path) as w:
    requests = []
    send = w._request
    monkeypatch.setattr(w, "_request", lambda m, **kw: requests.append(m["op"]) or send(m, **kw))
    shards = [np.zeros((3, 4), np.float32), np.zeros((0,), np.int8), np.zeros(5000, np.uint8)]
    got = w.empty_like(shards)
    assert requests == ["alloc"]
    assert [(a.shape, a.dtype) for a, _ in got] == [(s.shape, s.dtype) for s in shards]
    assert len({ref.offset for _, ref in got}) == 3
    for i, (a, _) in enumerate(got):
      a[...] = i
    assert [int(a.sum()) for a, _ in got] == [0, 0, 2 * 5000]
    used = server.leases.allocator.used_bytes
    half = server.leases.allocator.size // 2 + 4096
    with pytest.raises(sidecar.ResourceExhaustedError, match="arena is full"):
      w.empty_like([np.empty(half, np.uint8), np.empty(half, np.uint8)])
    assert server.leases.allocator.used_bytes == used  # the first went back
    del got, a
    gc.collect()
  assert eventually(lambda: server.leases.allocator.used_bytes == 0)


def test_close_waits_for_live_views(make_server):
  server = make_server()
  w = sidecar.jax.Worker(server.options.socket_path)
  a, _ = w.put(np.full(10_000, 3, np.uint8))
  w.close()
  assert w.state is worker_lib.State.CLOSING and server.leases.allocator.used_bytes > 0
  assert (a == 3).all()  # still mapped and still held
  del a
  gc.collect()
  assert eventually(lambda: w.state is worker_lib.State.CLOSED
                    and server.leases.allocator.used_bytes == 0)


def test_socket_stream_finalizer_needs_no_module_globals(monkeypatch):
  """At interpreter exit a module's globals may already be None when __del__ runs."""
  stream = consumer.Stream.__new__(consumer.Stream)
  stream.closed = False  # close() then fails: the stream has no socket
  monkeypatch.setattr(socket_transport, "contextlib", None)
  monkeypatch.setattr(socket_transport, "pb", None)
  stream.__del__()  # raises nothing
  stream.closed = True  # so that the collector's own __del__ has nothing to do


def test_a_slow_stream_is_waited_on_past_the_peer_timeout(make_server):
  """Items slower than the peer timeout still arrive: the sidecar answers the pings."""
  server = make_server()
  # Pings every 0.5 s, each answered within 0.5 s: a margin at a load of 4 on 2 cores.
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], silence_timeout=1.0) as ctl:
    with ctl.stream("slow_count", args=(2, 1.5)) as s:
      assert list(s) == [0, 1]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_peer_timeout_is_refused_naming_the_variable(make_server, monkeypatch, value):
  monkeypatch.setenv("SIDECAR_PEER_TIMEOUT", value)
  with pytest.raises(sidecar.InvalidArgumentError, match="SIDECAR_PEER_TIMEOUT must be a number"):
    sidecar.jax.Worker(make_server().options.socket_path)
