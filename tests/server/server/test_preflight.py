import pytest

from sidecar._src.core import options as options_lib
from sidecar._src.server.server import Server
from sidecar._src.user import registry as registry_lib

pytestmark = pytest.mark.server


def server(tmp_path, **kw):
  kw.setdefault("socket_path", str(tmp_path / "run" / "s.sock"))
  kw.setdefault("checkpoint_roots", (str(tmp_path / "ckpt"),))
  return Server(options_lib.ServerOptions(listen="127.0.0.1", port=0, health_port=0,
                                      shm_size=8 << 20, **kw), registry=registry_lib.Registry())


def test_a_socket_directory_that_cannot_be_made_stops_the_start_before_the_arena(tmp_path):
  (tmp_path / "run").write_text("")  # where the socket volume should be mounted
  s = server(tmp_path)
  with pytest.raises(NotADirectoryError, match=r"Mount a writable volume at .*run, shared "
                     r"with the trainer"):
    s.start()
  assert not hasattr(s, "arena")  # checked first: a large arena takes seconds to pre-fault
  s.stop()


def test_a_checkpoint_root_that_cannot_take_checkpoints_stops_the_start(tmp_path):
  (tmp_path / "ckpt").write_text("")
  s = server(tmp_path)
  with pytest.raises(NotADirectoryError, match=r"checkpoint root .*ckpt \(--checkpoint-root, "
                     r"\$SIDECAR_CHECKPOINT_ROOTS\) cannot take checkpoints"):
    s.start()
  assert not (tmp_path / "run").exists()  # nothing made, nothing listening
  s.stop()


def test_roots_and_socket_directories_still_to_be_made_are_fine(tmp_path):
  s = server(tmp_path, checkpoint_roots=(str(tmp_path / "not" / "yet"),))
  try:
    s.start()
    assert (tmp_path / "run" / "s.sock").exists()
  finally:
    s.stop()
