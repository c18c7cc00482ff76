"""Real Jupyter kernels: the quick-start notebook runs, and a scripted session survives a
kernel restart with its training state in the sidecars' RAM tier.

The sidecars of the session are ``sidecar local``, started outside the kernel as a
user would in a terminal; the kernel connects a Controller, trains, is interrupted
mid-feed, saves, restarts, and restores from the RAM tier with the step's chunk files
on disk destroyed.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jupyter_client
import nbclient
import nbformat
import pytest

from tests.conftest import alive
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes



def kernel_env(devices: int) -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def start_local(*args: str) -> tuple[subprocess.Popen, list[str]]:
  """``sidecar local --hosts 2 ARGS``, outside any kernel as from a terminal, and the
  addresses it prints once its sidecars serve (stop it with SIGINT)."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "sidecar", "local", "--hosts", "2", "--devices-per-host", "1",
       *args], cwd=ROOT, env=kernel_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  addresses = []
  for line in proc.stdout:  # type: ignore[union-attr]
    m = re.match(r"host \d+: (\S+)", line)
    if m:
      addresses.append(m.group(1))
    if line.startswith("Ctrl-C to stop"):
      break
  return proc, addresses


def test_quickstart_notebook_runs(tmp_path):
  nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "examples/quickstart.ipynb must be committed with its outputs cleared"
  env = kernel_env(4)
  env["TMPDIR"] = str(tmp_path)  # the notebook's checkpoint directory, which it removes
  client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT / "examples")}})
  os.environ.update({k: env[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS")})
  client.execute(env=env)
  text = "\n".join(o.get("text", "") + json.dumps(o.get("data", {}))
                   for c in nb.cells for o in c.get("outputs", []))
  assert "restores as saved: True" in text
  assert "from ram:host0" in text and "storage" not in text.split("restored step")[1][:200]
  assert "sidecar.Controller" in text and "<table>" in text  # the rich display rendered
  assert not list(tmp_path.glob("quickstart-*"))  # before: each run left its checkpoints


class Kernel:
  """One kernel and its client; ``run`` executes a cell and returns its stdout."""

  def __init__(self, env: dict[str, str]):
    self.km = jupyter_client.KernelManager(kernel_name="python3")
    self.km.start_kernel(env=env, cwd=str(ROOT))
    self._connect()

  def _connect(self) -> None:
    self.kc = self.km.client()
    self.kc.start_channels()
    self.kc.wait_for_ready(timeout=60)

  def run(self, code: str, timeout: float = 60) -> str:
    out: list[str] = []

    def hook(msg):
      if msg["msg_type"] == "stream":
        out.append(msg["content"]["text"])
      elif msg["msg_type"] == "error":
        out.append("\n".join(msg["content"]["traceback"]))

    reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
      raise AssertionError(f"cell failed: {reply['content'].get('ename')}\n" + "".join(out))
    return "".join(out)

  def start(self, code: str) -> str:
    return self.kc.execute(code)

  def reply(self, msg_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      msg = self.kc.get_shell_msg(timeout=timeout)
      if msg["parent_header"].get("msg_id") == msg_id:
        return msg["content"]
    raise AssertionError("no reply")

  def restart(self) -> None:
    self.kc.stop_channels()
    self.km.restart_kernel(now=True)
    self._connect()

  def shutdown(self) -> None:
    self.kc.stop_channels()
    self.km.shutdown_kernel(now=True)


@pytest.fixture
def sidecars(tmp_path):
  """``sidecar local --hosts 2``, outside any kernel, as from a terminal."""
  proc, addresses = start_local("--shm-size", "64MiB", "--import", "tests.support.notebook_fns")
  assert len(addresses) == 2, "sidecar local did not start"
  yield addresses
  proc.send_signal(signal.SIGINT)
  assert proc.wait(30) == 0
  proc.stdout.close()


SETUP = """
import json
import jax, numpy as np, sidecar
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
ctl = sidecar.Controller({addresses!r})
sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), P("d"))
ckpt = ctl.checkpointer({directory!r})
kwargs = dict(global_batch_size=8, sharding=sh)
"""


def test_kernel_interrupt_restart_and_restore_from_ram(sidecars, tmp_path):
  directory = str(tmp_path / "ckpt")
  kernel = Kernel(kernel_env(2))
  pids = []
  try:
    pids.append(int(kernel.run("import os; print(os.getpid())")))
    kernel.run(SETUP.format(addresses=sidecars, directory=directory))
    # A cell stopped mid-feed (the sidecars are slow: 0.05 s a row).
    msg = kernel.start("feed = ctl.feed('slow_rows', kwargs={'width': 256, 'seconds': 0.05},"
                       " **kwargs)\n"
                       "for batch in feed:\n  pass\n")
    time.sleep(3)
    kernel.km.interrupt_kernel()
    assert kernel.reply(msg)["ename"] == "KeyboardInterrupt"
    # And a cell stopped in a call (Ctrl-C taken at a safe point of the controller's).
    msg = kernel.start("ctl.call('slow_block', args=(1 << 20, 3.0))")
    time.sleep(1)
    kernel.km.interrupt_kernel()
    assert kernel.reply(msg)["ename"] == "KeyboardInterrupt"
    # The next cells work: the feed goes on, a save commits.
    out = kernel.run(
        "batch = next(feed)\n"
        "state = {'w': jax.device_put(np.arange(2 * 1024 * 256, dtype=np.float32).reshape(2048, 256), sh),\n"
        "         'b': batch['x']}\n"
        "ckpt.save(7, state, data_state=feed.state()); ckpt.wait()\n"
        "after = np.asarray(next(feed)['x'])\n"
        "print(json.dumps({'steps': ckpt.all_steps(), 'sum_b': float(np.asarray(state['b']).sum()),\n"
        "                  'after': float(after.sum())}))")
    before = json.loads(out.strip().splitlines()[-1])
    assert before["steps"] == [7]
    kernel.restart()
    pids.append(int(kernel.run("import os; print(os.getpid())")))
    # The sidecars still hold the step, as `sidecar status` shows from a terminal.
    status = subprocess.run([sys.executable, "-m", "sidecar", "status", *sidecars], cwd=ROOT,
                            env=kernel_env(2), capture_output=True, text=True, timeout=60)
    assert status.stdout.count(f"{directory}  RAM tier: [7]") == 2, status.stdout
    # Storage is gone: only the RAM tier can give the step back.
    chunks = [p for p in (tmp_path / "ckpt" / "7").rglob("*")
              if p.is_file() and re.fullmatch(r"\d+(\.\d+)*", p.name)]
    assert chunks
    for p in chunks:
      p.write_bytes(b"corrupt")
    out = kernel.run(
        SETUP.format(addresses=sidecars, directory=directory)
        + "target = {'w': jax.ShapeDtypeStruct((2048, 256), np.float32, sharding=sh),\n"
          "          'b': jax.ShapeDtypeStruct((8, 256), np.float32, sharding=sh)}\n"
          "got = ckpt.restore(target=target)\n"
          "stats = ckpt.last_restore_stats()\n"
          "feed = ctl.feed('slow_rows', kwargs={'width': 256}, state=ckpt.data_state(),"
          " **kwargs)\n"
          "print(json.dumps({'steps': ckpt.all_steps(), 'sources': sorted(stats.shards),\n"
          "  'w_exact': bool((np.asarray(got['w']) == np.arange(2 * 1024 * 256, dtype=np.float32)"
          ".reshape(2048, 256)).all()),\n"
          "  'sum_b': float(np.asarray(got['b']).sum()), 'after': float(np.asarray(next(feed)['x']).sum())}))\n"
          "from sidecar._src.controller import progress\n"
          "print(json.dumps({'in_notebook': progress.in_notebook()}))\n"
          "feed.close(); ctl.close()")
    *_, result, notebook = out.strip().splitlines()
    assert json.loads(notebook) == {"in_notebook": True}  # where progress bars go
    after = json.loads(result)
    assert after["steps"] == [7]
    assert after["sources"] == ["ram:host0", "ram:host1"]  # nothing from storage
    assert after["w_exact"] and after["sum_b"] == before["sum_b"]
    assert after["after"] == before["after"]  # the feed resumed where it was saved
  finally:
    kernel.shutdown()
  assert not any(alive(p) for p in pids)
