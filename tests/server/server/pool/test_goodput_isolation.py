"""Tier 2: issue 63's attacks on the goodput ledger, through a pool sidecar's real worker
socket: bob's forged frames change only his own ledger, frames off the sidecar's clock are
refused, and a flood of marks writes almost nothing (server/goodput/ledgers.py)."""

import hashlib
import os
import time

import grpc
import numpy as np
import pytest

import sidecar
from sidecar._src.core import errors, goodput
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.wire import protocol
from sidecar._src.wire.protocol import pb
from tests.support.metrics import samples, scrape, value
from tests.support.pool_files import ALICE, BOB, controller, write_pool

pytestmark = pytest.mark.server

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob], checkpoint_bytes: 1MiB}
"""


def _figures(server):
  return {(f.tenant, os.path.basename(f.directory)): f.ledger
          for f in server.ledgers.figures()}


def test_bobs_forged_frames_change_only_his_own_ledger(make_server, tmp_path):
  server = make_server(pool=write_pool(tmp_path, POOL), metrics_port=0)
  with controller(server, ALICE, attach=True) as ctl, ctl.checkpointer(
      str(tmp_path / "alice" / "a")) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30)
  alice = _figures(server)[("alice", "a")]
  assert alice.lives and alice.lives[0].ended == "finish"
  with controller(server, BOB, attach=True) as ctl, ctl.checkpointer(
      str(tmp_path / "bob" / "b")) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30)
    bob = sidecar.jax.Worker(f"unix://{server.options.socket_path}", token=BOB)
    try:
      now = time.time()
      life = f"1@{now - 3_600_000:.3f}"
      forged = [goodput.Event("start", life, now, goodput.Counters(), start=now - 3_600_000,
                              pid=1).to_dict(),
                goodput.Event("finish", life, now, goodput.Counters(1, 0.0, 0.0, 0.0)
                              ).to_dict()]
      directory = str(tmp_path / "bob" / "b")
      with pytest.raises(errors.InvalidArgumentError, match="process start .* before this "
                                                          "sidecar's clock"):
        bob.send_ledger({"op": "goodput", "directory": directory, "events": forged},
                        reply=True, wait=True)
      future = [dict(forged[0], t=now + 3_600_000, start=now)]
      with pytest.raises(errors.InvalidArgumentError, match="after this sidecar's clock"):
        bob.send_ledger({"op": "goodput", "directory": directory, "events": future},
                        reply=True, wait=True)
      # A flood of marks (the attack sent 560 frames of 256; 100 keep the suite fast):
      # coalesced, almost nothing written; each frame's times are right, so only the
      # bound holds it.
      start = [goodput.Event("start", f"2@{now:.3f}", now, goodput.Counters(), start=now,
                             pid=2).to_dict()]
      bob.send_ledger({"op": "goodput", "directory": directory, "events": start},
                      reply=True, wait=True)
      path = goodput.path_in(os.path.realpath(directory))
      before = os.path.getsize(path)
      marks = [goodput.Event("mark", f"2@{now:.3f}", time.time(), goodput.Counters(7)
                             ).to_dict()] * 256
      for _ in range(100):
        bob.send_ledger({"op": "goodput", "events": marks}, reply=False, wait=True)
      bob.send_ledger({"op": "goodput", "events": []}, reply=True, wait=True)  # in order
      assert os.path.getsize(path) - before < 4096
    finally:
      bob.close()
  # alice's ledger is as it was, and /metrics shows each tenant's own, labelled.
  assert _figures(server)[("alice", "a")] == alice
  page = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
  found = samples(page)
  # Labelled by an opaque id keyed by her token (issue 70, item 7): an unauthenticated
  # scrape names none of her directories, nor any pid.
  ledger = metrics_lib.opaque_id(hashlib.sha256(b"sidecar-metrics-id\0" + ALICE.encode()).digest(),
                                 os.path.realpath(tmp_path / "alice" / "a"))
  assert value(found, "sidecar_goodput_ratio", tenant="alice", ledger=ledger) == alice.goodput
  assert all(labels and dict(labels).get("tenant") in ("alice", "bob")
             for name, labels in found if name.startswith("sidecar_goodput_"))
  assert str(tmp_path) not in page and os.path.realpath(tmp_path) not in page
  assert not any("pid" in dict(labels) for _, labels in found)


LEDGER_POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice], ledger_burst_bytes: 1MiB}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob], ledger_bytes_per_s: 1KiB,
     ledger_burst_bytes: 8KiB}
"""


def _saves(n: int) -> list[dict]:
  now = time.time()
  life = f"3@{now:.3f}"
  return [goodput.Event("start", life, now, goodput.Counters(), start=now, pid=3).to_dict()] + [
      goodput.Event("save", life, now, goodput.Counters(), step=s).to_dict() for s in range(n)]


def test_the_ledger_s_bound_is_each_tenant_s_pool_file_keys(make_server, tmp_path):
  """Issue 70, item 6: the ledger's bound was the sidecar's constants (64 KiB at once,
  4 KiB/s) for every tenant; a pool file's ledger_burst_bytes and ledger_bytes_per_s set
  each tenant's, named with their line where a frame passes it."""
  server = make_server(pool=write_pool(tmp_path, LEDGER_POOL))
  for token, name in ((ALICE, "alice"), (BOB, "bob")):
    directory = str(tmp_path / name / "run")
    with controller(server, token) as ctl, ctl.checkpointer(directory):
      worker = sidecar.jax.Worker(f"unix://{server.options.socket_path}", token=token)
      try:
        first = _saves(100)  # ~10 KiB: past bob's 8 KiB at once, within alice's 1 MiB
        if name == "bob":
          with pytest.raises(errors.ResourceExhaustedError,
                             match=r"tenant 'bob''s sessions append .* faster than 1024 "
                                   r"bytes/s together \(bursts of 8192; ledger_bytes_per_s="
                                   r"1024, ledger_burst_bytes=8192, \S+pool.yaml:3\).*raise a "
                                   r"tenant's ledger_bytes_per_s"):
            worker.send_ledger({"op": "goodput", "directory": directory, "events": first},
                               reply=True, wait=True)
          continue
        # alice: 8 frames of ~25 KiB (200 KiB), past the default 64 KiB at once.
        worker.send_ledger({"op": "goodput", "directory": directory, "events": first},
                           reply=True, wait=True)
        life = first[0]["life"]
        for i in range(8):
          more = [goodput.Event("save", life, time.time(), goodput.Counters(),
                                step=1000 + 255 * i + s).to_dict() for s in range(255)]
          worker.send_ledger({"op": "goodput", "events": more}, reply=True, wait=True)
        assert os.path.getsize(goodput.path_in(os.path.realpath(directory))) > 128 << 10
      finally:
        worker.close()


def _report_stall(server, token: str, *, since_s: float = 5.0) -> int:
  """``sidecar launch``'s Stalled report (tools/watchdog.py) with ``token``: how many
  ledgers the sidecar marked."""
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
    rpc = channel.unary_unary(f"/{protocol.SERVICE}/Stalled",
                              request_serializer=pb.StalledRequest.SerializeToString,
                              response_deserializer=pb.StalledResponse.FromString)
    return rpc(pb.StalledRequest(rank=1, restart=-1, since_step_s=since_s), timeout=10,
               metadata=((protocol.AUTH_KEY, f"Bearer {token}"),)).marked


def test_a_stall_report_marks_only_the_caller_s_own_tenant_s_ledger(make_server, tmp_path):
  """Issue 69: the launcher's Stalled report marks process 0's ledger; with a pool, bob's
  token marks none of alice's, and a malformed report is refused, typed."""
  server = make_server(pool=write_pool(tmp_path, POOL))
  with controller(server, ALICE, attach=True) as ctl, ctl.checkpointer(
      str(tmp_path / "alice" / "a")) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30)
    assert _report_stall(server, BOB) == 0
    assert _report_stall(server, ALICE) == 1
    with pytest.raises(grpc.RpcError) as e:
      _report_stall(server, ALICE, since_s=float("nan"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "since_step_s must be finite seconds" in e.value.details()
