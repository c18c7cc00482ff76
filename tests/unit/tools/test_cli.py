"""The command line in process: plugins, flags, help texts."""

import argparse
import os

import pytest

import sidecar
from sidecar._src.tools import cli

pytestmark = pytest.mark.unit


def test_serve_loads_plugins_from_entry_points(tmp_path, monkeypatch):
  dist = tmp_path / "myplugin-1.0.dist-info"
  dist.mkdir()
  (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 1.0\n")
  (dist / "entry_points.txt").write_text("[sidecar.plugins]\nmine = myplugin_fns\n")
  (tmp_path / "myplugin_fns.py").write_text(
      "import sidecar\n@sidecar.function(name='from_plugin')\ndef f():\n  return 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  reg = sidecar.Registry()
  previous = sidecar.set_default_registry(reg)
  try:
    cli.load_user_code([])
  finally:
    sidecar.set_default_registry(previous)
  assert reg.names("function") == ["from_plugin"]


def test_serve_checkpoint_roots_come_from_the_flag_and_the_environment(monkeypatch, tmp_path):
  monkeypatch.delenv("SIDECAR_CHECKPOINT_ROOTS", raising=False)
  assert cli.parser().parse_args(["serve"]).checkpoint_roots == []
  args = cli.parser().parse_args(["serve", "--checkpoint-root", "/a", "--checkpoint-root", "b"])
  assert args.checkpoint_roots == ["/a", "b"]
  monkeypatch.setenv("SIDECAR_CHECKPOINT_ROOTS", os.pathsep.join(["/x", "/y"]))
  assert cli.parser().parse_args(["serve"]).checkpoint_roots == ["/x", "/y"]


@pytest.mark.parametrize("command", [["local"], ["launch"]], ids=["local", "launch"])
def test_local_and_launch_take_checkpoint_roots_for_every_sidecar(command):
  # Before: "unrecognized arguments: --checkpoint-root"; only SIDECAR_CHECKPOINT_ROOTS worked.
  tail = ["--", "true"] if command == ["launch"] else []
  assert cli.parser().parse_args(command + tail).checkpoint_roots is None  # LocalCluster's
  args = cli.parser().parse_args(
      command + ["--checkpoint-root", "/ckpt", "--checkpoint-root", "rel"] + tail)
  assert args.checkpoint_roots == ["/ckpt", os.path.abspath("rel")]


def _commands(p: argparse.ArgumentParser, prefix: str = "sidecar"):
  """Every (command line, parser) under ``p``, ``p`` itself first."""
  yield prefix, p
  for action in p._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        yield from _commands(sub, f"{prefix} {name}")


def test_every_option_of_every_subcommand_has_help_with_its_default():
  seen, missing = set(), []
  for command, p in _commands(cli.parser()):
    seen.add(command)
    text = p.format_help()  # formats every help string: a bad %(...)s raises here
    for action in p._actions:
      if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or \
          action.help == argparse.SUPPRESS:
        continue
      flag = "/".join(action.option_strings) or action.dest
      if not action.help:
        missing.append(f"{command} {flag}: no help")
        continue
      rendered = p._get_formatter()._expand_help(action)
      takes_value = action.option_strings and action.nargs != 0 and not action.required
      if takes_value and "default" not in rendered:
        missing.append(f"{command} {flag}: help names no default: {rendered!r}")
    assert "usage:" in text
  assert {"sidecar serve", "sidecar local", "sidecar launch", "sidecar status", "sidecar demo",
          "sidecar k8s render", "sidecar k8s check"} <= seen
  assert missing == []


def test_serve_help_names_the_variable_and_the_fallback_of_each_default():
  text = " ".join(cli.parser()._subparsers._group_actions[0].choices["serve"]
                  .format_help().split())
  assert "(default: $SIDECAR_PORT, else 8490)" in text
  assert "(default: $SIDECAR_SHM_SIZE, else 1GiB)" in text
  assert "(default: None)" not in text and "(default: False)" not in text
