"""Tier 2: one in-process sidecar server, a real controller and worker over loopback."""

import gc
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import sidecar
from sidecar._src.ckptfmt.save_values import Begin, Prepared, Stage
from sidecar._src.wire import ipc, protocol
from sidecar._src.wire.protocol import pb
from tests.conftest import eventually
from tests.support.staged import staged

pytestmark = pytest.mark.server


def controller(server, **kw):
  return sidecar.jax.Controller([f"127.0.0.1:{server.port}"], **kw)


def assert_still_serving(ctl):
  assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


def test_handshake_reports_identity_and_registry(make_server):
  server = make_server(host_id=3, slice_id=1, device_ids=(6, 7))
  with controller(server) as ctl:
    (host,) = ctl.hosts
    assert (host.host_id, host.slice_id, host.device_ids) == (3, 1, (6, 7))
    assert "echo" in host.functions and "add" in host.functions
    assert host.versions["protocol"] == str(protocol.PROTOCOL_VERSION)
    assert ctl.worker(3) is not None  # same kernel: attached to the arena


def test_unknown_function_is_not_found_listing_registered(make_server):
  with controller(make_server()) as ctl:
    with pytest.raises(sidecar.NotRegisteredError, match=r"'nope'.*registered functions:.*echo"):
      ctl.call("nope")
    assert_still_serving(ctl)


@pytest.mark.parametrize("args,kwargs,match", [
    ((), {}, "missing a required argument: 'a'"),
    ((1,), {"c": 2}, "unexpected keyword argument 'c'"),
    ((1, 2, 3), {}, "too many positional arguments"),
], ids=["missing", "unexpected", "too-many"])
def test_wrong_arguments_are_invalid_argument_naming_the_parameter(make_server, args, kwargs,
                                                                   match):
  with controller(make_server()) as ctl:
    with pytest.raises(sidecar.InvalidArgumentError, match=match):
      ctl.call("add", args=args, kwargs=kwargs)
    assert_still_serving(ctl)


def test_remote_exception_carries_type_message_and_traceback(make_server):
  with controller(make_server(host_id=2)) as ctl:
    with pytest.raises(sidecar.RemoteError) as info:
      ctl.call("fail", args=("boom",))
    e = info.value
    assert e.remote_type == "builtins.ValueError" and e.remote_message == "boom"
    assert "raise ValueError(message)" in e.remote_traceback and e.host_id == 2
    assert_still_serving(ctl)


def test_malformed_request_bytes_are_invalid_argument(make_server):
  server = make_server()
  with controller(server) as ctl, grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    raw = ch.unary_unary(f"/{protocol.SERVICE}/Call")
    meta = ctl._sidecars.conns[0].metadata
    for garbage in (b"\xff\xff\xff",
                    pb.CallRequest(name="echo").SerializeToString()[:-1] + b"\x80"):
      with pytest.raises(grpc.RpcError) as info:
        raw(garbage, metadata=meta, timeout=5)
      assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_still_serving(ctl)


def test_calls_need_a_handshake_first(make_server):
  server = make_server()
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    call = ch.unary_unary(f"/{protocol.SERVICE}/Call",
                          request_serializer=pb.CallRequest.SerializeToString)
    with pytest.raises(grpc.RpcError) as info:
      call(pb.CallRequest(name="echo"), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "call Handshake first" in info.value.details()


def test_version_skew_fails_fast_listing_each_difference(make_server):
  server = make_server()
  theirs = protocol.local_versions()
  theirs.protocol, theirs.package, theirs.numpy = 99, "0.0.0-other", "1.0.0"
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    hs = ch.unary_unary(f"/{protocol.SERVICE}/Handshake",
                        request_serializer=pb.HandshakeRequest.SerializeToString)
    with pytest.raises(grpc.RpcError) as info:
      hs(pb.HandshakeRequest(versions=theirs, client="old"), timeout=5)
  assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  e = protocol.error_from_rpc(info.value, host="x")
  assert isinstance(e, sidecar.VersionMismatchError)
  for field in ("protocol: 99 here", "package: 0.0.0-other here", "numpy: 1.0.0 here"):
    assert field in str(e)
  with controller(server) as ctl:
    assert_still_serving(ctl)


def test_worker_with_skewed_versions_is_refused(make_server):
  import socket
  server = make_server()
  s = socket.socket(socket.AF_UNIX)
  s.connect(server.options.socket_path)
  ipc.send(s, {"op": "attach", "pid": 1, "versions": {"protocol": 42, "package": "x",
                                                       "python": "2.7", "numpy": "1", "jax": "0"}})
  reply, fds = ipc.recv(s, max_fds=1)
  s.close()
  assert fds == [] and reply["error"]["type"] == "VersionMismatchError"
  assert "protocol: 42 here" in reply["error"]["message"]


def test_payload_over_the_message_limit_is_resource_exhausted(make_server):
  server = make_server(max_message_size=1 << 20)
  with controller(server, attach=False) as ctl:
    with pytest.raises(sidecar.ResourceExhaustedError, match=r"larger than max \(\d+ vs\. \d+\)"):
      ctl.call("echo", args=(np.zeros(2 << 20, np.uint8),))
    assert_still_serving(ctl)


def test_result_larger_than_the_arena_is_resource_exhausted_with_sizes(make_server):
  with controller(make_server(shm_size=4 << 20)) as ctl:
    with pytest.raises(sidecar.ResourceExhaustedError,
                       match=r"8.0 MiB .* cannot fit an arena of 4.0 MiB"):
      ctl.call("full", args=(8 << 20, 1))
    assert_still_serving(ctl)


def test_full_arena_waits_for_the_deadline_then_fails_and_recovers(make_server):
  with controller(make_server(shm_size=4 << 20)) as ctl:
    held = ctl.call("full", args=(3 << 20, 1))  # 3 of 4 MiB held by this live array
    t0 = time.monotonic()
    with pytest.raises(sidecar.ResourceExhaustedError, match="arena is full"):
      ctl.call("full", args=(2 << 20, 2), timeout=0.5)
    assert 0.3 < time.monotonic() - t0 < 5
    # Releasing the array while a call waits lets the call through.
    f = ctl.call_async("full", args=(2 << 20, 3), timeout=10)[0]
    time.sleep(0.2)
    del held
    gc.collect()
    assert f.result()[0] == 3


def test_a_result_whose_caller_left_gives_its_blocks_back(make_server):
  # A gRPC call naming a worker session, past its deadline before the result was made:
  # nobody reads the answer, so its arena blocks must not stay leased to the session.
  from sidecar._src.wire import codec
  server = make_server(shm_size=8 << 20)
  with controller(server) as ctl:
    conn, w = ctl._sidecars.conns[0], ctl.worker(0)
    request = pb.CallRequest(name="full", args=codec.encode((1 << 20, 5, 0.5)),
                             kwargs=codec.encode({}), worker_session=w.session)
    with pytest.raises(grpc.RpcError) as caught:
      conn.call_rpc(request, timeout=0.1, metadata=conn.metadata)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.8)  # the call made its result meanwhile
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)
    assert_still_serving(ctl)


def test_large_results_arrive_as_views_of_the_arena_small_ones_inline(make_server):
  with controller(make_server()) as ctl:
    big, small = ctl.call("echo",
                          args=({"big": np.arange(1 << 18, dtype=np.int32),
                                   "small": np.arange(4)},))[0].values()
    arena = ctl.worker(0).arena.buffer
    assert np.shares_memory(big, arena) and not np.shares_memory(small, arena)
    np.testing.assert_array_equal(big, np.arange(1 << 18, dtype=np.int32))
    # Arguments went through the arena too: the sidecar saw the whole array.
    s = ctl.call("stats", args=(np.ones((512, 512), np.float32),))[0]
    assert s == {"sum": 512 * 512.0, "shape": [512, 512], "dtype": "float32", "writeable": True}


def test_without_a_worker_everything_is_inline(make_server):
  with controller(make_server(), attach=False) as ctl:
    (big,) = ctl.call("full", args=(1 << 20, 9))
    assert big.shape == (1 << 20,) and big.flags.writeable and (big == 9).all()


def test_arena_blocks_are_freed_when_arrays_die(make_server):
  server = make_server()
  with controller(server) as ctl:
    arrays = [ctl.call("full", args=(1 << 20, i))[0] for i in range(4)]
    assert server.leases.allocator.used_bytes >= 4 << 20
    del arrays
    gc.collect()
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)


def test_recycled_blocks_never_change_a_live_jax_array(make_server):
  import jax
  with controller(make_server(shm_size=4 << 20)) as ctl:
    (first,) = ctl.call("full", args=(1 << 20, 1))
    x = jax.device_put(first, jax.devices()[0])  # aliases the arena on the CPU backend
    del first
    gc.collect()
    gc.disable()  # each result's block goes back at its last reference, not at a collection
    try:
      for value in range(2, 30):  # far more than the arena holds: blocks are recycled
        (a,) = ctl.call("full", args=(1 << 20, value), timeout=10)
        assert int(a[0]) == value
        del a
    finally:
      gc.enable()
    assert int(np.asarray(x).min()) == 1 and int(np.asarray(x).max()) == 1
    live = ctl.worker(0).live_blocks
    del x
    gc.collect()
    assert eventually(lambda: ctl.worker(0).live_blocks < live)


def test_calls_from_one_thread_run_in_order(make_server):
  with controller(make_server()) as ctl:
    ctl.call("take_log")  # the log is the module's: empty it of earlier tests' entries
    for i in range(5):
      ctl.call("record", args=(i,), kwargs={"delay": 0.02 * (5 - i)})
    assert ctl.call("take_log")[0] == [0, 1, 2, 3, 4]


def test_calls_from_several_threads_run_concurrently(make_server):
  with controller(make_server()) as ctl:
    results = []
    threads = [threading.Thread(target=lambda: results.append(ctl.call("rendezvous", args=(4,))[0]))
               for _ in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(15)
    assert results == [True] * 4  # a serial server would break the barrier


@pytest.mark.parametrize("payload", ["", "text ünïcödé " * 1000, b"", b"\x00\x01\xff" * 50_000],
                         ids=["empty-str", "str", "empty-bytes", "bytes"])
def test_str_and_bytes_payloads(make_server, payload):
  with controller(make_server()) as ctl:
    assert ctl.call("echo", args=(payload,)) == [payload]


@pytest.mark.parametrize("hosts", [[5], [], [0, 0], 7],
                         ids=["unknown", "empty", "duplicate", "int"])
def test_invalid_placement_is_rejected(make_server, hosts):
  with controller(make_server()) as ctl:
    with pytest.raises(sidecar.InvalidArgumentError, match="not a valid placement"):
      ctl.call("echo", args=(1,), hosts=hosts)


def test_token_is_required_when_configured(make_server):
  server = make_server(token="s3cret")
  with pytest.raises(sidecar.AuthenticationError, match="missing or wrong token"):
    controller(server, token="wrong")
  with controller(server, token="s3cret") as ctl:
    assert_still_serving(ctl)


def test_health_and_reflection(make_server):
  server = make_server()
  with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
    stub = health_pb2_grpc.HealthStub(ch)
    for service in ("", protocol.SERVICE):
      reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
      assert reply.status == health_pb2.HealthCheckResponse.SERVING
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5)
    names = {s.name for r in replies for s in r.list_services_response.service}
  assert protocol.SERVICE in names


def test_closed_controller_raises(make_server):
  ctl = controller(make_server())
  ctl.close()
  ctl.close()
  with pytest.raises(sidecar.ClosedError, match="closed"):
    ctl.call("echo", args=(1,))


def test_status_counts(make_server):
  with controller(make_server(host_id=1)) as ctl:
    ctl.call("echo", args=(1,))
    (s,) = ctl.status()
    assert s.identity.host_id == 1 and s.calls >= 1 and s.workers == 1
    assert s.arena_size == 8 << 20


def test_stream_delivers_every_item_in_order(make_server):
  with controller(make_server()) as ctl:
    with ctl.stream("count", args=(50,), kwargs={"nbytes": 100_000}, prefetch=4) as s:
      items = list(s)
    assert [x["i"] for x in items] == list(range(50))
    assert all(np.shares_memory(x["data"], ctl.worker(0).arena.buffer) for x in items)
    assert all((x["data"] == x["i"] % 251).all() for x in items)


def test_stream_to_a_device_aliases_the_arena_and_holds_the_block(make_server):
  server = make_server()
  device = jax.devices()[1]
  with controller(server) as ctl:
    with ctl.stream("count", args=(5,), kwargs={"nbytes": 100_000}, prefetch=2, device=device) as s:
      items = list(s)
    buf = ctl.worker(0).arena.buffer
    for i, x in enumerate(items):
      assert isinstance(x["data"], jax.Array) and x["data"].devices() == {device}
      assert buf.ctypes.data <= x["data"].unsafe_buffer_pointer() < buf.ctypes.data + buf.nbytes
      assert x["i"] == i and (np.asarray(x["data"]) == i % 251).all()
    gc.collect()
    assert server.leases.allocator.used_bytes >= 5 * 100_000  # the jax.Arrays hold them
    del items, x
    gc.collect()
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)
  with controller(server, attach=False) as ctl:  # over gRPC: the same values, on the device
    with ctl.stream("count", args=(3,), kwargs={"nbytes": 1000}, prefetch=2, device=device) as s:
      items = list(s)
    assert [x["data"].devices() for x in items] == [{device}] * 3
    assert [int(x["data"][0]) for x in items] == [0, 1, 2]


def test_closing_a_stream_gives_back_what_was_sent_ahead_and_never_read(make_server):
  server = make_server()
  used = lambda: server.leases.allocator.used_bytes
  with controller(server) as ctl:
    s = ctl.stream("count", args=(100,), kwargs={"nbytes": 1 << 20}, prefetch=8)
    first, second = next(s), next(s)  # taken, not yet credited (credits go 4 at a time)
    # the sidecar ran ahead, as far as the session's quota (0.9 of 8 MiB) lets it
    assert eventually(lambda: used() >= 7 << 20)
    s.close()
    assert eventually(lambda: used() == 2 << 20)  # the two taken stay held
    assert (first["data"] == 0).all() and (second["data"] == 1).all()
    del first, second
    gc.collect()
    assert eventually(lambda: used() == 0)
    for _ in range(3):  # dropped without close(), or read to its end
      s = ctl.stream("count", args=(100,), kwargs={"nbytes": 1 << 20}, prefetch=8)
      next(s)
      del s
      gc.collect()
      assert eventually(lambda: used() == 0)
    assert len(list(ctl.stream("count", args=(5,), kwargs={"nbytes": 1 << 20}, prefetch=8))) == 5
    gc.collect()
    assert eventually(lambda: used() == 0)
    assert_still_serving(ctl)


def test_a_save_abandoned_mid_stage_gives_its_blocks_back(make_server, tmp_path, monkeypatch,
                                                         caplog):
  from sidecar._src.ckptfmt import spec as spec_lib
  from sidecar._src.server.checkpoint import write as write_lib
  # 3 s: at a load of 8 the 0.5 s it was ran out before the first check below.
  monkeypatch.setattr(write_lib, "STAGE_TIMEOUT_S", 3.0)
  server = make_server()
  used = lambda: server.leases.allocator.used_bytes
  with controller(server) as ctl:
    directory = str(tmp_path / "ck")
    client = ctl.checkpoint_client()
    client.open(0, directory, ram_steps=1, ram_budget=None, sweep=True).result()
    tmp = client.send(0, Begin(directory, 3, "orbax")).result()
    n = 1 << 18  # large enough to go through the arena
    spec = spec_lib.LeafSpec(key_path=("w",), shape=(2, n), dtype=np.float32, kind="np.ndarray",
                           write_shape=(1, n))
    part, _ = ctl.worker(0).put(np.ones((1, n), np.float32))
    client.send(0, Stage(directory=directory, step=3, tmp_dir=tmp + "/default",
                          final_dir=directory + "/3/default", leaves=[spec],
                          shards=[staged(("w",), 0, ((0, 1), (0, n)), part)], last=False)).result()
    del part  # the trainer dies before its last part
    gc.collect()
    time.sleep(0.2)
    assert used() == 4 * n  # the sidecar holds the part it got, waiting for the next
    assert eventually(lambda: used() == 0, timeout=30)
    assert "step 3: no part staged for 3 s; the trainer stopped mid-save" in caplog.text
    assert_still_serving(ctl)


def test_two_sessions_stage_one_step_into_one_host(make_server, tmp_path):
  """Trainer processes sharing a sidecar: each stages its shards from its own session;
  the step is whole (written, prepared) only once both sent their last part."""
  from sidecar._src.ckptfmt import spec as spec_lib
  server = make_server()
  with controller(server) as a, controller(server) as b:
    assert a.worker(0).session != b.worker(0).session
    directory = str(tmp_path / "ck")
    clients = [a.checkpoint_client(), b.checkpoint_client()]
    clients[0].open(0, directory, ram_steps=1, ram_budget=None, sweep=True).result()
    tmp = clients[0].send(0, Begin(directory, 3, "orbax")).result()
    n = 1 << 16
    spec = spec_lib.LeafSpec(key_path=("w",), shape=(2, n), dtype=np.float32,
                           kind="np.ndarray", write_shape=(1, n))
    rows = []
    for i, (ctl, client) in enumerate(zip((a, b), clients)):
      part, _ = ctl.worker(0).put(np.full((1, n), i, np.float32))
      client.send(0, Stage(directory=directory, step=3, tmp_dir=tmp + "/default",
                            final_dir=directory + "/3/default", leaves=[spec],
                            shards=[staged(("w",), 0, ((i, i + 1), (0, n)), part)], last=True,
                            writers=2)).result()
      del part
      rows.append(i)
      wait_s = 0.3 if i == 0 else 30
      prepared = clients[0].send(0, Prepared(directory + "/3/default", wait_s), timeout=wait_s)
      if i == 0:  # one writer of two is not the whole step
        with pytest.raises(sidecar.SidecarError, match="still being written|Deadline Exceeded"):
          prepared.result()
    sums = prepared.result()
    assert sorted(c.index for c in sums) == [((0, 1), (0, n)), ((1, 2), (0, n))]
    assert_still_serving(a)


def test_stopping_mid_save_aborts_the_staging_and_joins_the_threads(make_server, tmp_path,
                                                                   caplog):
  from sidecar._src.ckptfmt import spec as spec_lib
  releasers = lambda: sum(t.name == "sidecar-release" for t in threading.enumerate())
  before = releasers()
  server = make_server()
  assert releasers() == before + 1
  with controller(server) as ctl:
    directory = str(tmp_path / "ck")
    client = ctl.checkpoint_client()
    client.open(0, directory, ram_steps=1, ram_budget=None, sweep=True).result()
    tmp = client.send(0, Begin(directory, 3, "orbax")).result()
    n = 1 << 18
    spec = spec_lib.LeafSpec(key_path=("w",), shape=(2, n), dtype=np.float32,
                           kind="np.ndarray", write_shape=(1, n))
    part, _ = ctl.worker(0).put(np.ones((1, n), np.float32))
    client.send(0, Stage(directory=directory, step=3, tmp_dir=tmp + "/default",
                          final_dir=directory + "/3/default", leaves=[spec],
                          shards=[staged(("w",), 0, ((0, 1), (0, n)), part)], last=False)).result()
    del part
    writers = lambda: [t for t in threading.enumerate() if t.name == "sidecar-ckpt-3"]
    # Waiting for the second part; a starter thread starts it, so it may not exist yet.
    assert eventually(lambda: len(writers()) == 1)
    writer, = writers()
  server.stop()
  assert not writer.is_alive()  # joined by stop(), not left to its 60 s stage timeout
  assert releasers() == before  # and the thread that hands blocks back
  assert "is stopping mid-save of step 3" in caplog.text


def test_stream_runs_at_most_prefetch_ahead(make_server):
  with controller(make_server()) as ctl:
    ctl.call("take_log")
    s = ctl.stream("count", args=(100,), prefetch=3)
    assert next(s) == 0
    time.sleep(0.3)  # give the sidecar every chance to run ahead
    produced = [x for x in ctl.call("take_log")[0] if x[0] == "produced"]
    assert 1 <= len(produced) <= 4  # one taken + prefetch credits at most
    s.close()
    s.close()
    assert list(s) == []


def test_stream_errors(make_server):
  with controller(make_server()) as ctl:
    s = ctl.stream("count_then_fail", args=(3,))
    assert [next(s) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(sidecar.RemoteError, match="RuntimeError: failed after 3"):
      next(s)
    with pytest.raises(sidecar.InvalidArgumentError, match="returned int, not an iterable"):
      next(ctl.stream("add", args=(1,)))
    with pytest.raises(sidecar.NotRegisteredError, match="'nope'"):
      next(ctl.stream("nope"))
    with pytest.raises(sidecar.InvalidArgumentError, match="prefetch must be a positive int"):
      ctl.stream("count", args=(3,), prefetch=0)
    assert_still_serving(ctl)


def test_stream_over_grpc_without_a_worker(make_server):
  with controller(make_server(), attach=False) as ctl:
    with ctl.stream("count", args=(5,), kwargs={"nbytes": 100_000}, prefetch=2) as s:
      items = list(s)
    assert [x["i"] for x in items] == list(range(5)) and items[4]["data"].shape == (100_000,)
    with pytest.raises(sidecar.RemoteError, match="failed after 2"):
      list(ctl.stream("count_then_fail", args=(2,)))


@pytest.mark.parametrize("attach", [True, False], ids=["unix-socket", "grpc"])
def test_a_stream_timeout_bounds_each_wait_and_keeps_the_stream_open(make_server, attach):
  with controller(make_server(), attach=attach) as ctl:
    # An item every 0.5 s, 10 timeouts: the first wait times out however late it wakes.
    with ctl.stream("slow_count", args=(2, 0.5), timeout=0.05) as s:
      got, timeouts = [], 0
      while len(got) < 2 and timeouts < 100:
        try:
          got.append(next(s))
        except sidecar.DeadlineExceededError as e:
          assert "no item of 'slow_count' from host 0 within the timeout of 0.05 s" in str(e)
          timeouts += 1
      assert got == [0, 1] and timeouts >= 1 and list(s) == []


def test_a_grpc_streams_credit_reader_is_joined_when_its_rpc_ends(make_server, monkeypatch):
  """The Stream handler's credit reader is joined once its RPC is over: read to the end,
  closed early, or failed."""
  from sidecar._src.server import service
  joined = []
  join = service._join_credits
  monkeypatch.setattr(service, "_join_credits", lambda t: (join(t), joined.append(t)))
  readers = lambda: sum(t.name == "sidecar-credits" for t in threading.enumerate())
  with controller(make_server(), attach=False) as ctl:
    assert list(ctl.stream("count", args=(3,))) == [0, 1, 2]
    s = ctl.stream("count", args=(100,))
    assert next(s) == 0 and readers() == 1
    s.close()
    with pytest.raises(sidecar.RemoteError, match="failed after 1"):
      list(ctl.stream("count_then_fail", args=(1,)))
    assert eventually(lambda: len(joined) == 3)
  assert [t.is_alive() for t in joined] == [False] * 3 and readers() == 0


def test_stream_arguments_through_the_arena_stay_valid(make_server):
  with controller(make_server()) as ctl:
    big = np.arange(100_000, dtype=np.int32)
    s = ctl.stream("echo_items", args=(big, 3))
    gc.collect()
    for got in s:
      np.testing.assert_array_equal(got, big)


def test_results_made_with_sidecar_empty_cross_without_a_copy(make_server):
  server = make_server()
  with controller(server) as ctl:
    (a,) = ctl.call("made_in_place", args=(1 << 20, 7))
    assert np.shares_memory(a, ctl.worker(0).arena.buffer) and (a == 7).all()
    assert server.leases.allocator.num_blocks == 1  # the block made in place, nothing more
    del a
    gc.collect()
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)


def test_sidecar_empty_in_a_full_arena_waits_for_the_deadline_then_fails(make_server):
  server = make_server(shm_size=4 << 20)
  with controller(server) as ctl:
    held = ctl.call("full", args=(3 << 20, 1))
    t0 = time.monotonic()
    with pytest.raises(sidecar.ResourceExhaustedError, match="arena is full"):
      ctl.call("made_in_place", args=(2 << 20, 7), timeout=0.5)
    assert 0.3 < time.monotonic() - t0 < 5
    del held
    gc.collect()
    # The sidecar's thread gave up too: its space is free, it keeps serving.
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)
    (a,) = ctl.call("made_in_place", args=(2 << 20, 7), timeout=10)
    assert (a == 7).all()


def test_sidecar_empty_outside_a_sidecar_is_numpy():
  a = sidecar.empty((3, 2), np.int16)
  assert a.shape == (3, 2) and a.dtype == np.int16 and a.flags.owndata


def test_a_replica_stream_cut_short_leaves_nothing_and_a_resent_one_is_whole(make_server,
                                                                              tmp_path):
  from sidecar._src.ckptfmt.records import ShardId, ShardRecord, shard_crc32c
  from sidecar._src.wire.checkpoint_wire import record_to_pb
  from sidecar._src.wire.protocol import ckpt_pb
  from tests.conftest import PEER_TOKEN
  from tests.support.raw_client import Raw
  server = make_server()
  raw = Raw(server.port, replica_token=PEER_TOKEN)  # another sidecar's session
  receive = raw.channel.stream_unary(f"/{protocol.CHECKPOINT_SERVICE}/Receive")
  item = str(tmp_path / "ck" / "3" / "state")
  header = ckpt_pb.ReceiveRequest(header=ckpt_pb.ReplicaHeader(
      directory=str(tmp_path / "ck"), step=3, final_dir=item, source=1))
  data = np.arange(16, dtype=np.uint8)

  def part(offset):
    record = ShardRecord(ShardId(("w",), ((0, 16),)), 0, 1, "uint8", (16,), 16,
                         crc32c=shard_crc32c(data))
    return ckpt_pb.ReceiveRequest(part=ckpt_pb.ReplicaPart(
        record=record_to_pb(record), offset=offset, data=data[offset:offset + 4].tobytes()))

  def replicas():
    return {(r.final_dir, r.source): r for r in server.checkpoints.tier.replicas()}

  cut = [header, part(0), header]  # a second header: the stream fails there
  with pytest.raises(grpc.RpcError) as e:
    receive(iter(m.SerializeToString() for m in cut), metadata=raw.metadata, timeout=10)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert (item, 1) not in replicas()  # not half a replica, counted as a start
  whole = [header, *(part(o) for o in (0, 4, 8, 12)), ckpt_pb.ReceiveRequest(done=True)]
  reply = receive(iter(m.SerializeToString() for m in whole), metadata=raw.metadata,
                  timeout=10)
  assert ckpt_pb.ReceiveResponse.FromString(reply).nbytes == 16
  (got,) = replicas()[(item, 1)].shards.values()
  np.testing.assert_array_equal(got, data)
  raw.close()


def test_a_broken_replica_stream_leaves_the_resent_one_alone(make_server, tmp_path):
  """Stream A breaks after stream B resent the replica: A's cleanup drops only its own."""
  import queue

  from sidecar._src.ckptfmt.records import ShardId, ShardRecord, shard_crc32c
  from sidecar._src.wire.checkpoint_wire import record_to_pb
  from sidecar._src.wire.protocol import ckpt_pb
  from tests.conftest import PEER_TOKEN
  from tests.support.raw_client import Raw
  server = make_server()
  raw = Raw(server.port, replica_token=PEER_TOKEN)  # another sidecar's session
  receive = raw.channel.stream_unary(f"/{protocol.CHECKPOINT_SERVICE}/Receive")
  item = str(tmp_path / "ck" / "3" / "state")
  header = ckpt_pb.ReceiveRequest(header=ckpt_pb.ReplicaHeader(
      directory=str(tmp_path / "ck"), step=3, final_dir=item, source=1))
  data = np.arange(16, dtype=np.uint8)

  def part(offset):
    record = ShardRecord(ShardId(("w",), ((0, 16),)), 0, 1, "uint8", (16,), 16,
                         crc32c=shard_crc32c(data))
    return ckpt_pb.ReceiveRequest(part=ckpt_pb.ReplicaPart(
        record=record_to_pb(record), offset=offset, data=data[offset:offset + 4].tobytes()))

  def stream():
    q: queue.SimpleQueue = queue.SimpleQueue()
    future = receive.future(iter(lambda: q.get().SerializeToString(), b"end"),
                            metadata=raw.metadata, timeout=10)
    return q, future

  def replicas():
    return {(r.final_dir, r.source): r for r in server.checkpoints.tier.replicas()}

  qa, a = stream()
  qa.put(header)
  qa.put(part(0))
  assert eventually(lambda: (r := replicas().get((item, 1))) is not None and r.partial)
  first = replicas()[(item, 1)]
  qb, b = stream()  # the sender's retry, on a new link
  qb.put(header)
  qb.put(part(0))
  assert eventually(lambda: (r := replicas().get((item, 1))) is not None and r is not first)
  qa.put(header)  # A breaks (a second header) after B started
  assert a.exception(10).code() == grpc.StatusCode.INVALID_ARGUMENT
  for m in (part(4), part(8), part(12), ckpt_pb.ReceiveRequest(done=True)):
    qb.put(m)
  assert ckpt_pb.ReceiveResponse.FromString(b.result(10)).nbytes == 16
  (got,) = replicas()[(item, 1)].shards.values()
  np.testing.assert_array_equal(got, data)
  raw.close()
