"""A trainer that dies (SIGTERM, as ``sidecar launch`` stops it) while its sidecar makes a
slow batch: its session ends with every block released, and the sidecar warns of nothing
(issue 71 item 5).

Its feed's credits, sent as it took the batches that came ahead, wait unread on the
stream's connection while the producer makes the next batch; the session ends on the
attach connection, releasing every block; the producer then reads those credits, each
handing back blocks already released. Before, each such block logged ``WARNING worker
w-...: arena block at offset ... is not held by 'w-...'``, which ``sidecar launch``
prints as ``[sidecar 0] WARNING ...``.
"""

import os
import subprocess
import sys

import pytest

import sidecar
from tests.conftest import eventually
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

TRAINER = """
import os, signal, sys
import jax, numpy as np, sidecar
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
with sidecar.jax.Controller.from_env() as ctl:
  with ctl.feed("slow_after", global_batch_size=1, sharding=rows,
                options=sidecar.FeedOptions(prefetch=4)) as feed:
    for i, batch in enumerate(feed):
      del batch
      if i == int(sys.argv[1]):
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_trainer_stopped_while_its_batch_is_made_leaves_no_warning(tmp_path):
  with sidecar.testing.LocalCluster(num_hosts=1, imports=["tests.support.slow_feed"],
                                    shm_size="16MiB") as cluster:
    env = dict(os.environ, SIDECAR_HOSTS=cluster.host_entry(0), PYTHONPATH=str(ROOT),
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    for at in (5, 6, 7):  # as the producer starts the first slow batch, and during them
      done = subprocess.run([sys.executable, "-c", TRAINER, str(at)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
      assert "stopping" in done.stdout, done.stdout + done.stderr
      assert eventually(lambda at=at: cluster.log(0).count("arena blocks released") == at - 4,
                        timeout=30), cluster.log(0)
    with cluster.controller() as ctl:  # every block came back
      # (but the batches its sidecar keeps for a restart's re-done steps)
      assert eventually(lambda: (s := ctl.status()[0]).arena_used == s.arena_kept,
                        timeout=30), ctl.status()
    log = cluster.log(0)
  assert "not held by" not in log and " WARNING " not in log, log


WORKERS_TRAINER = TRAINER.replace('"slow_after"', '"slow_map"').replace(
    "prefetch=4", "prefetch=4, workers=2")


def test_a_trainer_stopped_while_feed_workers_make_its_batches_leaves_no_traceback(tmp_path):
  """The same with the feed's worker processes: a worker whose batch was in the making as
  the feed ended found its socket closed when it answered, and printed a BrokenPipeError
  traceback into the sidecar's log (``sidecar launch`` shows it as ``[sidecar 0] ...``);
  and the feed's own line (its consumer gone) came with a traceback of its own."""
  with sidecar.testing.LocalCluster(num_hosts=1, imports=["tests.support.slow_feed"],
                                    shm_size="16MiB") as cluster:
    env = dict(os.environ, SIDECAR_HOSTS=cluster.host_entry(0), PYTHONPATH=str(ROOT),
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", WORKERS_TRAINER, "6"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert "stopping" in done.stdout, done.stdout + done.stderr
    with cluster.controller() as ctl:  # the feed ended: its workers' blocks came back
      assert eventually(lambda: (s := ctl.status()[0]).arena_used == s.arena_kept,
                        timeout=30), ctl.status()
    log = cluster.log(0)
  assert "Traceback" not in log and "BrokenPipeError" not in log, log
