"""The README's quick start, run as written: its two code blocks, as the files they name; and
the example trainers that docs/multiprocess.md and docs/elastic.md show, as those files."""

import os
import re
import subprocess
import sys

import pytest

from tests.support import readme
from tests.support.paths import ROOT, entries

pytestmark = pytest.mark.processes



def test_the_quick_start_runs_as_written_and_a_rerun_resumes(tmp_path):
  files = readme.quick_start()
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
  readme.check_two_runs(outputs, tmp_path)


def _block(doc: str, path: str) -> str:
  """The python block of ``doc`` (a page under the root) whose first line names ``path``."""
  text = (ROOT / doc).read_text()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if b.startswith(f"# {path}:")]
  assert len(blocks) == 1, f"{doc} has no block naming {path}"
  return blocks[0]


def _copy_examples(tmp_path, *names: str):
  """The example files, as a user who runs them from examples/ has them."""
  work = tmp_path / "examples"
  work.mkdir()
  for name in ("quickstart_fns.py", *names):
    (work / name).write_text((ROOT / "examples" / name).read_text())
  return work


@pytest.mark.timeout(600)  # two launches of 2 trainers and 2 sidecars, on a busy machine
def test_the_multiprocess_trainer_is_the_docs_and_resumes_under_sidecar_launch(tmp_path):
  source = (ROOT / "examples" / "train_multiprocess.py").read_text()
  assert _block("docs/multiprocess.md", "examples/train_multiprocess.py") == source
  work = _copy_examples(tmp_path, "train_multiprocess.py")
  (tmp_path / "tmp").mkdir()
  ckpt = tmp_path / "ckpt"  # neither the temp directory nor the working one: a root is needed
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHONPATH="", TMPDIR=str(tmp_path / "tmp"))
  command = [sys.executable, "-m", "sidecar", "launch", "--hosts", "2", "--devices-per-host",
             "2", "--import", "quickstart_fns", "--checkpoint-root", str(ckpt), "--",
             sys.executable, "train_multiprocess.py", str(ckpt / "run1")]
  outputs = []
  for _ in range(2):
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    outputs.append(done.stdout)
  assert "[host 0] 2 process(es): trained steps 0-99; saved steps [49, 74, 99]" in outputs[0]
  assert "[host 0] 2 process(es): trained steps 100-199; saved steps [149, 174, 199]" in (
      outputs[1]), outputs[1]
  assert entries(ckpt / "run1") == ["149", "174", "199"]


@pytest.mark.timeout(600)
def test_the_elastic_trainer_is_the_docs_and_goes_on_when_a_host_dies(tmp_path):
  source = (ROOT / "examples" / "train_elastic.py").read_text()
  block = _block("docs/elastic.md", "examples/train_elastic.py")
  train = block.split("\n", 1)[1].split("\nstate, step = train()")[0]
  assert "def train(hosts):" in train and train in source  # docs/elastic.md shows its training
  work = _copy_examples(tmp_path, "train_elastic.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)  # this checkout's sidecar, whatever is installed
  done = subprocess.run([sys.executable, "train_elastic.py", str(tmp_path / "ckpt")], cwd=work,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  for event in ("host_lost: host 2", "\nretry: ", "start: attempt 2", "phase: restore"):
    assert event in done.stdout, done.stdout
  assert "trained to step 59 on hosts [0, 1]" in done.stdout, done.stdout
  # Issue 55 item 7: it never said which step it resumed from, and its first line was a
  # warning ("could not abort step 19 ... was not saved") for the loss it demonstrates.
  assert "hosts [0, 1, 2]: starting at step 0" in done.stdout, done.stdout
  assert re.search(r"hosts \[0, 1\]: resuming after step (9|19), the last saved",
                   done.stdout), done.stdout  # 19's save may be the one the loss cut short
  assert "could not abort" not in done.stderr, done.stderr
