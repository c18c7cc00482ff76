import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes


def serve(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "sidecar", "serve", "--port", "0",
                         "--health-port", "0", "--listen", "127.0.0.1", "--shm-size", "8MiB",
                         *args], capture_output=True, text=True, timeout=60)


def test_a_missing_socket_volume_is_named_before_the_user_code_is_imported(tmp_path):
  # In a container the user's modules and the server import jax, grain and gRPC for seconds;
  # the mounts are checked first (the module below would fail to import if it came first).
  (tmp_path / "run").write_text("")
  p = serve("--socket", str(tmp_path / "run" / "s.sock"), "--import", "no_such_module_here")
  assert p.returncode == 2
  assert "Mount a writable volume at" in p.stderr and "no_such_module" not in p.stderr


def test_a_checkpoint_root_that_cannot_take_checkpoints_is_named(tmp_path):
  (tmp_path / "ckpt").write_text("")
  p = serve("--socket", str(tmp_path / "s.sock"), "--checkpoint-root", str(tmp_path / "ckpt"))
  assert p.returncode == 2
  assert p.stderr.startswith(f"sidecar serve: [Errno 20] checkpoint root {tmp_path}/ckpt "
                             "(--checkpoint-root, $SIDECAR_CHECKPOINT_ROOTS) cannot take "
                             "checkpoints")


def test_an_arena_the_machine_cannot_give_is_named_before_the_user_code_is_imported(tmp_path):
  p = serve("--socket", str(tmp_path / "s.sock"), "--shm-size", "64TiB", "--import",
            "no_such_module_here")
  assert p.returncode == 2
  assert "lower --shm-size" in p.stderr and "no_such_module" not in p.stderr
