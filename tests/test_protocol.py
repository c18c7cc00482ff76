import pathlib
import subprocess
import sys

import grpc
import pytest

from sidecar._src import errors, protocol
from sidecar._src.protocol import pb

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto(tmp_path):
  subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
                  f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                  f"--grpc_python_out={tmp_path}", "sidecar/v1/sidecar.proto",
                  "sidecar/v1/checkpoint.proto"],
                 check=True, cwd=ROOT)
  for name in ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py",
               "checkpoint_pb2.py", "checkpoint_pb2.pyi", "checkpoint_pb2_grpc.py"):
    fresh = (tmp_path / "sidecar" / "v1" / name).read_text()
    committed = (ROOT / "sidecar" / "v1" / name).read_text()
    assert fresh == committed, (
        f"sidecar/v1/{name} is stale; regenerate with: python -m grpc_tools.protoc -Iprotos "
        "--python_out=. --pyi_out=. --grpc_python_out=. protos/sidecar/v1/sidecar.proto "
        "protos/sidecar/v1/checkpoint.proto")


def test_version_differences_exact_and_minor():
  ours = protocol.local_versions()
  same_minor = pb.Versions()
  same_minor.CopyFrom(ours)
  same_minor.python = ours.python.rsplit(".", 1)[0] + ".999"
  assert protocol.version_differences(ours, same_minor) == []
  other = pb.Versions(protocol=ours.protocol + 1, package="9.9", python="2.7.1",
                      numpy=ours.numpy, jax=ours.jax)
  diffs = protocol.version_differences(ours, other)
  assert [d.split(":")[0] for d in diffs] == ["protocol", "package", "python"]


@pytest.mark.parametrize("exc,code", [
    (errors.NotRegisteredError("x"), grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgumentError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.VersionMismatchError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AuthenticationError("x"), grpc.StatusCode.UNAUTHENTICATED),
    (ValueError("x"), grpc.StatusCode.UNKNOWN),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name)
def test_status_codes(exc, code):
  assert protocol.status_code(exc) == code


@pytest.mark.parametrize("text,limit,keep,expected", [
    ("short", 100, "head", "short"),
    ("a" * 200, 100, "head", "a" * 69 + " [... 131 of 200 bytes cut ...]"),
    ("a" * 150 + "END", 100, "tail", "[... 84 of 153 bytes cut ...] " + "a" * 66 + "END"),
], ids=["short", "head", "tail"])
def test_truncate_says_how_much_was_cut(text, limit, keep, expected):
  out = protocol.truncate(text, limit, keep=keep)
  assert out == expected and len(out.encode()) <= limit


def test_truncate_never_splits_a_character():
  out = protocol.truncate("€" * 1000, 100)
  assert out.startswith("€" * 20) and len(out.encode()) <= 100


def test_error_info_cuts_long_messages_and_keeps_the_frames():
  def deep(n):
    if n == 0:
      raise ValueError("m" * 100_000)
    deep(n - 1)

  with pytest.raises(ValueError) as info:
    deep(3)
  e = protocol.error_info(info.value)
  assert len(e.message.encode()) <= protocol.MAX_ERROR_MESSAGE and "bytes cut" in e.message
  assert len(e.traceback.encode()) <= protocol.MAX_ERROR_TRACEBACK
  assert e.traceback.count("in deep") == 4  # every frame, though the last line was cut
