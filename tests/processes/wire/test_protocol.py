"""The generated code in sidecar/v1 is what protoc makes of protos/ now."""

import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes


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
