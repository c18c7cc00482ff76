"""Tier 2: ``sidecar status`` and ``sidecar pool status`` against an in-process sidecar: the
token they present, and what they say about an address that is not a sidecar's control port."""

import json
import os

import pytest

from sidecar._src.tools import cli
from tests.support.pool_files import ALICE, write_pool

pytestmark = pytest.mark.server


def _token_file(tmp_path, token: str) -> str:
  path = tmp_path / "token"
  path.write_text(token + "\n")
  os.chmod(path, 0o600)
  return str(path)


@pytest.mark.parametrize("how", ["env", "flag"])
def test_status_reads_the_token_from_sidecar_token_file_or_token_file(
    make_server, tmp_path, monkeypatch, capsys, how):
  # Before: SIDECAR_TOKEN only; SIDECAR_TOKEN_FILE, which Controller.from_env() reads, was
  # ignored (UNREACHABLE: ... set SIDECAR_TOKEN / SIDECAR_TOKEN_FILE).
  server = make_server(token="s3cret")
  monkeypatch.delenv("SIDECAR_TOKEN", raising=False)
  path = _token_file(tmp_path, "s3cret")
  flags = ["--token-file", path] if how == "flag" else []
  if how == "env":
    monkeypatch.setenv("SIDECAR_TOKEN_FILE", path)
  assert cli.main(["status", f"127.0.0.1:{server.port}", "--json", *flags]) == 0
  assert all(h["ok"] for h in json.loads(capsys.readouterr().out)["hosts"])


def test_status_without_the_token_names_the_flag_that_gives_it(make_server, monkeypatch,
                                                               capsys):
  # Before: "UNREACHABLE: missing or wrong token; pass token=... to the Controller ...", a
  # Python argument the command has no way to take.
  server = make_server(token="s3cret")
  for name in ("SIDECAR_TOKEN", "SIDECAR_TOKEN_FILE"):
    monkeypatch.delenv(name, raising=False)
  assert cli.main(["status", f"127.0.0.1:{server.port}"]) == 1
  row = capsys.readouterr().out.splitlines()[1]
  assert "UNREACHABLE: missing or wrong token" in row and "--token-file" in row


@pytest.mark.parametrize("how", ["env", "flag"])
def test_pool_status_reads_the_token_from_sidecar_token_file_or_token_file(
    make_server, tmp_path, monkeypatch, capsys, how):
  server = make_server(pool=write_pool(tmp_path))
  monkeypatch.delenv("SIDECAR_TOKEN", raising=False)
  path = _token_file(tmp_path, ALICE)
  flags = ["--token-file", path] if how == "flag" else []
  if how == "env":
    monkeypatch.setenv("SIDECAR_TOKEN_FILE", path)
  assert cli.main(["pool", "status", f"127.0.0.1:{server.port}", "--json", *flags]) == 0
  report = json.loads(capsys.readouterr().out)
  assert [t["tenant"] for t in report["tenants"]] == ["alice"] and not report["unreachable"]


def test_status_with_an_unreadable_token_file_is_a_usage_error(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["status", "127.0.0.1:1", "--token-file", str(tmp_path / "missing")])
  assert exit_.value.code == 2
  assert "cannot read the token" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["pool", "status"]], ids=["status", "pool"])
def test_status_of_the_health_port_says_it_looks_like_the_health_port(make_server, capsys,
                                                                      command):
  server = make_server()
  # Before: UNREACHABLE: StatusCode.UNIMPLEMENTED: Method not found!
  assert cli.main([*command, f"127.0.0.1:{server.health_port}"]) == 1
  out = capsys.readouterr().out
  assert "looks like a sidecar's health port; give its control port instead" in out
  # Before: pool status said first "no tenants: the sidecars have no pool file", of a
  # sidecar it never heard from.
  assert "no pool file" not in out
