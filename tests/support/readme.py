"""The README's quick start, as the files it names: run by tests/processes/test_readme.py on
CPU devices and by tests/accelerator/test_readme.py on the chip."""

import os
import re

from tests.support.paths import ROOT, entries


def check_two_runs(outputs: list[str], directory) -> None:
  """The quick start's two runs as the README says: 100 steps, then resumed for 100 more,
  ``normalize`` run on the sidecars, the last three saves kept in ``directory/ckpt``."""
  assert "trained steps 0-99; saved steps [49, 74, 99]" in outputs[0], outputs[0]
  assert "trained steps 100-199; saved steps [149, 174, 199]" in outputs[1], outputs[1]
  assert "-1.34164079" in outputs[0]  # normalize ran on the sidecars
  assert entries(os.path.join(directory, "ckpt")) == ["149", "174", "199"]


def quick_start() -> dict[str, str]:
  """{relative path: source} of the python blocks under "In five minutes", each named by
  its first line's comment (``# my_pkg/sidecar_fns.py: ...``)."""
  text = (ROOT / "README.md").read_text()
  section = text.split("## In five minutes", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  return {re.match(r"# (\S+\.py):", b).group(1): b for b in blocks}


def train_a_real_model() -> list[str]:
  """The sh blocks under "Train a real model", in order: a reader runs each on what the
  ones before it left."""
  text = (ROOT / "README.md").read_text()
  section = text.split("## Train a real model", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```sh\n(.*?)```", section, re.S)
