"""Floods of a sidecar's gRPC ports as anyone who reaches them makes them: raw HTTP/2 by
hand (no token, no gRPC client), from any loopback source address (``127.0.0.2`` is
another peer than a client on ``127.0.0.1``)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, DATA = 4, 1, 0
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
# Another peer than the clients a test makes (127.0.0.1): all of 127/8 is loopback.
STRANGER = "127.0.0.2"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
  head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
  return head + payload


def _literal(name: bytes, value: bytes) -> bytes:
  """One header field, HPACK's literal without indexing (no Huffman, lengths under 127)."""
  assert len(name) < 127 and len(value) < 127
  return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def request_headers(path: str, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
  fields = ((":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
            ("content-type", "application/grpc"), ("te", "trailers"), *metadata)
  return b"".join(_literal(k.encode(), v.encode()) for k, v in fields)


def connect(port: int, *, source: str = STRANGER, host: str = "127.0.0.1") -> socket.socket:
  """A TCP connection to ``port`` from ``source`` that has said the HTTP/2 preface and its
  SETTINGS (and acknowledged the server's): past any handshake timeout, an idle client."""
  sock = socket.socket()
  sock.bind((source, 0))
  sock.settimeout(5)
  sock.connect((host, port))
  sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
  return sock


def idle(port: int, count: int, *, source: str = STRANGER) -> list[socket.socket]:
  """``count`` idle HTTP/2 connections (those refused at once are closed and not counted)."""
  conns = []
  for _ in range(count):
    try:
      conns.append(connect(port, source=source))
    except OSError:
      pass
  return conns


def half_open(sock: socket.socket, path: str, streams: int, *, first: int = 1,
              metadata: tuple[tuple[str, str], ...] = ()) -> None:
  """Starts ``streams`` calls of ``path`` on ``sock`` whose request never comes: HEADERS
  without END_STREAM, and no DATA."""
  block = request_headers(path, metadata)
  sock.sendall(b"".join(frame(HEADERS, END_HEADERS, first + 2 * i, block)
                        for i in range(streams)))


def open_count(conns: list[socket.socket]) -> int:
  """How many of ``conns`` the server has not closed (read without blocking)."""
  n = 0
  for c in conns:
    c.setblocking(False)
    try:
      while c.recv(1 << 16):
        pass
      continue  # b"": closed by the server
    except BlockingIOError:
      n += 1
    except OSError:
      continue
  return n


def close(conns: list[socket.socket]) -> None:
  for c in conns:
    with contextlib.suppress(OSError):
      c.close()


def check(port: int, timeout: float = 5.0) -> str:
  """One health check over a fresh connection, as the kubelet makes it: the status's name,
  or the error's code and its text."""
  with grpc.insecure_channel(f"127.0.0.1:{port}",
                             options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
    try:
      reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=timeout)
    except grpc.RpcError as e:
      return f"{e.code().name}: {e.details()}"
  return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def watches(port: int, count: int, *, per_connection: int = 1) -> list:
  """``count`` connections, each holding ``per_connection`` health ``Watch`` streams:
  (channel, responses) pairs, their first answer read (or the refusal, as an error)."""
  out = []
  for _ in range(count):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                    options=[("grpc.use_local_subchannel_pool", 1)])
    for _ in range(per_connection):
      responses = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
      out.append((channel, responses))
  for _, responses in out:
    with contextlib.suppress(grpc.RpcError):
      next(responses)
  return out


def within(predicate, timeout: float) -> float | None:
  """Seconds until ``predicate`` held (polled), or None if it did not within ``timeout``."""
  start = time.monotonic()
  while time.monotonic() - start < timeout:
    if predicate():
      return time.monotonic() - start
    time.sleep(0.05)
  return None


def new_client(address: str, token: str, *, timeout: float = 10.0) -> bool:
  """A new client (a channel of its own: a new connection, never one another channel of
  this process shares) handshakes with ``token`` and asks Status within ``timeout`` s, as
  a Controller does (gRPC connects again, with its backoff, until the deadline)."""
  with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
    auth = ((protocol.AUTH_KEY, f"Bearer {token}"),)
    reply = channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)(
            pb.HandshakeRequest(versions=protocol.local_versions(), client="a new client"),
            metadata=auth, timeout=timeout, wait_for_ready=True)
    status = channel.unary_unary(
        f"/{protocol.SERVICE}/Status", request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusResponse.FromString)(
            pb.StatusRequest(), metadata=(*auth, (protocol.SESSION_KEY, reply.session)),
            timeout=timeout)
  return status.arena_size > 0
