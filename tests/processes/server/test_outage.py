"""Tier 3: outages an attacker without a token makes (issue 23, items 1 and 2), on a real
``sidecar serve`` with a low descriptor limit, over loopback only."""

import os
import resource
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import sidecar
from tests.conftest import eventually

pytestmark = pytest.mark.processes


def open_fds(pid: int) -> int:
  return len(os.listdir(f"/proc/{pid}/fd"))


def health(address: str) -> int:
  with grpc.insecure_channel(address) as ch:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                timeout=10).status


def idle_connections(port: int, n: int) -> list[socket.socket]:
  """``n`` idle connections from 8 loopback peers (the health port keeps 8 of one)."""
  out = []
  for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=5,
                                 source_address=(f"127.0.0.{2 + i % 8}", 0))
    out.append(s)
  return out


def test_the_worker_socket_survives_running_out_of_descriptors():
  """Idle connections to the health port use up the sidecar's descriptors; a worker that
  attaches meanwhile fails, but once they close the worker socket accepts again."""
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    configure_jax=False, transport="tcp") as cluster:
    pid = cluster.pid(0)
    health_port = int(cluster.health_addresses[0].rsplit(":", 1)[1])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + 24, hard))
    conns = idle_connections(health_port, 64)  # more than the descriptors left
    try:
      limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
      assert eventually(lambda: limit - open_fds(pid) <= 1, timeout=10), (
          "the connections did not use up the descriptors")
      # A worker attaching now: its connection waits in the backlog, accept() fails EMFILE.
      with pytest.raises(sidecar.SidecarError):
        sidecar.jax.Worker(cluster.socket(0), timeout=2).close()
    finally:
      for c in conns:
        c.close()
    assert eventually(lambda: open_fds(pid) < limit - 8, timeout=20)
    with sidecar.jax.Worker(cluster.socket(0), timeout=10) as w:  # before: timed out, for good
      assert w.session
    assert health(cluster.health_addresses[0]) == health_pb2.HealthCheckResponse.SERVING
    with cluster.controller(connect_timeout=10) as ctl:
      assert ctl.status()[0].identity.host_id == 0


def test_an_inline_call_costs_the_sidecar_less_than_four_times_its_size():
  """A 128 MiB array inline (no arena) grew the sidecar's peak RSS by 5-7x its size (gRPC's
  bytes, protobuf's copy, the field read out of it, the array); the target is 3x."""
  import numpy as np

  from sidecar._src.wire import codec, protocol
  from sidecar._src.wire.protocol import pb
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.sidecar_fns"],
                                    configure_jax=False) as cluster:
    pid = cluster.pid(0)
    channel = grpc.insecure_channel(cluster.addresses[0], options=[
        ("grpc.max_send_message_length", 256 << 20)])
    reply = channel.unary_unary(
        f"/{protocol.SERVICE}/Handshake", request_serializer=pb.HandshakeRequest.SerializeToString,
        response_deserializer=pb.HandshakeResponse.FromString)(
            pb.HandshakeRequest(versions=protocol.local_versions()), timeout=10)
    call = channel.unary_unary(f"/{protocol.SERVICE}/Call",
                               request_serializer=pb.CallRequest.SerializeToString,
                               response_deserializer=pb.CallResponse.FromString)
    metadata = [(protocol.SESSION_KEY, reply.session)]

    def size_of(nbytes: int) -> int:
      request = pb.CallRequest(name="size_of", kwargs=codec.encode({}), args=codec.encode(
          (np.ones(nbytes, np.uint8),), inline_limit=1 << 40))
      return codec.decode(call(request, metadata=metadata, timeout=120).result)

    assert size_of(1 << 20) == 1 << 20  # warm: threads and imports are no payload's
    with open(f"/proc/{pid}/clear_refs", "w") as f:
      f.write("5")  # the peak RSS starts afresh from the RSS now

    def hwm() -> float:
      with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    before = hwm()
    assert size_of(128 << 20) == 128 << 20
    grown = hwm() - before
    channel.close()
  assert grown < 4 * 128, f"peak RSS +{grown:.0f} MiB for a 128 MiB call"
