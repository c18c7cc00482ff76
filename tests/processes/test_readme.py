"""The README's quick start, run as written: its two code blocks, as the files they name."""

import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.processes



def quick_start() -> dict[str, str]:
  """{relative path: source} of the python blocks under "In five minutes", each named by
  its first line's comment (``# my_pkg/sidecar_fns.py: ...``)."""
  text = (ROOT / "README.md").read_text()
  section = text.split("## In five minutes", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  return {re.match(r"# (\S+\.py):", b).group(1): b for b in blocks}


def test_the_quick_start_runs_as_written_and_a_rerun_resumes(tmp_path):
  files = quick_start()
  assert sorted(files) == ["my_pkg/sidecar_fns.py", "train.py"]
  for name, source in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(source)
  (tmp_path / "my_pkg" / "__init__.py").write_text("")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user's shell
  env["PYTHONPATH"] = ""
  outputs = []
  for _ in range(2):
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    outputs.append(done.stdout)
  assert "trained steps 0-99; saved steps [49, 74, 99]" in outputs[0], outputs[0]
  assert "trained steps 100-199; saved steps [149, 174, 199]" in outputs[1], outputs[1]
  assert "-1.34164079" in outputs[0]  # normalize ran on the sidecars
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["149", "174", "199"]
