"""Tier 2: a pool's metrics by tenant (issue 37): the six figures the managed Shared
Pathways Service exports, in our terms, read from the exposition and from a live pool."""

import numpy as np
import pytest

from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from tests.support.metrics import samples, scrape, snapshot, value
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server

# (the managed service's figure, ours)
SIX = [("active users", "sidecar_pool_tenants_active"),
       ("chips in use", "sidecar_tenant_arena_bytes"),
       ("assignment time", "sidecar_tenant_admission_wait_seconds_count"),
       ("users waiting", "sidecar_pool_tenants_waiting"),
       ("requested chips", "sidecar_tenant_requested_bytes_total"),
       ("successful requests", "sidecar_tenant_requests_total")]


def figures(name, **kw):
  base = dict(name=name, sessions=0, workers=0, arena_bytes=0, arena_guaranteed=0,
              arena_ceiling=1 << 20, feeds=0, feed_workers=0)
  return metrics_lib.TenantFigures(**{**base, **kw})


def test_each_tenant_has_the_six_figures():
  tenants = (figures("alice", sessions=2, arena_bytes=4096, arena_guaranteed=8192, feeds=1,
                     feed_workers=3, saves=1, ram_tier_bytes=1 << 20), figures("bob"))
  m = metrics_lib.Metrics(lambda: snapshot(tenants=tenants))
  m.tenant_request("alice", "call", "OK")
  m.tenant_request("alice", "call", "RESOURCE_EXHAUSTED")
  m.tenant_request("bob", "feed", "OK")
  m.tenant_requested("alice", "inline", 3 << 20)
  with m.waiting("bob", "inline"):
    during = samples(m.text())
  found = samples(m.text())
  assert value(during, "sidecar_pool_tenants_waiting") == 1
  assert value(during, "sidecar_tenant_waiting", tenant="bob") == 1
  assert value(found, "sidecar_pool_tenants_waiting") == 0
  assert value(found, "sidecar_pool_tenants_active") == 1  # bob has no session nor worker
  assert value(found, "sidecar_tenant_sessions", tenant="alice") == 2
  assert value(found, "sidecar_tenant_arena_bytes", tenant="alice") == 4096
  assert value(found, "sidecar_tenant_arena_guaranteed_bytes", tenant="alice") == 8192
  assert value(found, "sidecar_tenant_feed_workers", tenant="alice") == 3
  assert value(found, "sidecar_tenant_saves", tenant="alice") == 1
  assert value(found, "sidecar_tenant_ram_tier_bytes", tenant="alice") == 1 << 20
  assert value(found, "sidecar_tenant_admission_wait_seconds_count", tenant="bob") == 1
  assert value(found, "sidecar_tenant_requested_bytes_total", tenant="alice",
               what="inline") == 3 << 20
  assert value(found, "sidecar_tenant_requests_total", tenant="alice", kind="call",
               code="OK") == 1
  assert value(found, "sidecar_tenant_requests_total", tenant="alice", kind="call",
               code="RESOURCE_EXHAUSTED") == 1
  assert value(found, "sidecar_tenant_requests_total", tenant="bob", kind="feed", code="OK") == 1
  names = {n for n, _ in found}
  assert {ours for _, ours in SIX} <= names


def test_without_a_pool_no_tenant_is_counted():
  m = metrics_lib.Metrics(snapshot)
  m.tenant_request(None, "call", "OK")
  m.tenant_requested(None, "inline", 1)
  with m.waiting(None, "inline"):
    pass
  found = samples(m.text())
  assert not [n for n, labels in found if "tenant" in dict(labels)]
  assert value(found, "sidecar_pool_tenants_active") == 0


def test_a_live_pool_counts_each_tenants_requests_and_inline_bytes(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path), metrics_port=0)
  big = np.ones(2 << 20, np.uint8)  # inline, large: decoded from the request's bytes
  with controller(server, ALICE) as alice, controller(server, BOB) as bob:
    assert alice.call("echo", args=(1,)) == [1]
    assert alice.call("size_of", args=(big,)) == [big.nbytes]
    assert bob.call("echo", args=(2,)) == [2]
    with pytest.raises(errors.PermissionDeniedError,
                       match="tenant .bob. may not run function .size_of."):
      bob.call("size_of", args=(1,))  # not in bob's allowlist
  found = samples(scrape(f"http://127.0.0.1:{server.metrics_port}/metrics"))
  assert value(found, "sidecar_tenant_requests_total", tenant="alice", kind="call",
               code="OK") == 2
  assert value(found, "sidecar_tenant_requests_total", tenant="bob", kind="call",
               code="OK") == 1
  assert value(found, "sidecar_tenant_requests_total", tenant="bob", kind="call",
               code="PERMISSION_DENIED") == 1
  assert value(found, "sidecar_tenant_requested_bytes_total", tenant="alice",
               what="inline") > big.nbytes
  assert value(found, "sidecar_tenant_admission_wait_seconds_count", tenant="alice") == 1
  assert value(found, "sidecar_tenant_requested_bytes_total", tenant="bob", what="inline") == 0
