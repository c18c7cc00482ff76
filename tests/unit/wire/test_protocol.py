import errno
import json
import os

import grpc
import pytest

from sidecar._src.core import errors
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

pytestmark = pytest.mark.unit


def test_version_differences_exact_and_minor():
  ours = protocol.local_versions()
  same_minor = pb.Versions()
  same_minor.CopyFrom(ours)
  same_minor.python = ours.python.rsplit(".", 1)[0] + ".999"
  assert protocol.version_differences(ours, same_minor) == []
  other = pb.Versions(protocol=ours.protocol + 1, package="9.9", python="2.7.1",
                      numpy=ours.numpy, jax=ours.jax)
  diffs = protocol.version_differences(ours, other)
  assert [d.split(":")[0] for d in diffs] == ["protocol", "package", "python"]


@pytest.mark.parametrize("exc,code", [
    (errors.NotRegisteredError("x"), grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgumentError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.VersionMismatchError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AuthenticationError("x"), grpc.StatusCode.UNAUTHENTICATED),
    (errors.CorruptCheckpointError("x"), grpc.StatusCode.DATA_LOSS),
    (errors.ShardsLostError("x"), grpc.StatusCode.DATA_LOSS),
    (ValueError("x"), grpc.StatusCode.UNKNOWN),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name)
def test_status_codes(exc, code):
  assert protocol.status_code(exc) == code


@pytest.mark.parametrize("text,limit,keep,expected", [
    ("short", 100, "head", "short"),
    ("a" * 200, 100, "head", "a" * 69 + " [... 131 of 200 bytes cut ...]"),
    ("a" * 150 + "END", 100, "tail", "[... 84 of 153 bytes cut ...] " + "a" * 66 + "END"),
], ids=["short", "head", "tail"])
def test_truncate_says_how_much_was_cut(text, limit, keep, expected):
  out = protocol.truncate(text, limit, keep=keep)
  assert out == expected and len(out.encode()) <= limit


def test_truncate_never_splits_a_character():
  out = protocol.truncate("€" * 1000, 100)
  assert out.startswith("€" * 20) and len(out.encode()) <= 100


def test_error_info_cuts_long_messages_and_keeps_the_frames():
  def deep(n):
    if n == 0:
      raise ValueError("m" * 100_000)
    deep(n - 1)

  with pytest.raises(ValueError) as info:
    deep(3)
  e = protocol.error_info(info.value)
  assert len(e.message.encode()) <= protocol.MAX_ERROR_MESSAGE and "bytes cut" in e.message
  assert len(e.traceback.encode()) <= protocol.MAX_ERROR_TRACEBACK
  assert e.traceback.count("in deep") == 4  # every frame, though the last line was cut


class _Context:
  """What ``protocol.abort`` needs of a grpc.ServicerContext: it keeps what it is given."""

  def set_trailing_metadata(self, metadata):
    self.metadata = metadata

  def abort(self, code, details):
    self.code, self.details = code, details
    raise _Aborted(self)


class _Aborted(grpc.RpcError):
  """The failed RPC as a client sees it: status, details and trailer."""

  def __init__(self, context):
    self._context = context

  def code(self):
    return self._context.code

  def details(self):
    return self._context.details

  def trailing_metadata(self):
    return self._context.metadata


def _raised(exc):
  try:
    raise exc
  except Exception as e:
    return e


def _over_trailer(exc):
  with pytest.raises(_Aborted) as info:
    protocol.abort(_Context(), exc)
  return protocol.error_from_rpc(info.value, host="h", host_id=3)


def _over_stream_item(exc):
  item = pb.StreamItem.FromString(
      pb.StreamItem(end=True, error=protocol.error_info(exc)).SerializeToString())
  return protocol.error_from_info(item.error, host="h", host_id=3)


def _over_json(exc):
  return protocol.error_from_dict(json.loads(json.dumps(protocol.error_dict(exc))), host="h",
                                  host_id=3)


@pytest.mark.parametrize("carry", [_over_trailer, _over_stream_item, _over_json],
                         ids=["trailer", "stream-item", "json"])
def test_an_error_is_the_same_over_every_carrier(carry):
  ours = carry(_raised(errors.InvalidArgumentError("step must be >= 0, got -1")))
  assert type(ours) is errors.InvalidArgumentError and str(ours) == "step must be >= 0, got -1"
  theirs = carry(_raised(KeyError("user's key")))
  assert type(theirs) is errors.RemoteError and theirs.host_id == 3
  assert theirs.remote_type == "builtins.KeyError"
  assert theirs.remote_message == str(KeyError("user's key"))
  assert "in _raised" in theirs.remote_traceback
  lost = carry(errors.HostLostError("peer gone"))
  assert type(lost) is errors.HostLostError and lost.host_id == 3


@pytest.mark.parametrize("carry", [_over_trailer, _over_stream_item, _over_json],
                         ids=["trailer", "stream-item", "json"])
def test_a_remote_error_crosses_again_as_the_error_it_stands_for(carry):
  # A feed worker's error reaches the sidecar as a RemoteError, which crosses on to the
  # trainer: once "RemoteError: builtins.ValueError: ..." with the traceback in the message.
  inner = carry(_raised(FileNotFoundError("no corpus manifest at /d")))
  outer = carry(inner)
  assert type(outer) is errors.RemoteError
  assert (outer.remote_type, outer.remote_message, outer.remote_traceback) == (
      "builtins.FileNotFoundError", "no corpus manifest at /d", inner.remote_traceback)
  made = protocol.remote_error(_raised(PermissionError("denied")))
  assert (made.remote_type, made.remote_message) == ("builtins.PermissionError", "denied")
  assert "in _raised" in made.remote_traceback and made.host_id is None


@pytest.mark.parametrize("carry", [_over_trailer, _over_stream_item, _over_json],
                         ids=["trailer", "stream-item", "json"])
def test_a_corrupt_checkpoint_crosses_as_itself(carry):
  """Issue 42 item 8: it crossed as gRPC UNKNOWN; a client without the trailer (another
  language, ``grpcurl``) now reads DATA_LOSS, and ours the error itself."""
  for sent in (errors.CorruptCheckpointError("array 'w' shard [[0, 8]] does not match its "
                                             "crc32c"),
               errors.ShardsLostError("shards of 'w' have no live copy")):
    got = carry(_raised(sent))
    assert type(got) is type(sent) and str(got) == str(sent)
  context = _Context()
  context.metadata, context.code, context.details = (), grpc.StatusCode.DATA_LOSS, "torn"
  got = protocol.error_from_rpc(_Aborted(context), host="h", host_id=1)
  assert type(got) is errors.CorruptCheckpointError and str(got) == "torn (sidecar h, host 1)"


def test_a_status_without_a_trailer_falls_back_on_its_code():
  context = _Context()
  context.metadata, context.code, context.details = (), grpc.StatusCode.INVALID_ARGUMENT, "bad"
  e = protocol.error_from_rpc(_Aborted(context), host="h", host_id=1)
  assert type(e) is errors.InvalidArgumentError and str(e) == "bad (sidecar h, host 1)"
  context.metadata = ((protocol._ERROR_KEY, b"\xff not a pb.Error"),)
  assert type(protocol.error_from_rpc(_Aborted(context), host="h")) is errors.InvalidArgumentError


@pytest.mark.parametrize("reply", [{"type": 5}, "boom", {"message": ["x"]}],
                         ids=["int-type", "str", "list-message"])
def test_a_malformed_json_error_is_named(reply):
  e = protocol.error_from_dict(reply, host="feed worker 1")
  assert isinstance(e, errors.RemoteError) and e.remote_type == "ProtocolError"
  assert "feed worker 1 sent an error that is no pb.Error" in str(e)


def test_a_checkpoint_write_error_crosses_with_its_errno_path_and_host():
  import errno
  sent = errors.CheckpointWriteError("host 3 could not write step 2: EIO", errno=errno.EIO,
                                     path="/ckpt/2.orbax-checkpoint-tmp/x/0", host_id=3)
  for got in (protocol.error_from_info(protocol.error_info(sent), host="h", host_id=9),
              protocol.error_from_dict(protocol.error_dict(sent), host="h", host_id=9)):
    assert isinstance(got, errors.CheckpointWriteError) and isinstance(got, OSError)
    assert (str(got), got.errno, got.path, got.host_id) == (
        str(sent), errno.EIO, "/ckpt/2.orbax-checkpoint-tmp/x/0", 3)  # its host, not the sender


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE], ids=["EMFILE", "ENFILE"])
def test_a_full_descriptor_table_crosses_typed_never_as_builtins_with_a_traceback(err):
  """The sidecar out of descriptors, wherever it met it (a handshake, an attach): a
  ResourceExhaustedError naming the fix, not builtins.OSError and the server's traceback
  (issue 70, item 3)."""
  try:
    raise OSError(err, os.strerror(err))
  except OSError as e:
    info = protocol.error_info(e)
    code = protocol.status_code(e)
  assert info.type == "ResourceExhaustedError" and not info.traceback
  assert "too many files open" in info.message and "open_files" in info.message
  assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert isinstance(protocol.error_from_info(info, host="h"), errors.ResourceExhaustedError)
  other = protocol.error_info(OSError(errno.EIO, "I/O error"))  # user code's: as it is
  assert other.type == "builtins.OSError"
