"""/metrics: the exposition with no sockets, then one in-process server scraped over HTTP."""

import errno
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import sidecar
from sidecar._src.core import options as options_lib
from sidecar._src.server import metrics as metrics_lib, metrics_server
from sidecar._src.server.server import Server
from tests.support.metrics import samples, scrape, snapshot, value
from tests.support.paths import ROOT

pytestmark = pytest.mark.server


def test_exposition_parses_and_each_server_has_its_own_registry():
  a, b = metrics_lib.Metrics(snapshot), metrics_lib.Metrics(lambda: snapshot(arena_used=0))
  a.call_started("call")
  a.call_done("call", "echo", "OK", 0.002)
  a.checkpoint_bytes("staged", 1000)
  found, other = samples(a.text()), samples(b.text())
  assert value(found, "sidecar_calls_total", kind="call", name="echo", code="OK") == 1
  assert value(found, "sidecar_call_seconds_count", name="echo") == 1
  assert value(found, "sidecar_calls_in_flight", kind="call") == 0
  assert value(found, "sidecar_checkpoint_bytes_total", what="staged") == 1000
  assert value(found, "sidecar_arena_leased_bytes", worker="0123456789ab") == 4096
  assert value(found, "sidecar_feed_batches_total", pipeline="ids") == 5
  assert value(found, "sidecar_feed_trainer_wait_seconds_total", pipeline="ids") == 0.125
  assert value(found, "sidecar_ram_tier_steps", kind="own") == 2
  assert value(found, "sidecar_ram_tier_bytes", kind="replica") == 50
  assert value(found, "sidecar_host_info", host_id="0", slice_id="0") == 1
  assert value(other, "sidecar_calls_total", kind="call", name="echo", code="OK") == 0
  assert value(other, "sidecar_arena_used_bytes") == 0


def test_each_goodput_ledger_and_trainer_has_its_own_labelled_series():
  def ledger(tenant, ledger_id, ratio):
    return metrics_lib.GoodputFigures(tenant=tenant, ledger=ledger_id, wall_s=100.0,
                                      productive_s=100.0 * ratio, goodput=ratio,
                                      badput_s=(("stall", 1.0),), restarts=1)
  trainer = metrics_lib.TrainerFigures(tenant="bob", rank=3, trainer="42aa", since_step_s=12.5,
                                       timeout_s=10.0, stalled=True)
  idle = metrics_lib.TrainerFigures(tenant="bob", rank=4, trainer="43bb", since_step_s=None,
                                    timeout_s=10.0, stalled=False)
  m = metrics_lib.Metrics(lambda: snapshot(
      goodput=(ledger("alice", "aaaa", 0.5), ledger("bob", "bbbb", 0.99)),
      trainers=(trainer, idle)))
  found = samples(m.text())
  # bob's ledger is his own series: alice's figures stay hers.
  assert value(found, "sidecar_goodput_ratio", tenant="alice", ledger="aaaa") == 0.5
  assert value(found, "sidecar_goodput_ratio", tenant="bob", ledger="bbbb") == 0.99
  assert value(found, "sidecar_goodput_badput_seconds", tenant="alice", ledger="aaaa",
               category="stall") == 1.0
  key = {"tenant": "bob", "rank": "3", "trainer": "42aa"}
  assert value(found, "sidecar_trainer_seconds_since_step", **key) == 12.5
  assert value(found, "sidecar_trainer_stalled", **key) == 1
  assert ("sidecar_trainer_seconds_since_step", (("rank", "4"), ("tenant", "bob"),
                                                 ("trainer", "43bb"))) not in found
  assert value(found, "sidecar_trainer_stall_timeout_seconds", tenant="bob", rank="4",
               trainer="43bb") == 10.0


def test_opaque_ids_are_keyed_and_stable():
  key, other = b"k" * 32, b"o" * 32
  a = metrics_lib.opaque_id(key, "/ckpt/alice/secret-project")
  assert a == metrics_lib.opaque_id(key, "/ckpt/alice/secret-project")
  assert len(a) == 12 and "secret" not in a
  assert a != metrics_lib.opaque_id(other, "/ckpt/alice/secret-project")
  assert a != metrics_lib.opaque_id(key, "/ckpt/alice/other-project")


def test_metrics_port_in_use_is_a_start_up_error_naming_the_flag(tmp_path):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    opts = options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0, shm_size=8 << 20,
                                 socket_path=str(tmp_path / "s.sock"), metrics_port=port)
    with pytest.raises(OSError, match=f"127.0.0.1:{port}.*pick another --metrics-port"):
      Server(opts).start()
  assert not (tmp_path / "s.sock").exists()  # what it had started is stopped


@pytest.mark.parametrize("port", [-1, 70000, "9090"], ids=["negative", "too-big", "str"])
def test_bad_metrics_port_is_refused(port):
  with pytest.raises(ValueError,
                     match=r"metrics_port \(--metrics-port\) must be a TCP port in 1..65535"):
    options_lib.ServerOptions(metrics_port=port)


def test_off_by_default_and_unregistered_names_share_one_label(make_server):
  assert make_server().metrics_port is None
  server = make_server(metrics_port=0)
  with sidecar.jax.Controller([f"127.0.0.1:{server.port}"]) as ctl:
    assert ctl.call("echo", args=(1,)) == [1]
    for name in ("nope-1", "nope-2"):
      with pytest.raises(sidecar.NotRegisteredError):
        ctl.call(name)
  found = samples(scrape(f"http://127.0.0.1:{server.metrics_port}/metrics"))
  assert value(found, "sidecar_calls_total", kind="call", name="echo", code="OK") == 1
  assert value(found, "sidecar_calls_total", kind="call", name=metrics_lib.UNREGISTERED,
               code="NOT_FOUND") == 2
  assert not any("nope" in str(labels) for _, labels in found)


def test_the_grafana_dashboard_queries_only_metrics_the_sidecar_exports():
  import json
  import re
  path = ROOT / "k8s" / "grafana" / "sidecar-dashboard.json"
  dashboard = json.loads(path.read_text())
  used = {name for panel in dashboard["panels"] for target in panel["targets"]
          for name in re.findall(r"\bsidecar_\w+", target["expr"])}
  tenant = metrics_lib.TenantFigures(name="alice", sessions=1, workers=0, arena_bytes=1,
                                     arena_guaranteed=1, arena_ceiling=1, feeds=0,
                                     feed_workers=0)
  m = metrics_lib.Metrics(lambda: snapshot(tenants=(tenant,)))
  m.call_done("call", "echo", "OK", 0.001)
  m.background("write", 1.0)
  m.restored_bytes("ram", 1)
  m.tenant_request("alice", "call", "OK")
  m.tenant_requested("alice", "inline", 1)
  with m.waiting("alice", "inline"):
    pass
  exported = {s.name for f in text_string_to_metric_families(m.text()) for s in f.samples}
  assert len(used) >= 22 and used <= exported, used - exported


class _OutOfDescriptors:
  """The listener of a process that has used up its descriptors: accept() fails with
  EMFILE while a connection waits (select says it is readable), as after an fd flood."""

  def __init__(self, sock: socket.socket):
    self._sock, self.accepts = sock, 0

  def fileno(self) -> int:
    return self._sock.fileno()

  def accept(self):
    self.accepts += 1
    raise OSError(errno.EMFILE, "Too many open files")

  def close(self) -> None:
    self._sock.close()


def test_the_metrics_server_waits_out_running_out_of_descriptors():
  """socketserver drops an accept's OSError and selects again at once: with no descriptor
  left, the waiting connection kept the listener readable and the thread spun a core."""
  server, thread = metrics_server.serve(metrics_lib.Metrics(snapshot).registry, "127.0.0.1", 0)
  try:
    fake = _OutOfDescriptors(server.socket)
    server.socket = fake
    waiting = socket.create_connection(server.server_address[:2], timeout=5)
    time.sleep(1.0)
    accepts = fake.accepts
    assert 1 <= accepts <= 1.0 / metrics_server.ACCEPT_RETRY_S + 5, accepts  # before: ~10**5
    waiting.close()
  finally:
    server.shutdown()
    server.server_close()
    thread.join(10)
  assert not thread.is_alive()
