"""Two real ``sidecar serve`` processes, the second given a socket the first serves (issue 35
item 13): before server/sockets.py, the second took the path over silently and removed it when
it exited, so Workers could no longer attach to the first and controllers fell back to gRPC.
"""

import os
import signal
import subprocess
import sys

import pytest

import sidecar
from tests.conftest import eventually
from tests.support.paths import ROOT

pytestmark = pytest.mark.processes


def _env() -> dict[str, str]:
  return dict({k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")},
              PYTHONPATH=str(ROOT))


def _serve_args(listen: str, socket_path: str) -> list[str]:
  return [sys.executable, "-m", "sidecar", "serve", "--listen", listen, "--socket", socket_path,
          "--shm-size", "8MiB", "--import", "tests.support.sidecar_fns"]


@pytest.mark.parametrize("taken", ["--socket", "--listen"], ids=["worker-socket", "grpc-socket"])
def test_a_second_serve_given_a_live_sidecars_socket_exits_naming_its_pid(tmp_path, taken):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  grpc_path, worker_path = f"{tmp_path}/a/g.sock", f"{tmp_path}/a/w.sock"
  ready = tmp_path / "ready.json"
  first = subprocess.Popen([*_serve_args(f"unix:{grpc_path}", worker_path),
                            "--ready-file", str(ready)], env=_env(), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    assert eventually(lambda: ready.exists() or first.poll() is not None, timeout=60)
    assert first.poll() is None, first.stdout.read()[-2000:]
    second_args = (_serve_args(f"unix:{tmp_path}/b/g.sock", worker_path) if taken == "--socket"
                   else _serve_args(f"unix:{grpc_path}", f"{tmp_path}/b/w.sock"))
    second = subprocess.run(second_args, env=_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert second.returncode != 0
    assert f"a live process (pid {first.pid}, another sidecar?) serves it" in second.stderr, (
        second.stderr[-2000:])
    assert f"give {taken}" in second.stderr
    # The first serves on, both sockets its own: a Worker attaches, a call goes through it.
    assert os.path.exists(grpc_path) and os.path.exists(worker_path)
    with sidecar.jax.Worker(worker_path) as w:
      assert w.session
    with sidecar.jax.Controller([f"unix:{grpc_path}"]) as ctl:
      assert ctl.call("add", args=(1,), kwargs={"b": 2}) == [3]
      assert ctl.worker(0) is not None  # over the worker socket, not gRPC's fallback
  finally:
    first.send_signal(signal.SIGTERM)
    out = first.communicate(timeout=30)[0]
  assert first.returncode == 0, out[-2000:]
