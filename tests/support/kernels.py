"""Real Jupyter kernels beside ``sidecar local``, as a user runs them: for the notebook
tests and ``benchmarks/notebook.py``."""

import os
import re
import subprocess
import sys
import time

import jupyter_client

from tests.support.paths import ROOT


def kernel_env(devices: int) -> dict[str, str]:
  """The environment of a kernel (or notebook) on ``devices`` CPU devices."""
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

    for _ in range(3):
      reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
      # "aborted": the kernel never ran it. After a cell that failed (an interrupted one),
      # ipykernel aborts the requests that reach it until its stop_on_error timer has run,
      # which under load can be later than our next cell: send it again.
      if reply["content"]["status"] != "aborted":
        break
      time.sleep(0.2)
    if reply["content"]["status"] != "ok":
      raise AssertionError(f"cell failed: {reply['content']['status']} "
                           f"{reply['content'].get('ename')}\n" + "".join(out))
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
