"""Tier 2: the attacks of issue 16, as an attacker on loopback makes them (raw gRPC, the socket).

Each test is one attack that used to work; it now fails, and the sidecar keeps serving.
"""

import gc
import re

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import sidecar
from sidecar._src.ckptfmt.records import ShardId, ShardRecord
from sidecar._src.server.feeds import producer
from sidecar._src.streams import socket_transport
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import checkpoint_wire as wire, codec, protocol
from sidecar._src.wire.protocol import ckpt_pb, pb
from tests.conftest import eventually
from tests.support.raw_client import Raw, arena_ref, rejected

pytestmark = pytest.mark.server


@pytest.fixture
def victim(make_server):
  """A sidecar whose worker holds a secret block, and a raw client to attack it."""
  server = make_server()
  ctl = sidecar.jax.Controller([f"127.0.0.1:{server.port}"])
  secret = np.full(1 << 16, 0x5A, np.uint8)
  array, ref = ctl.worker(0).put(secret)
  raw = Raw(server.port)
  held = [server, ctl, array, ref, raw]
  del array
  yield held
  held.clear()  # pytest keeps what a fixture gave until its teardown ends: the block's too
  raw.close()
  ctl.close()


# ---- memory isolation -------------------------------------------------------------------------


def test_a_client_without_a_worker_cannot_read_the_arena(victim):
  server, ctl, array, ref, raw = victim
  whole = arena_ref(0, ref.generation, server.arena.size)  # the generation as if guessed
  for value in (whole, arena_ref(ref.offset, ref.generation, ref.nbytes)):
    e = rejected(lambda value=value: raw.call("echo", value))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "args[0]: an arena reference needs the request's worker_session" in e.details()
  assert (array == 0x5A).all() and ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


def test_a_worker_can_neither_read_nor_write_another_workers_block(victim):
  server, ctl, array, ref, raw = victim
  with sidecar.jax.Worker(server.options.socket_path) as thief:
    mine = lambda v: raw.call("echo", v, worker_session=thief.session)
    errors = []
    for value in (arena_ref(ref.offset, ref.generation, ref.nbytes),     # the right guess
                  arena_ref(ref.offset, ref.generation + 1, ref.nbytes),  # a wrong one
                  arena_ref(ref.offset + (1 << 20), 12345, ref.nbytes)):   # no block there
      e = rejected(lambda value=value: mine(value))
      assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
      errors.append(re.sub(r"\d+", "N", e.details()))
    # One answer for all three: no oracle that tells a right guess from a wrong one.
    assert errors[0] == errors[1] == errors[2]
    assert "args[N]: no arena block at offset N generation N is held by this worker" in errors[0]
    e = rejected(lambda: raw.call("overwrite", arena_ref(ref.offset, ref.generation, ref.nbytes),
                                  pb.Value(int_value=0), worker_session=thief.session))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Over the thief's own socket too: a stream's arguments are checked the same way.
    request = pb.CallRequest(
        name="echo_items", kwargs=codec.encode({}), args=pb.Value(tuple=pb.ListValue(items=[
            arena_ref(ref.offset, ref.generation, ref.nbytes), pb.Value(int_value=1)])))
    with pytest.raises(sidecar.StaleDescriptorError, match="is held by this worker session"):
      next(iter(socket_transport.open_stream(thief, request, prefetch=1, timeout=10)))
  assert (array == 0x5A).all()
  # The victim itself still may: its own block, through the arena, no copy.
  assert ctl.call("stats", args=(array,))[0]["sum"] == float(0x5A * array.size)


@pytest.mark.parametrize("nbytes,shape,match", [
    (0, (0,), "an arena reference needs nbytes > 0, got 0"),
    (8, (4,), r"shape \(4,\) of uint8 needs 4 bytes, got 8"),
    ((64 << 10) + 4096, None, r"nbytes \d+ does not fit the arena block at offset \d+, which has"),
    (8 << 20, None, r"nbytes \d+ does not fit the arena block"),  # past the arena's end
], ids=["zero", "shape-disagrees", "past-its-block", "past-the-arena"])
def test_a_bad_ref_to_ones_own_block_is_refused_and_holds_nothing(make_server, nbytes, shape,
                                                                  match):
  server = make_server()  # 8 MiB arena
  with sidecar.jax.Worker(server.options.socket_path) as w:
    raw = Raw(server.port)
    array, ref = w.put(np.ones(64 << 10, np.uint8))
    e = rejected(lambda: raw.call("echo", arena_ref(ref.offset, ref.generation, nbytes, shape),
                                  worker_session=w.session))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(match, e.details())
    assert e.details().startswith("InvalidArgumentError: args[0]: ")
    # The one good ref works, and once the worker lets go the block is free: no pin leaked.
    back = codec.decode(raw.call("echo", arena_ref(ref.offset, ref.generation, ref.nbytes),
                                    worker_session=w.session), from_arena=w.view)
    assert (back == 1).all()
    del array, back
    gc.collect()
    assert eventually(lambda: server.leases.allocator.used_bytes == 0)
    raw.close()


# ---- bounded requests -------------------------------------------------------------------------


@pytest.fixture
def feed_server(make_server):
  from tests.support import feed_fns  # noqa: F401  (registers into the default registry)
  reg = registry_lib.Registry()
  for entry in sidecar.default_registry():
    if entry.fn.__module__ == "tests.support.feed_fns":
      reg.add(entry.kind, entry.name, entry.fn)
  return make_server(registry=reg)


def _spec(**kw) -> pb.FeedSpec:
  kw.setdefault("shard_count", 1)
  return pb.FeedSpec(global_batch_size=2, rows=[pb.RowRange(start=0, stop=2)], **kw)


def test_feed_workers_are_capped(feed_server):
  raw = Raw(feed_server.port)
  e = rejected(lambda: raw.feed("shard_ids", _spec(workers=1000)))
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert re.search(r"feed workers must be at most \d+ \(this host's CPUs, at most 64\), got 1000",
                   e.details()), e.details()
  assert f"at most {producer.MAX_WORKERS} " in e.details()
  assert len(raw.feed("shard_ids", _spec(num_epochs=1))) > 0  # still serving
  raw.close()


def test_a_plain_pipeline_batch_too_big_for_the_arena_fails_after_one_element(feed_server):
  from tests.support import feed_fns
  raw = Raw(feed_server.port)
  feed_fns.pulled.clear()
  spec = pb.FeedSpec(global_batch_size=64, rows=[pb.RowRange(start=0, stop=64)], shard_count=1)
  e = rejected(lambda: raw.feed("huge_rows", spec))  # 64 x 1 MiB rows, an 8 MiB arena
  assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
  assert feed_fns.pulled == [1 << 20]  # the whole batch was read into memory before
  assert len(raw.feed("shard_ids", _spec(num_epochs=1))) > 0  # still serving
  assert eventually(lambda: feed_server.leases.allocator.used_bytes == 0)
  raw.close()


@pytest.mark.parametrize("spec,match", [
    (_spec(state_json="[" * 100_000), "feed state_json is not the JSON of a feed state"),
    (_spec(state_json="[1]"), "feed state_json must be a JSON object, got list"),
    (_spec(state_json='{"epoch": "x"}'), "feed state_json 'epoch' must be an int >= 0"),
    (_spec(state_json='{"position": -3}'), "feed state_json 'position' must be an int >= 0"),
    (_spec(shard_count=0), r"feed shard_index must be in \[0, shard_count=0\), got 0"),
], ids=["deep", "list", "epoch-str", "negative", "no-shards"])
def test_bad_feed_specs_are_invalid_argument_not_unknown(feed_server, spec, match):
  raw = Raw(feed_server.port)
  e = rejected(lambda: raw.feed("ids", spec))
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
  assert re.search(match, e.details()) and "Traceback" not in e.details()
  raw.close()


def test_a_long_remote_error_is_truncated_not_lost(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    for message in ("x" * 20_000, "ü€" * 10_000):
      with pytest.raises(sidecar.RemoteError) as info:
        ctl.call("fail", args=(message,))
      e = info.value
      assert e.remote_type == "builtins.ValueError"
      assert e.remote_message.startswith(message[:500]), e.remote_message[:100]
      assert "bytes cut ...]" in e.remote_message[-100:]
      assert len(e.remote_message.encode()) <= protocol.MAX_ERROR_MESSAGE
      assert 'raise ValueError(message)' in e.remote_traceback  # the frames survive the cut
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]


def test_a_request_of_many_tiny_values_is_refused_before_it_is_decoded(make_server):
  server = make_server()
  raw = Raw(server.port)
  nones = pb.Value(list=pb.ListValue(items=[pb.Value(none=True)] * (codec.MAX_ELEMENTS + 1)))
  e = rejected(lambda: raw.call("echo", nones))  # 4 MiB on the wire; 8 s to decode before
  assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
  assert re.search(rf"a CallRequest of \d+ bytes holds more than {codec.MAX_ELEMENTS} values",
                   e.details()), e.details()  # counted on the wire, before protobuf parsed it
  assert "codec.MAX_ELEMENTS" in e.details() and "Traceback" not in e.details()
  assert codec.decode(raw.call("add", pb.Value(int_value=2))) == 2
  raw.close()


@pytest.mark.parametrize("request_,code,error", [
    (pb.CallRequest(name="x" * 100_000), grpc.StatusCode.NOT_FOUND, "NotRegisteredError"),
    (pb.CallRequest(name="add", args=codec.encode((1,)), kwargs=codec.encode({"y" * 100_000: 1})),
     grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgumentError"),
], ids=["name", "kwarg"])
def test_an_error_naming_a_huge_input_arrives_cut_with_its_status(make_server, request_, code,
                                                                  error):
  server = make_server()
  raw = Raw(server.port)
  e = rejected(lambda: raw._call(request_, metadata=raw.metadata, timeout=10))
  assert e.code() == code and e.details().startswith(f"{error}: "), e.details()[:200]
  assert len(e.details()) <= 1024 and "Traceback" not in e.details()
  assert type(protocol.error_from_rpc(e, host="h")).__name__ == error
  raw.close()


def test_a_checkpoint_error_naming_a_huge_path_arrives_cut(make_server):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    with pytest.raises(sidecar.SidecarError) as info:
      ctl.checkpoint_client().open(0, "/" + "a" * 100_000, ram_steps=1, ram_budget=None,
                                    sweep=True).result()
  assert type(info.value).__name__ == "PermissionDeniedError"
  assert "is not under a checkpoint root" in str(info.value)
  assert len(str(info.value)) <= 2048 and "Traceback" not in str(info.value)


# ---- the ports --------------------------------------------------------------------------------


def test_the_health_port_answers_health_only(make_server):
  server = make_server()
  with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    handshake = ch.unary_unary(f"/{protocol.SERVICE}/Handshake",
                               request_serializer=pb.HandshakeRequest.SerializeToString)
    e = rejected(lambda: handshake(pb.HandshakeRequest(versions=protocol.local_versions()),
                                   timeout=5))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    e = rejected(lambda: list(replies))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("sent", [None, "Bearer s3cre", "Bearer s3cret2", "Bearer s3creT",
                                  "s3cret", "Bearer  s3cret"],
                         ids=["none", "prefix", "longer", "one-char-off", "no-scheme", "spaces"])
def test_every_wrong_token_is_unauthenticated(make_server, sent):
  server = make_server(token="s3cret")
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    for method in ("Sidecar/Handshake", "Sidecar/Call", "Sidecar/Status", "Checkpoint/Delete",
                   "Checkpoint/Read"):
      rpc = ch.unary_unary(f"/sidecar.v1.{method}")
      e = rejected(lambda rpc=rpc: rpc(
          b"", metadata=[] if sent is None else [(protocol.AUTH_KEY, sent)], timeout=5))
      assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "missing or wrong token" in e.details()
  raw = Raw(server.port, token="s3cret")
  assert codec.decode(raw.call("add", pb.Value(int_value=2))) == 2
  raw.close()


# ---- checkpoint roots: the Checkpoint service acts only under them ---------------------


@pytest.fixture
def ckpt_server(make_server, tmp_path):
  """A sidecar whose one checkpoint root is ``tmp_path/root``; a victim directory beside it,
  holding what looks like a committed step; a raw client."""
  root = tmp_path / "root"
  root.mkdir()
  victim = tmp_path / "victim"
  (victim / "5" / "default").mkdir(parents=True)
  (victim / "5" / "default" / "sidecar_manifest.json").write_text("{}")
  (victim / "5.orbax-checkpoint-tmp").mkdir()
  (victim / "precious.txt").write_text("keep me")
  server = make_server(checkpoint_roots=(str(root),))
  raw = Raw(server.port)
  yield root, victim, raw
  raw.close()


# The Checkpoint service's requests, with their fields in the order the tests give them.
CKPT_REQUESTS = {
    "open": (ckpt_pb.CheckpointOpenRequest, ("directory",)),
    "begin": (ckpt_pb.CheckpointBeginRequest, ("directory", "step", "format")),
    "abort": (ckpt_pb.CheckpointAbortRequest, ("tmp_dir", "final_dir")),
    "delete": (ckpt_pb.CheckpointDeleteRequest, ("directory", "step")),
    "forget": (ckpt_pb.CheckpointForgetRequest, ("directory", "step")),
    "info": (ckpt_pb.CheckpointInfoRequest, ("final_dir",)),
    "held": (ckpt_pb.CheckpointHeldRequest, ("directory",)),
    "commit": (ckpt_pb.CheckpointCommitRequest, ("tmp_dir", "step", "num_hosts", "leaves",
                                                 "records", "data_state_json", "whole_step")),
    "read": (ckpt_pb.CheckpointReadRequest, ("final_dir", "record")),
}


# A shard's record, as a Read names it (the manifest's).
RECORD = wire.record_to_pb(ShardRecord(ShardId(("w",), ((0, 1),)), 0, 0, "float32", (1,), 4))


def ckpt(raw: Raw, name: str, *args, metadata=None):
  cls, fields = CKPT_REQUESTS[name]
  return getattr(raw.ckpt, name.capitalize())(cls(**dict(zip(fields, args))), timeout=10,
                                               metadata=raw.metadata if metadata is None
                                               else metadata)


def ckpt_refused(raw: Raw, name: str, *args, metadata=None) -> grpc.RpcError:
  return rejected(lambda: ckpt(raw, name, *args, metadata=metadata))


def files(path) -> set[str]:
  return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_checkpoint_calls_outside_the_roots_are_refused_and_remove_nothing(ckpt_server):
  root, victim, raw = ckpt_server
  before = files(victim)
  v = str(victim)
  for name, args in [("abort", (v, v)), ("abort", (f"{v}/5.orbax-checkpoint-tmp", v)),
                     ("delete", (v, 5)), ("open", (f"{v}/new",)), ("begin", (v, 6, "orbax")),
                     ("info", (f"{v}/5/default",)), ("held", (v,)), ("forget", (v, 5)),
                     ("commit", (f"{v}/5.orbax-checkpoint-tmp/default", 5, 1, [], [], "", True)),
                     ("read", (f"{v}/5/default", RECORD))]:
    e = ckpt_refused(raw, name, *args)
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (name, e.details())
    assert "is not under a checkpoint root" in e.details() and str(root) in e.details()
    assert "--checkpoint-root" in e.details() and v in e.details()
  assert files(victim) == before and not (victim / "new").exists()
  assert (victim / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("record, match", [
    (None, r"^InvalidArgumentError: record.shard.key_path: the key path is empty"),
    (ckpt_pb.ShardRecord(shard=wire.shard_to_pb(["w"], [[2, 1]])),
     r"^InvalidArgumentError: record.shard.index: each interval must be \[start, stop\)"),
    (ckpt_pb.ShardRecord(shard=wire.shard_to_pb(["w"], [[0, 1]]), dtype="object"),
     r"^InvalidArgumentError: record.dtype: "),
], ids=["none", "bad-index", "bad-dtype"])
def test_a_read_without_a_valid_record_is_refused_naming_the_field(ckpt_server, record, match):
  root, _, raw = ckpt_server
  e = ckpt_refused(raw, "read", f"{root}/5/default", record)
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
  assert re.search(match, e.details()), e.details()


def test_a_symlink_or_dotdot_leaving_the_root_is_refused(ckpt_server):
  root, victim, raw = ckpt_server
  (root / "link").symlink_to(victim)
  before = files(victim)
  for directory in (str(root / "link"), f"{root}/../victim", f"{root}/sub/../../victim"):
    for name, args in [("delete", (directory, 5)), ("open", (directory,)),
                       ("abort", (f"{directory}/5.orbax-checkpoint-tmp", directory))]:
      e = ckpt_refused(raw, name, *args)
      assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (name, directory, e.details())
      assert f"resolved: '{victim}" in e.details()
  assert files(victim) == before


def test_delete_and_abort_remove_only_a_checkpoints_step_directories(ckpt_server):
  root, _, raw = ckpt_server
  (root / "7").mkdir()
  (root / "7" / "data.bin").write_bytes(b"not a checkpoint")
  (root / "data").mkdir()
  e = ckpt_refused(raw, "delete", str(root), 7)
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "is not a checkpoint step directory" in e.details()
  for item in (str(root / "data"), str(root)):
    e = ckpt_refused(raw, "abort", item, item)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "abort removes only a save's uncommitted files" in e.details()
  assert (root / "7" / "data.bin").exists() and (root / "data").is_dir()
  # What a checkpoint wrote goes: a step with its manifest, an uncommitted step.
  (root / "8" / "default").mkdir(parents=True)
  (root / "8" / "default" / "sidecar_manifest.json").write_text("{}")
  tmp = root / "9.orbax-checkpoint-tmp"
  (tmp / "default").mkdir(parents=True)
  ckpt(raw, "delete", str(root), 8)
  ckpt(raw, "abort", str(tmp / "default"), str(root / "9" / "default"))
  assert not (root / "8").exists() and not (tmp / "default").exists() and tmp.exists()
  ckpt(raw, "abort", str(tmp), str(root / "9" / "default"))
  assert not tmp.exists() and (root / "7").exists()


@pytest.mark.parametrize("step", [-1, -(1 << 63)])
def test_a_step_is_a_non_negative_int64(ckpt_server, step):
  """A step is an int64 on the wire (the proto says so); a negative one is refused."""
  root, _, raw = ckpt_server
  (root / "0" / "default").mkdir(parents=True)
  (root / "0" / "default" / "sidecar_manifest.json").write_text("{}")
  for name in ("delete", "begin", "forget"):
    e = ckpt_refused(raw, name, str(root), step)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.details())
    assert f"step must be a non-negative int, got {step}" in e.details()
  assert (root / "0" / "default").is_dir()
  for directory in ("", f"{root}/a\0b"):
    e = ckpt_refused(raw, "open", directory)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "directory must be a directory path" in e.details()


def test_checkpoint_rpcs_are_not_calls_and_are_not_listed(ckpt_server):
  root, _, raw = ckpt_server
  (root / "8" / "default").mkdir(parents=True)
  (root / "8" / "default" / "sidecar_manifest.json").write_text("{}")
  for name in ("sidecar.ckpt.delete", "sidecar.ckpt.open", "sidecar.nope"):
    e = rejected(lambda name=name: raw.call(name, codec.encode(str(root)), codec.encode(8)))
    assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
    assert "ckpt" not in e.details().replace(name, "")  # the registered names: none of ours
  assert (root / "8" / "default").is_dir()


def test_checkpoint_rpcs_need_a_session(ckpt_server):
  root, _, raw = ckpt_server
  (root / "8" / "default").mkdir(parents=True)
  (root / "8" / "default" / "sidecar_manifest.json").write_text("{}")
  for metadata in ([], [(protocol.SESSION_KEY, "s-" + "0" * 32)]):
    e = ckpt_refused(raw, "delete", str(root), 8, metadata=metadata)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
  assert (root / "8" / "default").is_dir()
  ckpt(raw, "delete", str(root), 8)  # with the handshake's session
  assert not (root / "8").exists()


def test_a_sidecar_without_roots_refuses_checkpoint_calls_naming_the_flag(make_server, tmp_path):
  server = make_server(checkpoint_roots=())
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    with pytest.raises(sidecar.SidecarError) as info:
      ctl.checkpoint_client().open(0, str(tmp_path / "ck"), ram_steps=1, ram_budget=None,
                                    sweep=True).result()
    assert isinstance(info.value, PermissionError)
    assert type(info.value).__name__ == "PermissionDeniedError"
    assert "has no checkpoint root" in str(info.value)
    assert "--checkpoint-root DIR" in str(info.value)
    assert "SIDECAR_CHECKPOINT_ROOTS" in str(info.value)
    with pytest.raises(PermissionError):
      ctl.checkpointer(tmp_path / "ck2")
  assert not (tmp_path / "ck").exists() and not (tmp_path / "ck2").exists()


# ---- bad input that got the wrong answer (issue 23, item 9) -------------------------------------


def test_a_huge_name_is_cut_in_the_log_too(make_server, caplog):
  import logging
  server = make_server()
  raw = Raw(server.port)
  with caplog.at_level(logging.INFO, logger="sidecar"):
    e = rejected(lambda: raw._call(pb.CallRequest(name="x" * (4 << 20)), metadata=raw.metadata,
                                   timeout=30))
  assert e.code() == grpc.StatusCode.NOT_FOUND
  lines = [r.getMessage() for r in caplog.records if "NotRegisteredError" in r.getMessage()]
  assert lines and max(map(len, lines)) <= protocol.MAX_LOG_MESSAGE + 200  # not 4 Mi chars
  assert "bytes cut" in lines[0]
  raw.close()


@pytest.mark.parametrize("state_json,match", [
    ('{"epoch": ' + "9" * 5000 + "}", "is not the JSON of a feed state"),
    ('{"kind": "' + "k" * (17 << 20) + '"}',
     r"more than a feed state's 16777216 \(MAX_STATE_BYTES\)"),
], ids=["epoch-5000-digits", "17-MiB"])
def test_a_feed_state_too_big_is_invalid_argument(feed_server, state_json, match):
  raw = Raw(feed_server.port)
  e = rejected(lambda: raw.feed("ids", _spec(state_json=state_json)))
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()[:200]
  assert re.search(match, e.details()), e.details()[:300]
  raw.close()


def nested(depth: int, leaf, kind: str):
  for _ in range(depth):
    leaf = [leaf] if kind == "list" else {"k": leaf}
  return leaf


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_one_nesting_limit_both_ways(make_server, kind):
  server = make_server()
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=False, timeout=10) as ctl:
    deepest = nested(codec.MAX_DEPTH - 1, 1, kind)  # in the call's args: 30 levels
    assert ctl.call("echo", args=(deepest,)) == [deepest]  # through and back
    for depth in (codec.MAX_DEPTH, 49, 63, 64, 100):  # refused before it is sent
      with pytest.raises(sidecar.InvalidArgumentError,
                         match=rf"nesting deeper than {codec.MAX_DEPTH} levels "
                               r"\(codec.MAX_DEPTH\)"):
        ctl.call("echo", args=(nested(depth, 1, kind),))
  raw = Raw(server.port)  # a client that does not check: the sidecar refuses as clearly
  for depth in (codec.MAX_DEPTH + 1, 40, 45):  # (protobuf itself builds no deeper)
    value = pb.Value(int_value=1)
    for _ in range(depth):
      value = pb.Value(list=pb.ListValue(items=[value]))
    e = rejected(lambda value=value: raw.call("echo", value))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()[:200]
    assert f"{codec.MAX_DEPTH} levels (codec.MAX_DEPTH)" in e.details(), e.details()[:300]
  raw.close()
