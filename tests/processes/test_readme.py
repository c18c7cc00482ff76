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


# What makes the LM blocks a test's size: 40 steps for 600 (a save every 10 for 50), a
# 1 MB corpus; the blocks are otherwise run as written, one after the other.
LM_SCALE = {"--steps 600": "--steps 40", "--steps 1200": "--steps 80",
            "--save-every 50": "--save-every 10", "prepare.py --out": "prepare.py --max-mb 1 --out"}


def _as_here(block: str, tmp_path) -> str:
  """A README sh block, for this checkout: its python and sidecar, its files in tmp_path,
  scaled by LM_SCALE (each must be in the block: the test breaks where the README moves)."""
  assert not re.search(r"/tmp(?![/ ])", block), block  # each one replaced below
  # The block's /tmp first: a checkout under /tmp has its interpreter there too.
  block = block.replace("/tmp/", f"{tmp_path}/").replace("--checkpoint-root /tmp ",
                                                         f"--checkpoint-root {tmp_path} ")
  block = block.replace(".venv/bin/pip install -e '.[lm]'", ":")  # the test install has it
  block = block.replace(".venv/bin/python", sys.executable)
  block = block.replace(".venv/bin/sidecar", f"{sys.executable} -m sidecar")
  for written, here in LM_SCALE.items():
    if written in block:
      block = block.replace(written, here)
  return block


@pytest.mark.timeout(600)  # a corpus, a launch, two goodput commands, a sidecar and a trainer
def test_the_lm_blocks_run_in_order_each_doing_what_its_text_says(tmp_path):
  """Issue 71 item 1: the second block reused the first's --ckpt and --steps, restored its
  last step and exited in 2.4 s. Run as a reader runs them, one after the other: the first
  trains from scratch and draws the goodput timeline; the second trains the same job on,
  restored from storage, beside sidecars it then stops."""
  blocks = readme.train_a_real_model()
  assert len(blocks) == 2
  scaled = "".join(blocks)
  assert all(written in scaled for written in LM_SCALE), scaled
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user's shell
  env.update(PYTHONPATH=str(ROOT), SIDECAR_LOG_DIR=str(tmp_path / "logs"))
  outputs = []
  for block in blocks:
    done = subprocess.run(["bash", "-e", "-c", _as_here(block, tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    outputs.append(done.stdout + done.stderr)
  first, second = outputs
  assert "initialised" in first and "trained to step 40; checkpoints [20, 30, 40]" in first
  assert "goodput " in first and (tmp_path / "lm-timeline.png").read_bytes()[:4] == b"\x89PNG"
  assert re.search(r"restored step 40 \(storage tier", second), second
  assert "trained to step 80; checkpoints [60, 70, 80]" in second, second
  assert "WARNING" not in first + second, first + second  # a normal run warns of nothing
  hosts = (tmp_path / "lm-sidecars.txt").read_text()
  assert "SIDECAR_HOSTS=" in hosts  # and its `kill %1 && wait` stopped them


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
