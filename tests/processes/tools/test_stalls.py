"""The sidecar's stall signal (server/goodput/steps.py) seen from outside: ``Status.trainers``,
``/metrics`` and ``sidecar stalls`` (the k8s trainer container's liveness probe), for a
trainer that trained and then hung (tests/support/goodput_train.py --hang-after).
"""

import os
import signal
import subprocess
import sys

import pytest

import sidecar
from sidecar._src.controller import status as status_lib
from sidecar._src.core import accounting, goodput
from tests.conftest import eventually
from tests.support.metrics import samples, scrape, total
from tests.support.paths import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]
FLOOR_S = 3


def _stalls(address: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "sidecar", "stalls", address], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)


def test_a_hung_trainer_is_stalled_in_status_metrics_and_sidecar_stalls(tmp_path):
  directory = str(tmp_path / "ckpt")
  with sidecar.testing.LocalCluster(1, 1, shm_size="32MiB", imports=["tests.support.feed_fns"],
                                    configure_jax=False, metrics=True,
                                    extra_args=("--stall-timeout", str(FLOOR_S))) as cluster:
    address = cluster.addresses[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT),
               SIDECAR_PROCESS_ID="0", SIDECAR_RESTART="0")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.goodput_train", address, directory, "20",
         "0.05", "--hang-after", "7"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
      for line in trainer.stdout:  # until it hangs
        if '"hanging"' in line:
          break
      # Training, it was not stalled (nor is it the moment it stops)...
      [t] = status_lib.fetch(address, timeout=10).trainers
      assert (t.pid, t.pid_verified, t.rank, t.restart) == (trainer.pid, True, 0, 0)
      assert t.steps > 0
      assert not t.stalled and t.stall_timeout_s >= FLOOR_S
      # ... and is, once it made no step for its timeout.
      assert eventually(lambda: _stalls(address).returncode == 1, timeout=90)
      said = _stalls(address).stdout
      assert "host 0 rank 0 stalled: no step for" in said and f"pid {trainer.pid}" in said
      [t] = status_lib.fetch(address, timeout=10).trainers
      assert t.stalled and t.since_step_s > t.stall_timeout_s
      scraped = samples(scrape(cluster.metrics_urls[0]))
      key = {"tenant": "", "rank": "0"}  # and an opaque id of its pid, never the pid
      assert total(scraped, "sidecar_trainer_stalled", **key) == 1
      assert total(scraped, "sidecar_trainer_seconds_since_step", **key) > FLOOR_S
    finally:
      trainer.send_signal(signal.SIGKILL)
      trainer.wait(timeout=30)
      trainer.stdout.close()
    # Nothing of it outlives its kill: its session and its feed end with its socket (the
    # suite allows 5 s on a loaded machine; benchmarks.launch_restarts measures it).
    def gone():
      status = status_lib.fetch(address, timeout=10)
      return all(t.ended for t in status.trainers) and not status.feeds and not status.workers
    assert eventually(gone, timeout=5)
    # Its death is a stalled one in the ledger; the session is listed as ended a while.
    assert eventually(lambda: goodput.read(directory)[-1].kind == "died", timeout=10)
    died = goodput.read(directory)[-1]
    assert died.stalled is not None and died.seen > died.stalled
    assert accounting.account(goodput.read(directory)).badput_s["stall"] >= FLOOR_S
    [t] = status_lib.fetch(address, timeout=10).trainers
    assert t.ended
    assert _stalls(address).returncode == 0
