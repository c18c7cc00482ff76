"""The goodput ledger end to end: a trainer SIGKILLed after a save, a second one
started beside the same sidecar, then ``sidecar goodput CKPT_DIR``.

The trainer (tests/support/goodput_train.py) uses only ctl.feed and ctl.checkpointer; each
of its steps sleeps STEP_S, which gives the lower bounds the ledger must show.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import sidecar
from sidecar._src.core import accounting, goodput
from tests.conftest import eventually
from tests.support.metrics import samples, scrape, value
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes

STEPS, STEP_S, HANG_AFTER = 20, 0.05, 12  # saves at 5, 10, 15, 20 (goodput_train.SAVE_EVERY)


def trainer(address, directory, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
  return subprocess.Popen(
      [sys.executable, "-m", "tests.support.goodput_train", address, directory, str(STEPS),
       str(STEP_S), *extra], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def results(lines):
  return [json.loads(x[len("RESULT "):]) for x in lines if x.startswith("RESULT ")]


def test_a_killed_and_restarted_trainer_adds_up(tmp_path):
  directory = str(tmp_path / "ckpt")
  with sidecar.testing.LocalCluster(1, 1, shm_size="32MiB", imports=["tests.support.feed_fns"],
                                    configure_jax=False, metrics=True) as cluster:
    address = cluster.addresses[0]
    first = trainer(address, directory, "--hang-after", str(HANG_AFTER))
    seen = []
    for line in first.stdout:  # until it has saved step 10 (durable) and done step 12
      seen.append(line)
      if '"hanging"' in line:
        break
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    first.stdout.close()
    assert {"kind": "saved", "step": 10} in results(seen)
    # The sidecar writes the death when the session's socket ends.
    assert eventually(lambda: goodput.read(directory)[-1].kind == "died", timeout=10)
    died = goodput.read(directory)[-1]
    # Heard from last (its feed's credits, its frames) before its session ended.
    assert died.seen is not None and died.seen <= died.t
    time.sleep(0.2)  # a restart gap that no rounding hides
    second = trainer(address, directory)
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out
    done = results(out.splitlines())
    assert {"kind": "restored", "step": 10} in done and done[-1]["kind"] == "done"

    scraped = samples(scrape(cluster.metrics_urls[0]))
  plot = tmp_path / "timeline.png"
  cli = subprocess.run(
      [sys.executable, "-m", "sidecar", "goodput", directory, "--json", "--plot", str(plot)],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert cli.returncode == 0, cli.stderr
  ledger = json.loads(cli.stdout)
  badput = ledger["badput_s"]
  assert set(badput) == set(accounting.CATEGORIES)
  assert ledger["productive_s"] + sum(badput.values()) == pytest.approx(ledger["wall_s"],
                                                                        rel=0.01)
  assert ledger["restarts"] == 1
  assert badput["restart_gap"] > 0
  # Steps 11 and 12 of the killed trainer came after save(10): thrown away, re-done
  # up to the last batch it took (11's at least), the rest (12, its hang, its exit, the
  # 0.2 s) restart gap: the death counts from the last sign of life.
  assert badput["redone"] >= STEP_S
  assert badput["redone"] + badput["restart_gap"] >= 2 * STEP_S + 0.2
  # The steps kept: 2..10 of the first life, 12..20 of the second (each life's first
  # step is its startup's), each sleeping STEP_S.
  assert ledger["productive_s"] >= 18 * STEP_S
  assert badput["restore"] > 0 and badput["checkpoint"] > 0 and badput["startup"] > 0
  assert ledger["goodput"] == pytest.approx(ledger["productive_s"] / ledger["wall_s"])
  assert plot.stat().st_size > 0
  # /metrics carries the same ledger (as the sidecar last accounted it), labelled.
  # Its one ledger, by an opaque id: the directory is never a label (issue 70, item 7).
  [ledger_id] = {dict(ls)["ledger"] for n, ls in scraped if n == "sidecar_goodput_ratio"}
  job = {"tenant": "", "ledger": ledger_id}
  assert value(scraped, "sidecar_goodput_restarts", **job) == 1
  assert value(scraped, "sidecar_goodput_ratio", **job) == pytest.approx(ledger["goodput"],
                                                                         rel=0.01)
  assert value(scraped, "sidecar_goodput_badput_seconds", category="redone",
               **job) == pytest.approx(badput["redone"], rel=0.01)
  # The ledger's file is no step to Orbax's listing.
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(directory) as manager:
    assert manager.all_steps() == [15, 20]


def test_no_ledger_is_exit_status_1_naming_the_file(tmp_path):
  cli = subprocess.run([sys.executable, "-m", "sidecar", "goodput", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert cli.returncode == 1
  assert f"no ledger in {tmp_path} ({goodput.FILE})" in cli.stderr
