"""The command line in process: plugins, flags, help texts."""

import argparse
import os

import pytest

import sidecar
from sidecar._src.tools import cli, serve

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
    serve.load_user_code([])
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


def test_serve_replica_hosts_come_from_the_flag_else_the_jobs_sidecars(monkeypatch):
  """--replica-hosts; else (no --replica-hosts-file) the job's sidecars as SIDECAR_HOSTS or
  a JobSet's variables name them in the sidecar's environment; else none (issue 42)."""
  for var in ("SIDECAR_REPLICA_HOSTS", "SIDECAR_REPLICA_HOSTS_FILE", "SIDECAR_HOSTS",
              "SIDECAR_JOBSET_NAME", "SIDECAR_PORT"):
    monkeypatch.delenv(var, raising=False)
  hosts = lambda *argv: serve.replica_hosts(cli.parser().parse_args(["serve", *argv]))
  assert hosts() == ()
  assert hosts("--replica-hosts", "a:1, unix:/s.sock") == ("a:1", "unix:/s.sock")
  monkeypatch.setenv("SIDECAR_HOSTS", "n0:8490:8491,n1,unix:/x.sock")
  assert hosts() == ("n0:8490", "n1:8490", "unix:/x.sock")
  assert hosts("--replica-hosts-file", "/f") == ()  # the file names them
  monkeypatch.delenv("SIDECAR_HOSTS")
  for var, value in (("SIDECAR_JOBSET_NAME", "train"), ("SIDECAR_REPLICATED_JOB", "slice"),
                     ("SIDECAR_NUM_SLICES", "1"), ("SIDECAR_HOSTS_PER_SLICE", "2")):
    monkeypatch.setenv(var, value)
  assert hosts() == ("train-slice-0-0.train:8490", "train-slice-0-1.train:8490")


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


@pytest.mark.parametrize("argv, port", [
    (["status", "127.0.0.1:70000"], "70000"), (["health", "127.0.0.1:99999"], "99999"),
    (["status", "127.0.0.1:8490", "[::1]:0"], "0")], ids=["status", "health", "status-zero"])
def test_status_and_health_refuse_a_port_outside_the_range(capsys, argv, port):
  # Before: dialled modulo 65536, "UNAVAILABLE: ... ipv4:127.0.0.1:4464: Connection refused".
  with pytest.raises(SystemExit) as exit_:
    cli.parser().parse_args(argv)
  assert exit_.value.code == 2
  assert (f"sidecar {argv[0]}: error: argument ADDR: ADDR '{argv[-1]}' has port '{port}'; "
          "ports are integers in 1..65535") in capsys.readouterr().err


@pytest.mark.parametrize("var, value, flag", [
    ("SIDECAR_PORT", "abc", "--port: invalid int value: 'abc'"),
    ("SIDECAR_METRICS_PORT", "x", "--metrics-port: invalid int value: 'x'"),
    ("SIDECAR_SHM_SIZE", "lots", "--shm-size: cannot parse size 'lots'"),
    ("SIDECAR_DEVICE_IDS", "0,a", "--device-ids: expected comma-separated ints")],
    ids=["port", "metrics-port", "shm-size", "device-ids"])
def test_a_bad_serve_variable_is_a_usage_error_of_serve_alone(monkeypatch, capsys, var, value,
                                                              flag):
  # Before: a ValueError traceback from building the parser, for every command.
  monkeypatch.setenv(var, value)
  assert cli.parser().parse_args(["health"]).address == "127.0.0.1:8491"
  with pytest.raises(SystemExit) as exit_:
    cli.parser().parse_args(["serve"])
  assert exit_.value.code == 2
  assert f"sidecar serve: error: argument {flag}" in capsys.readouterr().err
  monkeypatch.delenv(var)
  args = cli.parser().parse_args(["serve"])
  assert (args.port, args.metrics_port, args.shm_size, args.device_ids) == (8490, None, 1 << 30, ())


@pytest.mark.parametrize("error", [ValueError("bad value 7"),
                                   sidecar.InvalidArgumentError("bad value 7")],
                         ids=["value-error", "sidecar-error"])
def test_a_user_error_is_one_line_and_exit_status_2(monkeypatch, capsys, error):
  def fails(args):
    raise error
  monkeypatch.setattr(cli, "_health", fails)
  monkeypatch.setattr(cli.logs, "configure", lambda *a, **k: None)  # pytest's root logger stays
  assert cli.main(["health"]) == 2
  assert capsys.readouterr().err == "sidecar health: bad value 7\n"


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
  def fails(args):
    raise RuntimeError("a bug")
  monkeypatch.setattr(cli, "_health", fails)
  monkeypatch.setattr(cli.logs, "configure", lambda *a, **k: None)
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["health"])
