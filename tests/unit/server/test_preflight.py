import pytest

from sidecar._src.core import options as options_lib
from sidecar._src.server import preflight

pytestmark = pytest.mark.unit


def opts(tmp_path, **kw):
  kw.setdefault("socket_path", str(tmp_path / "run" / "sidecar.sock"))
  kw.setdefault("checkpoint_roots", (str(tmp_path / "ckpt"),))
  return options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0, shm_size=1 << 20,
                                   **kw)


def test_directories_that_can_be_made_pass(tmp_path):
  preflight.check(opts(tmp_path))  # neither exists yet: the sidecar makes them
  assert not (tmp_path / "run").exists()  # a check, not a side effect


def test_a_socket_directory_that_is_a_file_names_the_flag_and_the_mount(tmp_path):
  (tmp_path / "run").write_text("")
  with pytest.raises(NotADirectoryError, match=r"worker socket .*run/sidecar.sock: .*run is "
                     r"not a directory\. Mount a writable volume at .*run, shared with the "
                     r"trainer .*--socket or \$SIDECAR_SOCKET a path in a writable directory"):
    preflight.check(opts(tmp_path))


def test_a_checkpoint_root_under_a_file_names_the_flag_and_the_fix(tmp_path):
  (tmp_path / "ckpt").write_text("")
  with pytest.raises(NotADirectoryError, match=r"checkpoint root .*ckpt/run1 \(--checkpoint-"
                     r"root, \$SIDECAR_CHECKPOINT_ROOTS\) cannot take checkpoints: .*ckpt is "
                     r"not a directory\. Mount the checkpoint volume there read-write"):
    preflight.check(opts(tmp_path, checkpoint_roots=(str(tmp_path / "ckpt" / "run1"),)))

