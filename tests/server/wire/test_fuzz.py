"""Property-based fuzzing (Hypothesis): the codec, every RPC's requests, the worker socket's frames.

Properties: the codec decodes what it encodes, and anything else fails with a SidecarError
(never another exception); a real sidecar answers every request, however malformed, with a
status that says what was wrong (never UNKNOWN or INTERNAL unless the registered function
itself raised), answers every frame on its Unix socket, and keeps serving. Examples are
bounded and derandomized: the module costs a few seconds and never flakes.
"""

import contextlib
import json
import math
import random
import re
import socket
import struct

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as pb_descriptor, message as pb_message
from hypothesis import HealthCheck, given, settings, strategies as st

import sidecar
from sidecar._src.core import dtypes as dtypes_lib, errors, options as options_lib
from sidecar._src.server.server import Server
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec, ipc, pbscan, protocol
from sidecar._src.wire.protocol import ckpt_pb, pb
from tests.support import feed_fns, sidecar_fns

pytestmark = pytest.mark.server

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
DTYPES = sorted(dtypes_lib.NAMES)
# Statuses that say what was wrong with a request. UNKNOWN is only for a registered
# function's own exception (a RemoteError from the test modules' code).
TOLD = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
USER_CODE = ("sidecar_fns.py", "feed_fns.py")
SAFE_FUNCTIONS = ("echo", "add", "fail", "stats", "echo_items", "overwrite")
PIPELINES = ("ids", "shard_ids", "fails_at", "ragged")
# Names that once were built-in calls: now the Checkpoint service's, NOT_FOUND through Call.
BUILTINS = ("sidecar.ckpt.open", "sidecar.ckpt.stage", "sidecar.ckpt.delete",
            "sidecar.ckpt.read")
# The Checkpoint service: every unary rpc and its request type (Receive is a client stream).
CKPT_RPCS = {m.name: m.input_type.name for m in
             ckpt_pb.DESCRIPTOR.services_by_name["Checkpoint"].methods}

# ---- strategies -------------------------------------------------------------------------------

int64 = st.integers(-(1 << 63), (1 << 63) - 1)
shapes = st.lists(st.integers(-2, 6) | st.sampled_from([1 << 31, 1 << 62]), max_size=4)
dtypes = st.sampled_from(DTYPES) | st.text(max_size=8)


@st.composite
def arrays(draw) -> pb.Value:
  shape = draw(shapes)
  dtype = draw(dtypes)
  if draw(st.booleans()) and dtype in dtypes_lib.NAMES and all(0 <= d < 8 for d in shape):
    size = math.prod(shape) * dtypes_lib.dtype_of(dtype).itemsize  # a consistent one
    data = draw(st.binary(min_size=size, max_size=size))
  else:
    data = draw(st.binary(max_size=64))
  return pb.Value(array=pb.Array(dtype=dtype, shape=shape, data=data, scalar=draw(st.booleans())))


arena_refs = st.builds(lambda o, n, g, d, s: pb.Value(arena=pb.ArenaRef(
    offset=o, nbytes=n, generation=g, dtype=d, shape=s)),
    st.integers(0, (1 << 64) - 1), st.integers(0, 1 << 30), st.integers(0, (1 << 64) - 1),
    dtypes, shapes)


leaf_values = st.one_of(
    st.just(pb.Value(none=True)), st.booleans().map(lambda b: pb.Value(bool_value=b)),
    int64.map(lambda i: pb.Value(int_value=i)),
    st.text(max_size=30).map(lambda t: pb.Value(big_int=t)),
    st.integers(-(1 << 200), 1 << 200).map(lambda i: pb.Value(big_int=str(i))),
    st.floats(allow_nan=True).map(lambda f: pb.Value(float_value=f)),
    st.text(max_size=30).map(lambda t: pb.Value(str_value=t)),
    st.binary(max_size=30).map(lambda b: pb.Value(bytes_value=b)),
    arrays(), arena_refs, st.just(pb.Value()))


def _containers(children):
  entries = st.lists(st.tuples(children, children), max_size=4).map(
      lambda kv: pb.Value(dict=pb.DictValue(entries=[pb.DictEntry(key=k, value=v) for k, v in kv])))
  return st.one_of(
      st.lists(children, max_size=4).map(lambda xs: pb.Value(list=pb.ListValue(items=xs))),
      st.lists(children, max_size=4).map(lambda xs: pb.Value(tuple=pb.ListValue(items=xs))),
      entries)


values = st.recursive(leaf_values, _containers, max_leaves=12)


def deep(n: int) -> pb.Value:
  v = pb.Value(none=True)
  for _ in range(n):
    v = pb.Value(list=pb.ListValue(items=[v]))
  return v


py_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 100), 1 << 100), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=20),
    st.builds(lambda d, s: (np.arange(math.prod(s)) % 3).astype(d).reshape(s),
              st.sampled_from(["int8", "int64", "float32", "float64", "bool", "uint16"]),
              st.lists(st.integers(0, 4), max_size=3).map(tuple)))
py_values = st.recursive(py_leaves, lambda c: st.one_of(
    st.lists(c, max_size=4), st.lists(c, max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=15)


def same(a, b) -> bool:
  if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
    return math.isnan(b)
  if isinstance(a, (list, tuple)):
    return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
  if isinstance(a, dict):
    return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b


# ---- the codec --------------------------------------------------------------------------------


@FUZZ
@given(py_values)
def test_the_codec_decodes_what_it_encodes(value):
  assert same(codec.decode(codec.encode(value)), value)
  assert same(codec.decode(pb.Value.FromString(codec.encode(value).SerializeToString())), value)


def refuse_refs(ref):
  raise errors.StaleDescriptorError(f"no block {ref.offset}")


@FUZZ
@given(values | st.integers(30, 45).map(deep))  # upb refuses deeper messages itself
def test_decoding_any_value_returns_or_raises_a_sidecar_error(value):
  for from_arena in (None, refuse_refs):
    try:
      codec.decode(value, from_arena=from_arena)
    except errors.SidecarError:
      pass


@FUZZ
@given(values, values)
def test_the_wire_count_of_a_request_is_what_its_decoding_spends(args, kwargs):
  budget = codec.Budget()
  try:
    codec.decode(args, budget=budget)
    codec.decode(kwargs, budget=budget)
  except errors.SidecarError:
    return
  raw = pb.CallRequest(name="f", args=args, kwargs=kwargs).SerializeToString()
  assert pbscan.count(raw, pb.CallRequest.DESCRIPTOR, 1 << 30) == (
      budget.max_elements - budget.elements)


@FUZZ
@given(st.binary(max_size=200))
def test_decoding_any_bytes_returns_or_raises_a_sidecar_error(data):
  try:
    value = pb.Value.FromString(data)
  except pb_message.DecodeError:
    return
  try:
    codec.decode(value)
  except errors.SidecarError:
    pass


# ---- every RPC against a real sidecar ---------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """A sidecar with the test functions and pipelines, a worker attached, a raw channel."""
  tmp = tmp_path_factory.mktemp("fuzz")
  reg = registry_lib.Registry()
  for module in (sidecar_fns, feed_fns):
    for entry in sidecar.default_registry():
      if entry.fn.__module__ == module.__name__:
        reg.add(entry.kind, entry.name, entry.fn)
  opts = options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0, shm_size=8 << 20,
                               socket_path=str(tmp / "fuzz.sock"),
                               checkpoint_roots=(str(tmp),), replica_token="fuzz-peer")
  server = Server(opts, registry=reg).start()
  worker = sidecar.jax.Worker(opts.socket_path, timeout=10)
  channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
  handshake = channel.unary_unary(f"/{protocol.SERVICE}/Handshake",
                                  response_deserializer=pb.HandshakeResponse.FromString)
  # Another sidecar's session: Receive gets past the peer check to the parsing it fuzzes.
  session = handshake(pb.HandshakeRequest(versions=protocol.local_versions()).SerializeToString(),
                      timeout=10, metadata=[(protocol.REPLICA_KEY, "Bearer fuzz-peer")]).session
  rpcs = {m: channel.unary_unary(f"/{protocol.SERVICE}/{m}") for m in ("Handshake", "Call",
                                                                         "Status", "Leave")}
  rpcs["Stream"] = channel.stream_stream(f"/{protocol.SERVICE}/Stream")
  for method in CKPT_RPCS:
    path = f"/{protocol.CHECKPOINT_SERVICE}/{method}"
    rpcs[method] = (channel.stream_unary(path) if method == "Receive"
                    else channel.unary_unary(path))
  yield server, worker, rpcs, [(protocol.SESSION_KEY, session)], str(tmp)
  worker.close()
  channel.close()
  server.stop(grace=0)


def answered(fn) -> None:
  """``fn()`` succeeds, or fails with a status that says what was wrong."""
  try:
    fn()
  except grpc.RpcError as e:
    if e.code() in TOLD:
      return
    assert e.code() == grpc.StatusCode.UNKNOWN, (e.code(), e.details())
    from_user_code(protocol.error_from_rpc(e, host="fuzz"))


def from_user_code(error: errors.SidecarError) -> None:
  """``error`` is a registered function's own exception (a RemoteError), raised in the
  test modules' code (or what it called), not in the sidecar's."""
  assert isinstance(error, errors.RemoteError), (type(error), str(error))
  frames = re.findall(r'File "([^"]+)"', error.remote_traceback)
  user = [i for i, f in enumerate(frames) if f.endswith(USER_CODE)]
  assert user and not [f for f in frames[user[-1] + 1:] if "/sidecar/_src/" in f], (
      str(error), error.remote_traceback[-2000:])


def stream(rpcs, metadata, first: bytes, *, items: int = 2):
  """Sends ``first``, then takes at most ``items`` items and cancels."""
  requests = [first] + [pb.StreamRequest(credit=1).SerializeToString()] * items
  call = rpcs["Stream"](iter(requests), metadata=metadata, timeout=10)
  try:
    for i, _ in enumerate(call):
      if i + 1 >= items:
        break
  finally:
    call.cancel()


def names():
  return (st.sampled_from(SAFE_FUNCTIONS + BUILTINS + ("nope", "sidecar.nope"))
          | st.text(max_size=12))


def sessions(worker):
  return st.sampled_from(["", worker.session, "w-" + "0" * 32]) | st.text(max_size=10)


@st.composite
def calls(draw, worker, root):
  name = draw(names())
  args = draw(st.lists(values, max_size=3) | st.just([]))
  if name in BUILTINS and draw(st.booleans()):  # paths under the root, and outside
    args = [pb.Value(str_value=draw(st.sampled_from([root, root + "/x", "/etc", "/tmp/../etc",
                                                     root + "/../.."])))] + args
  kwargs = draw(st.dictionaries(st.text(max_size=6), values, max_size=2))
  as_tuple = draw(st.booleans())
  return pb.CallRequest(
      name=name,
      args=pb.Value(tuple=pb.ListValue(items=args)) if as_tuple else draw(values),
      kwargs=codec.encode({}) if not kwargs else pb.Value(dict=pb.DictValue(entries=[
          pb.DictEntry(key=pb.Value(str_value=k), value=v) for k, v in kwargs.items()])),
      worker_session=draw(sessions(worker)))


feed_specs = st.builds(
    lambda g, rows, seed, epochs, si, sc, state, workers: pb.FeedSpec(
        global_batch_size=g, rows=[pb.RowRange(start=a, stop=b) for a, b in rows], seed=seed,
        num_epochs=epochs, shard_index=si, shard_count=sc, state_json=state, workers=workers),
    st.integers(0, 1 << 20) | st.just((1 << 64) - 1),
    st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64)), max_size=3),
    int64, st.integers(0, 3), st.integers(0, 4), st.integers(0, 4),
    st.sampled_from(["", "{}", '{"epoch": 1, "position": 8, "kind": "map"}', "[", "null",
                     '{"kind": 5}']) | st.text(max_size=10),
    st.sampled_from([0, 1 << 20]))  # never a real pool: processes cost seconds


@FUZZ
@given(st.sampled_from(["Handshake", "Call", "Status", "Stream"]), st.binary(max_size=300))
def test_random_bytes_to_every_rpc_are_answered(target, method, data):
  _, _, rpcs, metadata, _ = target
  if method == "Stream":
    answered(lambda: stream(rpcs, metadata, data))
  else:
    answered(lambda: rpcs[method](data, metadata=metadata, timeout=10))


def test_random_bytes_to_leave_are_answered(target):
  """Leave ends the session it names (the other properties share the target's), so its
  bytes go with a session of their own, and none: each answered, the sidecar serving."""
  _, _, rpcs, metadata, _ = target
  auth = [m for m in metadata if m[0] != protocol.SESSION_KEY]
  rng = random.Random(37)
  for data in (b"", b"\x00", b"\x08\x01", bytes(rng.randrange(256) for _ in range(300))):
    session = pb.HandshakeResponse.FromString(rpcs["Handshake"](
        pb.HandshakeRequest(versions=protocol.local_versions()).SerializeToString(),
        metadata=auth, timeout=10)).session
    for meta in (auth + [(protocol.SESSION_KEY, session)], auth):
      answered(lambda d=data, m=meta: rpcs["Leave"](d, metadata=m, timeout=10))
  answered(lambda: rpcs["Status"](b"", metadata=metadata, timeout=10))


@FUZZ
@given(st.data())
def test_random_calls_are_answered(target, data):
  _, worker, rpcs, metadata, root = target
  request = data.draw(calls(worker, root))
  answered(lambda: rpcs["Call"](request.SerializeToString(), metadata=metadata, timeout=10))


@FUZZ
@given(st.data())
def test_random_streams_and_feeds_are_answered(target, data):
  _, worker, rpcs, metadata, root = target
  request = data.draw(calls(worker, root))
  if data.draw(st.booleans()):  # a feed of a registered pipeline
    request.name = data.draw(st.sampled_from(PIPELINES) | st.text(max_size=6))
    request.args.CopyFrom(codec.encode(()))
    request.kwargs.CopyFrom(codec.encode({}))
    request.feed.CopyFrom(data.draw(feed_specs))
  else:
    request.name = data.draw(st.sampled_from(["echo_items", "echo", "count_then_fail"]))
  first = pb.StreamRequest(start=request, prefetch=data.draw(st.integers(0, 2000)))
  answered(lambda: stream(rpcs, metadata, first.SerializeToString()))


@FUZZ
@given(st.binary(max_size=80),
       st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20) | st.none())
def test_handshake_and_status_with_any_session_are_answered(target, data, session):
  _, _, rpcs, _, _ = target
  metadata = [] if session is None else [(protocol.SESSION_KEY, session)]
  answered(lambda: rpcs["Handshake"](data, metadata=metadata, timeout=10))
  answered(lambda: rpcs["Call"](pb.CallRequest(name="add").SerializeToString(),
                                metadata=metadata, timeout=10))


# ---- the Checkpoint service -------------------------------------------------------------------

_F = pb_descriptor.FieldDescriptor


def _paths(root: str):
  return st.sampled_from([root, root + "/x", root + "/1.orbax-checkpoint-tmp/default",
                          root + "/1/default", "/etc", "/tmp/../etc", root + "/../..", ""])


@st.composite
def ckpt_messages(draw, cls, root: str, depth: int = 0):
  """A message of type ``cls`` with every field drawn: paths under the root and outside,
  edge-case integers, garbage dtypes, arena references to anything."""
  message = cls()
  for field in cls.DESCRIPTOR.fields:
    if depth > 3 or draw(st.booleans()):
      continue
    if field.type == _F.TYPE_MESSAGE:
      entry = field.message_type
      if entry.GetOptions().map_entry:
        container = getattr(message, field.name)
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for _ in range(draw(st.integers(0, 2))):
          key = draw(_paths(root) if key_field.type == _F.TYPE_STRING else
                     _scalars(key_field, root).filter(lambda k: -2 <= k <= 3))
          if value_field.type == _F.TYPE_MESSAGE:  # map<K, Message>
            container[key].CopyFrom(draw(ckpt_messages(
                value_field.message_type._concrete_class, root, depth + 1)))
          else:  # map<K, scalar>: DCP's file sizes
            container[key] = draw(_scalars(value_field, root))
        continue
      sub_cls = entry._concrete_class
      if field.is_repeated:
        getattr(message, field.name).extend(
            draw(st.lists(ckpt_messages(sub_cls, root, depth + 1), max_size=3)))
      else:
        getattr(message, field.name).CopyFrom(draw(ckpt_messages(sub_cls, root, depth + 1)))
      continue
    values = _scalars(field, root)
    if field.is_repeated:
      getattr(message, field.name).extend(draw(st.lists(values, max_size=4)))
    else:
      setattr(message, field.name, draw(values))
  return message


def _scalars(field, root: str):
  t = field.type
  if t == _F.TYPE_STRING:
    if field.name in ("dtype",):
      return dtypes
    if field.name in ("kind",):
      return st.sampled_from(["jax.Array", "np.ndarray", "scalar", "?"])
    return _paths(root) | st.text(max_size=12)
  if t == _F.TYPE_BYTES:
    return st.binary(max_size=64)
  if t == _F.TYPE_BOOL:
    return st.booleans()
  if t in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
    return st.floats(-1.0, 0.05) | st.just(float("nan"))  # short waits only
  if t == _F.TYPE_ENUM:
    return st.sampled_from([v.number for v in field.enum_type.values])
  bits = 32 if t in (_F.TYPE_INT32, _F.TYPE_UINT32, _F.TYPE_SINT32) else 64
  signed = t in (_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_SINT32, _F.TYPE_SINT64)
  lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
  return st.integers(-2, 64).filter(lambda x: lo <= x <= hi) | st.sampled_from([lo, hi])


def _tame(request) -> None:
  """Keeps a fuzzed request from waiting long or dialling out: a replicate's peers are a
  closed local port, every wait at most 0.05 s."""
  if hasattr(request, "timeout_s") and not 0 < request.timeout_s <= 0.05:
    request.timeout_s = 0.01
  for peer in getattr(request, "peers", ()):
    peer.address, peer.socket = "127.0.0.1:1", ""


@FUZZ
@given(st.sampled_from(sorted(CKPT_RPCS)), st.binary(max_size=300))
def test_random_bytes_to_every_checkpoint_rpc_are_answered(target, method, data):
  _, _, rpcs, metadata, _ = target
  request = iter([data, data]) if method == "Receive" else data
  answered(lambda: rpcs[method](request, metadata=metadata, timeout=10))


@FUZZ
@given(st.data())
def test_random_checkpoint_requests_are_answered(target, data):
  _, worker, rpcs, metadata, root = target
  method = data.draw(st.sampled_from(sorted(CKPT_RPCS)))
  cls = getattr(ckpt_pb, CKPT_RPCS[method])
  messages = data.draw(st.lists(ckpt_messages(cls, root), min_size=1, max_size=3))
  for m in messages:
    _tame(m)
    if hasattr(m, "worker_session"):
      m.worker_session = data.draw(sessions(worker))
  raw = [m.SerializeToString() for m in messages]
  request = iter(raw) if method == "Receive" else raw[0]
  answered(lambda: rpcs[method](request, metadata=metadata, timeout=10))


# ---- the worker socket ------------------------------------------------------------------------


def _attach(path: str) -> socket.socket:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.settimeout(10)
  sock.connect(path)
  ipc.send(sock, {"op": "attach", "pid": 1,
                  "versions": protocol.versions_dict(protocol.local_versions())})
  reply, fds = ipc.recv(sock, max_fds=1)
  for fd in fds:
    socket.close(fd)
  assert "session" in reply
  return sock


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(0, 0.01)
    | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8)
messages = st.fixed_dictionaries(
    {"op": st.sampled_from(["free", "alloc", "ping", "attach", "stream", "calls", "steal"])},
    optional={"blocks": json_values, "nbytes": json_values | st.integers(0, 1 << 24),
              "timeout": st.floats(0, 0.01) | st.text(max_size=3), "session": json_values})


@FUZZ
@given(st.binary(max_size=100).map(lambda b: struct.pack("<I", len(b)) + b)
       | messages.map(lambda m: struct.pack("<I", len(json.dumps(m))) + json.dumps(m).encode()))
def test_every_frame_on_the_worker_socket_is_answered(target, frame):
  server, *_ = target
  sock = _attach(server.options.socket_path)
  replies = []
  try:
    sock.sendall(frame)
    with contextlib.suppress(OSError):  # closed already: its answer waits to be read
      ipc.send(sock, {"op": "ping"})
    while not replies or "ok" not in replies[-1]:
      replies.append(ipc.recv(sock)[0])
  except (ConnectionError, OSError):
    pass  # answered, then closed: a frame that is not a message ends the connection
  finally:
    sock.close()
  assert replies, "the connection ended with no answer"
  assert all("ok" in r or "offset" in r or r["error"]["type"].endswith("Error")
             for r in replies), replies


@FUZZ
@given(st.binary(max_size=100))
def test_any_first_frame_on_a_new_connection_is_answered(target, data):
  server, *_ = target
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(server.options.socket_path)
    sock.sendall(struct.pack("<I", len(data)) + data)
    raw = ipc.recv_bytes(sock)  # ConnectionError, with no answer, fails the test
  try:
    reply = json.loads(raw)
  except ValueError:
    assert pb.StreamItem.FromString(raw).HasField("error")  # a stream's first frame
    return
  assert "error" in reply or "session" in reply, reply


@FUZZ
@given(st.data())
def test_random_calls_on_a_calls_connection_are_answered(target, data):
  server, worker, _, _, root = target
  request = data.draw(calls(worker, root)).SerializeToString()
  frame = data.draw(st.just(request) | st.binary(max_size=300))
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(server.options.socket_path)
    ipc.send(sock, {"op": "calls", "session": worker.session})
    ipc.send_bytes(sock, frame)
    reply = pb.CallResponse.FromString(ipc.recv_bytes(sock, limit=1 << 30))
    if reply.HasField("error"):
      error = protocol.error_from_info(reply.error, host="fuzz")
      if isinstance(error, errors.RemoteError):
        from_user_code(error)
    # The connection serves on.
    ipc.send_bytes(sock, pb.CallRequest(
        name="add", args=codec.encode((2, 3)), kwargs=codec.encode({}),
        worker_session=worker.session).SerializeToString())
    assert codec.decode(pb.CallResponse.FromString(ipc.recv_bytes(sock)).result) == 5


def test_after_the_fuzz_the_sidecar_still_serves(target):
  server, *_ = target
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"], timeout=10) as ctl:
    big = np.arange(1 << 14, dtype=np.float32)
    np.testing.assert_array_equal(ctl.call("echo", args=(big,))[0], big)
    assert ctl.call("add", args=(2,), kwargs={"b": 3}) == [5]
