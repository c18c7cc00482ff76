"""sidecar launch's checks before anything starts (the launches themselves:
tests/processes/tools/test_launch.py)."""

import errno

import pytest

from sidecar._src.tools import launch_env

pytestmark = pytest.mark.unit


def _no_tcp():
  raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")


@pytest.mark.parametrize("torch, what", [(False, "jax.distributed's coordinator"),
                                         (True, "torch's store")], ids=["jax", "torch"])
def test_a_job_of_several_processes_where_no_tcp_is_allowed_says_what_failed(
    monkeypatch, torch, what):
  # The lent TPU host allows no TCP or UDP socket, not even on loopback (errno 97).
  said = []
  monkeypatch.setattr(launch_env, "free_port", _no_tcp)
  assert launch_env.loopback_tcp(said.append, 2, torch) is False
  assert said == [f"a job of 2 trainer processes needs a TCP port on 127.0.0.1 for {what}, "
                  "and this machine allows none ([Errno 97] Address family not supported by "
                  "protocol); run one process here (--hosts 1 --procs-per-host 1), which "
                  "needs no coordinator"]


def test_a_job_of_one_process_needs_no_tcp_port(monkeypatch):
  said = []
  monkeypatch.setattr(launch_env, "free_port", _no_tcp)
  assert launch_env.loopback_tcp(said.append, 1, False) is True
  assert said == []
