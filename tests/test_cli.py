import logging
import os
import subprocess
import sys

import pytest

import sidecar
from sidecar._src import cli

FNS = ["tests.sidecar_fns"]


@pytest.fixture(autouse=True)
def restore_logging():
  """cli.main() points the root logger at this test's captured stderr: undo that after."""
  root = logging.getLogger()
  handlers, level = root.handlers[:], root.level
  yield
  root.handlers[:] = handlers
  root.setLevel(level)


def test_status_table(capsys):
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="8MiB",
                                    imports=FNS) as c:
    assert cli.main(["status", *c.addresses]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["ADDRESS", "HOST", "SLICE"]
    assert c.addresses[1] in lines[2] and " 2,3 " in lines[2]
    assert "0 B/8.0 MiB" in lines[1] and "echo (function)" in lines[1]
    assert cli.main(["status", c.addresses[0], "127.0.0.1:1", "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def test_serve_rejects_bad_flags_and_too_big_arenas(tmp_path):
  run = lambda *a: subprocess.run([sys.executable, "-m", "sidecar", "serve", *a],
                                  capture_output=True, text=True, timeout=60)
  p = run("--shm-size", "12 parsecs")
  assert p.returncode == 2 and "cannot parse size '12 parsecs'" in p.stderr
  p = run("--shm-size", "64TiB", "--socket", str(tmp_path / "s.sock"), "--port", "0",
          "--health-port", "0", "--listen", "127.0.0.1")
  assert p.returncode == 2 and "lower --shm-size" in p.stderr
  p = run("--host-id", "-4", "--socket", str(tmp_path / "s.sock"))
  assert p.returncode == 2 and "host_id must be a non-negative int, got -4" in p.stderr


def test_serve_loads_plugins_from_entry_points(tmp_path, monkeypatch):
  dist = tmp_path / "myplugin-1.0.dist-info"
  dist.mkdir()
  (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 1.0\n")
  (dist / "entry_points.txt").write_text("[sidecar.plugins]\nmine = myplugin_fns\n")
  (tmp_path / "myplugin_fns.py").write_text(
      "import sidecar\n@sidecar.function(name='from_plugin')\ndef f():\n  return 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  reg = sidecar.Registry()
  previous = sidecar.set_default_registry(reg)
  try:
    cli.load_user_code([])
  finally:
    sidecar.set_default_registry(previous)
  assert reg.names("function") == ["from_plugin"]


def test_demo_runs(tmp_path):
  env = dict(os.environ, SIDECAR_LOG_LEVEL="WARNING")
  p = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--steps", "100"],
                     capture_output=True, text=True,
                     timeout=300, env=env)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "test accuracy" in p.stdout and "trainer waited for data" in p.stdout
  accuracy = float(p.stdout.split("test accuracy ")[1].split("%")[0])
  assert accuracy > 50  # a model that learned from the fed digits, not chance (10%)
  assert "no shared memory left behind" in p.stdout


def test_status_shows_running_feeds(capsys):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=1, shm_size="8MiB",
                                    imports=["tests.feed_fns"]) as c, c.controller() as ctl:
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
    with ctl.feed("ids", global_batch_size=4, sharding=sharding) as feed:
      for _ in range(5):
        next(feed)
      assert cli.main(["status", *c.addresses]) == 0
    out = capsys.readouterr().out
  feeds = out.split("PIPELINE", 1)[1].split("\n\n")[0].strip().splitlines()[1:]
  assert len(feeds) == 2 and all(" ids " in f for f in feeds)
  assert all(int(f.split()[3]) >= 5 for f in feeds)  # batches made so far, prefetch included
