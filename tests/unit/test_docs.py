"""What the README and the docs state about installing and running, checked against the
repository (issue 45, item 8): the Python they need, no pins pyproject excludes, flags as the
CLI takes them."""

import argparse
import re
import tomllib

import pytest

from sidecar._src.tools.k8s import cli as k8s_cli
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_readme_states_the_python_that_pyproject_requires():
  wanted = PYPROJECT["project"]["requires-python"]  # ">=3.11"
  two_commands = (ROOT / "README.md").read_text().split("## Two commands", 1)[1]
  two_commands = two_commands.split("\n## ", 1)[0]
  assert f"Python {wanted.replace('>=', '>= ')}" in two_commands
  # and what the test command installs, with its size
  assert re.search(r"The test command installs .* about [\d.]+ GB", two_commands, re.S)


def test_the_readme_carries_no_development_history():
  text = (ROOT / "README.md").read_text()
  assert not re.search(r"before this|main at [0-9a-f]{7}", text), \
      "state the facts, not what the code did before a commit"


def test_no_page_pins_a_version_pyproject_excludes():
  excluded = []
  for requirement in PYPROJECT["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    excluded += [(name, v) for v in re.findall(r"!=([\w.]+)", requirement)]
  assert excluded  # ml_dtypes 0.7.0
  for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    text = page.read_text()
    for name, version in excluded:
      for spelling in {name, name.replace("_", "-")}:
        assert f"{spelling}=={version}" not in text, f"{page.name} pins {spelling}=={version}"


def test_kubernetes_md_says_hosts_per_slice_defaults_to_one_without_tpu():
  parser = argparse.ArgumentParser()
  k8s_cli.register(parser.add_subparsers())
  args = parser.parse_args(["k8s", "render", "--image", "sidecar:1"])
  assert k8s_cli.options_from_args(args).hosts_per_slice == 1  # not required
  text = (ROOT / "docs" / "kubernetes.md").read_text()
  assert "is required without `--tpu`" not in text
  assert "without `--tpu` it defaults to 1" in text


def test_the_commands_a_reader_pastes_have_no_optional_brackets():
  # Issue 71 item 4: `sidecar goodput /tmp/lm-ckpt [--json] [--plot timeline.png]`, pasted,
  # failed; a variant is a line of its own.
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted((ROOT / "examples").rglob("*.md"))]
  for page in pages:
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", page.read_text(), re.S):
      for line in block.splitlines():
        command = line.split("  #", 1)[0]
        assert not re.search(r"\[--?\w", command), f"{page.name}: {line}"
