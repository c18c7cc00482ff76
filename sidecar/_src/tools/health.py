"""``sidecar health``: one grpc.health.v1 Check of a sidecar's plaintext health port.

What the image's HEALTHCHECK runs (docker, podman), and a check by hand; the kubelet's gRPC
probes ask the same port themselves.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._src.core import address as address_lib, errors


def check(address: str, *, timeout: float = 5.0) -> tuple[bool, str]:
  """Whether the sidecar at ``address`` (HOST:PORT of its health port, or the unix:PATH it
  serves everything on) answers SERVING, and what it answered."""
  try:
    address_lib.check_access(address)
  except errors.SidecarError as e:
    return False, str(e)
  with grpc.insecure_channel(address) as channel:
    try:
      reply = health_pb2_grpc.HealthStub(channel).Check(
          health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as e:
      return False, f"{address}: {e.code().name}: {e.details()}"
  name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
  return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {name}"
