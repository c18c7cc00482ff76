"""One controller-side connection to one sidecar: channel, handshake, metadata."""

from __future__ import annotations

import dataclasses
import os
import socket

import grpc

from sidecar._src import env, errors, protocol
from sidecar._src.protocol import pb

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
)


def channel_options(peer_timeout: float) -> tuple[tuple[str, int], ...]:
  """CHANNEL_OPTIONS, with HTTP/2 pings that find a hung or stopped sidecar within about
  ``peer_timeout`` seconds, also while a stream waits on a slow pipeline.

  A ping goes out after half the peer timeout without one (at most every 10 s) and must
  be answered within the other half; a stopped process answers none, so its streams and
  calls end with UNAVAILABLE ("ping timeout"): HostLostError. gRPC's own ping timeout
  (``grpc.http2.ping_timeout_ms``, 60 s by default) is what bounds it, not
  ``keepalive_timeout_ms``; the sidecar accepts pings this often
  (``host.server.KEEPALIVE_OPTIONS``).
  """
  half = max(int(peer_timeout * 500), 1)
  return CHANNEL_OPTIONS + (
      ("grpc.keepalive_time_ms", min(half, 10_000)),
      ("grpc.keepalive_timeout_ms", half),
      ("grpc.http2.ping_timeout_ms", half),
      ("grpc.http2.max_pings_without_data", 0),  # keep asking while a stream is quiet
  )


@dataclasses.dataclass(frozen=True, slots=True)
class HostInfo:
  """A sidecar's identity and what it can run, as its handshake told."""
  host_id: int
  slice_id: int
  device_ids: tuple[int, ...]
  hostname: str
  pid: int
  address: str
  functions: tuple[str, ...]
  pipelines: tuple[str, ...]
  registry_fingerprint: str
  versions: dict[str, str]


class Connection:
  """A channel to one sidecar, after a successful handshake."""

  def __init__(self, address: str, *, token: str | None, timeout: float,
               peer_timeout: float = env.DEFAULT_PEER_TIMEOUT_S,
               credentials: grpc.ChannelCredentials | None = None):
    self.address = address
    options = channel_options(peer_timeout)
    self._channel = (grpc.insecure_channel(address, options=options) if credentials is None
                     else grpc.secure_channel(address, credentials, options=options))
    try:
      grpc.channel_ready_future(self._channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
      self._channel.close()
      raise errors.HostLostError(
          f"sidecar {address} did not answer within {timeout:.3g} s; is `sidecar serve` "
          "running there and the port reachable (and TLS on both sides or neither: a "
          "sidecar with --tls-cert needs tls_ca=... here, or SIDECAR_TLS_CA)?") from None
    self._auth = ((protocol.AUTH_KEY, f"Bearer {token}"),) if token else ()
    self._handshake = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)
    self.call_rpc = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Call", request_serializer=pb.CallRequest.SerializeToString,
        response_deserializer=pb.CallResponse.FromString)
    self.stream_rpc = self._channel.stream_stream(
        f"/{protocol.SERVICE}/Stream", request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.StreamItem.FromString)
    self.checkpoint = protocol.ckpt_pb_grpc.CheckpointStub(self._channel)  # checkpoint_client
    self.status_rpc = self._channel.unary_unary(
        f"/{protocol.SERVICE}/Status", request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusResponse.FromString)
    try:
      reply = self._handshake(
          pb.HandshakeRequest(versions=protocol.local_versions(),
                              client=f"controller pid {os.getpid()} on {socket.gethostname()}"),
          timeout=timeout, metadata=self._auth)
    except grpc.RpcError as e:
      self._channel.close()
      raise protocol.error_from_rpc(e, host=address) from None
    self.reply = reply
    self.metadata = self._auth + ((protocol.SESSION_KEY, reply.session),)
    ident = reply.identity
    self.info = HostInfo(
        host_id=ident.host_id, slice_id=ident.slice_id, device_ids=tuple(ident.device_ids),
        hostname=ident.hostname, pid=ident.pid, address=address,
        functions=tuple(e.name for e in reply.registry if e.kind == "function"),
        pipelines=tuple(e.name for e in reply.registry if e.kind == "pipeline"),
        registry_fingerprint=reply.registry_fingerprint,
        versions={"protocol": str(reply.versions.protocol), "package": reply.versions.package,
                  "python": reply.versions.python, "numpy": reply.versions.numpy,
                  "jax": reply.versions.jax})

  def close(self) -> None:
    self._channel.close()
