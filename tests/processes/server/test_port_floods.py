"""Tier 3: issue 76's floods of a ``sidecar serve`` with its default bounds, as the issue
made them (2,048 idle HTTP/2 connections, 64 health Watch streams), from another loopback
peer without a token; tests/server/server/test_port_floods.py holds each with small bounds."""

import time

import pytest

import sidecar
from tests.support import h2_flood

pytestmark = pytest.mark.processes
TOKEN = "alice-token-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="16MiB",
                                    configure_jax=False, transport="tcp", token=TOKEN) as c:
    yield c


def test_2048_idle_connections_keep_no_new_client_out(cluster):
  """Before: alice's new channel UNAVAILABLE, 15 s later the same; her old one worked."""
  port = int(cluster.addresses[0].rsplit(":", 1)[1])
  with cluster.controller(connect_timeout=10) as before:
    flood = h2_flood.idle(port, 2048)
    try:
      start = time.monotonic()
      assert h2_flood.new_client(cluster.addresses[0], TOKEN, timeout=10)
      assert time.monotonic() - start < 10
      assert before.status()[0].arena_size > 0
      # Past its peer's 16 at the next look (the rest after the handshake timeout, 10 s:
      # the tier-2 test waits for that).
      assert h2_flood.within(lambda: h2_flood.open_count(flood) <= 16, 10) is not None
    finally:
      h2_flood.close(flood)


def test_64_watch_streams_keep_no_health_check_out(cluster):
  """Before: every new health check refused, still 31 s later."""
  port = int(cluster.health_addresses[0].rsplit(":", 1)[1])
  held = h2_flood.watches(port, 64)
  try:
    for _ in range(5):
      assert h2_flood.check(port) == "SERVING"
    assert h2_flood.new_client(cluster.addresses[0], TOKEN, timeout=10)
  finally:
    for channel, _ in held:
      channel.close()
