"""Isolation, round 7, items 5-7 (issue 70): what a pool tenant holds beyond its call. One
pool sidecar in its own process, tenants alice and bob, public API only (bob's ledger frames
through his own Worker, as a hostile client would send them).

Before: bob, whose functions allowlist holds only ``total``, ran the operator's function by
naming it in ``arrayrecord``'s ``parse=`` (it returned a secret of the sidecar's
environment); one worker session per ledger frame wrote megabytes a second past the
ledger's bound; and an unauthenticated ``/metrics`` named alice's project directory.
Items 4 and 8 are in tests/unit/server/pool/test_admission.py and
tests/processes/tools/test_launch_standby.py.
"""

import os
import pathlib
import shutil
import tempfile
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from pipelines import arrayrecord as ar
from sidecar._src.core import goodput
from tests.support.metrics import samples, scrape
from tests.support.pool_files import ALICE, BOB, write_pool
from tests.support.resource_fns import SECRET_ENV

pytestmark = pytest.mark.processes

POOL = """\
tenants:
  - {name: alice, token_file: alice.token, checkpoint_roots: [alice]}
  - {name: bob, token_file: bob.token, checkpoint_roots: [bob], functions: [total]}
"""
SECRET = "the-operator-s-secret"


@pytest.fixture(scope="module")
def pool():
  base = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-resources-"))
  try:
    path = write_pool(base, POOL)
    ar.write_arrayrecord(base / "bob" / "records.array_record",
                         [{"x": np.int64(i)} for i in range(8)])
    with sidecar.testing.LocalCluster(
        1, 1, shm_size="32MiB", pool=path, checkpoint_roots=[str(base)], metrics=True,
        host_env={0: {SECRET_ENV: SECRET}},
        imports=["pipelines.arrayrecord", "tests.support.resource_fns"]) as cluster:
      yield cluster, str(base)
  finally:
    shutil.rmtree(base, ignore_errors=True)


def _feed(ctl, kwargs, *, workers):
  rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  with ctl.feed("arrayrecord", global_batch_size=2, sharding=rows, kwargs=kwargs,
                options=sidecar.FeedOptions(workers=workers)) as feed:
    return next(feed)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-sidecar", "worker-processes"])
def test_a_pipeline_argument_reaches_no_function_outside_the_allowlist(pool, workers):
  cluster, base = pool
  records = os.path.join(base, "bob", "records.array_record")
  with cluster.controller(token=BOB) as bob:
    with pytest.raises(sidecar.PermissionDeniedError,
                       match=r"tenant 'bob' may not run function 'operator_secret', named in a "
                       r"pipeline's arguments: its functions allowlist \(.*pool.yaml:3\) "
                       r"holds total"):
      _feed(bob, {"paths": records, "parse": "operator_secret"}, workers=workers)
    # What his allowlist holds, he may name.
    batch = _feed(bob, {"paths": records, "parse": "total"}, workers=workers)
    assert np.asarray(batch["size"]).tolist() == [len(ar.encode_example({"x": np.int64(0)}))] * 2


def test_a_session_per_frame_does_not_pass_the_ledger_s_bound(pool):
  cluster, base = pool
  directory = os.path.join(base, "bob", "run")
  path = goodput.path_in(os.path.realpath(directory))
  with cluster.controller(token=BOB) as ctl, ctl.checkpointer(directory):
    before = os.path.getsize(path) if os.path.exists(path) else 0
    refused = 0
    for i in range(24):  # the attack: 170-358 sessions in 3 s
      now = time.time()
      life = f"{1000 + i}@{now:.3f}"
      events = [goodput.Event("start", life, now, goodput.Counters(), start=now, pid=i)] + [
          goodput.Event("save", life, now, goodput.Counters(), step=s) for s in range(255)]
      worker = sidecar.jax.Worker(cluster.socket(0), token=BOB)
      try:
        worker.send_ledger({"op": "goodput", "directory": directory,
                            "events": [e.to_dict() for e in events]}, reply=True, wait=True)
      except sidecar.ResourceExhaustedError as e:
        assert "tenant 'bob''s sessions append to their ledgers" in str(e)
        refused += 1
      finally:
        worker.close()
    grown = os.path.getsize(path) - before
  assert refused > 0
  # 64 KiB at once and 4 KiB/s, the sessions' ends' deaths owed: a small multiple of that,
  # where each session's own bucket let every frame through (24 x ~25 KiB).
  assert grown < 256 << 10, grown


def test_metrics_without_credentials_names_no_tenant_s_directory_nor_pid(pool):
  cluster, base = pool
  directory = os.path.join(base, "alice", "project-x")
  with cluster.controller(token=ALICE) as alice, alice.checkpointer(directory) as ck:
    ck.save(1, {"w": np.zeros(4, np.float32)}).durable.result(30)
    page = scrape(cluster.metrics_urls[0])
  found = samples(page)
  assert any(n == "sidecar_goodput_ratio" and dict(ls).get("tenant") == "alice"
             for n, ls in found)  # her ledger is there, by an opaque id
  assert "project-x" not in page and base not in page
  assert not any("pid" in dict(ls) or "directory" in dict(ls) for _, ls in found)
