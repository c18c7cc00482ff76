"""A client that speaks ``sidecar.v1`` by hand, as an attacker on loopback would."""

import grpc
import pytest

from sidecar._src.wire import codec, protocol
from sidecar._src.wire.protocol import pb


class Raw:
  """A client that speaks ``sidecar.v1`` by hand: none of the Controller's checks."""

  def __init__(self, port: int, *, token: str | None = None, replica_token: str | None = None):
    # Room for a whole arena in a reply: what leaks, if anything does, arrives whole.
    self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    auth = [] if token is None else [(protocol.AUTH_KEY, f"Bearer {token}")]
    handshake = self.channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)
    peer = [] if replica_token is None else [(protocol.REPLICA_KEY, f"Bearer {replica_token}")]
    reply = handshake(pb.HandshakeRequest(versions=protocol.local_versions(), client="attacker"),
                      metadata=auth + peer, timeout=10)
    self.metadata = auth + [(protocol.SESSION_KEY, reply.session)]
    self._call = self.channel.unary_unary(
        f"/{protocol.SERVICE}/Call", request_serializer=pb.CallRequest.SerializeToString,
        response_deserializer=pb.CallResponse.FromString)
    self.ckpt = protocol.ckpt_pb_grpc.CheckpointStub(self.channel)
    self._stream = self.channel.stream_stream(
        f"/{protocol.SERVICE}/Stream", request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.StreamItem.FromString)

  def call(self, name: str, *args: pb.Value, worker_session: str = "", **kwargs) -> pb.Value:
    request = pb.CallRequest(name=name, args=pb.Value(tuple=pb.ListValue(items=list(args))),
                             kwargs=codec.encode(kwargs), worker_session=worker_session)
    # 1M values: seconds at a load of 4
    return self._call(request, metadata=self.metadata, timeout=60).result

  def feed(self, name: str, spec: pb.FeedSpec) -> list[pb.StreamItem]:
    request = pb.CallRequest(name=name, args=codec.encode(()), kwargs=codec.encode({}), feed=spec)
    return list(self._stream(iter([pb.StreamRequest(start=request, prefetch=1)]),
                             metadata=self.metadata, timeout=10))

  def close(self):
    self.channel.close()


def arena_ref(offset: int, generation: int, nbytes: int, shape=None, dtype="uint8") -> pb.Value:
  return pb.Value(arena=pb.ArenaRef(offset=offset, nbytes=nbytes, generation=generation,
                                    dtype=dtype, shape=(nbytes,) if shape is None else shape))


def rejected(fn) -> grpc.RpcError:
  with pytest.raises(grpc.RpcError) as info:
    fn()
  return info.value
