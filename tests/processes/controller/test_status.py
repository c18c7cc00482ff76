"""sidecar status --json and --watch against a LocalCluster with a feed running."""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.tools import cli

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="16MiB",
                                    imports=["tests.support.feed_fns"]) as c:
    yield c


@pytest.fixture
def feed(cluster):
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
  with cluster.controller() as ctl, ctl.feed("ids", global_batch_size=4, sharding=sharding) as f:
    for _ in range(3):
      next(f)
    yield f


def test_json_is_one_object_with_every_host(cluster, feed, capsys):
  assert cli.main(["status", "--json", *cluster.addresses, "127.0.0.1:1", "--timeout", "1"]) == 1
  doc = json.loads(capsys.readouterr().out)
  ok, down = doc["hosts"][:2], doc["hosts"][2]
  assert [h["identity"]["host_id"] for h in ok] == [0, 1]
  for h, address in zip(ok, cluster.addresses):
    assert h["ok"] and h["address"] == address
    assert h["arena_size"] == 16 << 20 and isinstance(h["arena_used"], int)
    assert h["workers"] == 1 and h["identity"]["process_index"] is None
    (f,) = h["feeds"]
    assert f["pipeline"] == "ids" and f["batches"] >= 3 and f["trainer_wait_s"] >= 0
    assert {"name": "ids", "kind": "pipeline"} in [
        {"name": e["name"], "kind": e["kind"]} for e in h["registry"]]
  assert down["address"] == "127.0.0.1:1" and not down["ok"] and down["error"]


def test_watch_refreshes_until_ctrl_c_then_exits_0(cluster, feed):
  p = subprocess.Popen([sys.executable, "-m", "sidecar", "status", "--watch", "--interval", "0.2",
                        *cluster.addresses], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  try:
    seen, out = 0, []
    deadline = time.monotonic() + 60
    while seen < 3 and time.monotonic() < deadline:
      line = p.stdout.readline()
      if not line:
        break
      out.append(line)
      seen += line.startswith("sidecar status")
      next(feed)  # the feed moves between refreshes
    assert seen == 3, "".join(out) + p.stderr.read()
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=30)
  finally:
    p.kill()
    p.wait()
  text = "".join(out) + rest
  assert p.returncode == 0, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert "BATCHES/S" in text and "TRAINER WAIT MS" in text
  assert sum(" ids " in line for line in text.splitlines()) >= 4  # 2 hosts, refreshed
  assert "\x1b[" not in text  # no screen clearing when stdout is not a terminal


def test_watch_and_json_are_exclusive_and_interval_positive(capsys):
  for argv, match in ((["--watch", "--json"], "--watch and --json"),
                      (["--watch", "--interval", "0"], "--interval must be a positive")):
    with pytest.raises(SystemExit):
      cli.main(["status", *argv, "127.0.0.1:1"])
    assert match in capsys.readouterr().err
