"""sidecar.distributed: the job from the environment, and agreement between processes.

No sockets: JaxPeers run over a fake of the coordination client, shared by threads that
stand for the processes. The store-neutral part (LocalPeers, the sync timeout, who drives
which host): tests/unit/controller/test_peers.py.
"""

import time

import pytest

from sidecar._src.core import errors
from sidecar._src.jax import distributed
from tests.support.fake_coordination import FakeCoordinationClient
from tests.support.processes_as_threads import run_as_processes

pytestmark = pytest.mark.unit


def run_processes(count: int, body):
  """Runs ``body(peers)`` for ``count`` peers of one job on threads; returns each outcome."""
  client = FakeCoordinationClient()
  return run_as_processes(
      count, lambda p: body(distributed.JaxPeers(client, index=p, count=count)))


JOBSET = {"SIDECAR_JOBSET_NAME": "train", "SIDECAR_REPLICATED_JOB": "slice",
          "SIDECAR_NUM_SLICES": "2", "SIDECAR_HOSTS_PER_SLICE": "4"}


@pytest.mark.parametrize("env, want", [
    ({"SIDECAR_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SIDECAR_NUM_PROCESSES": "2",
      "SIDECAR_PROCESS_ID": "1", "SIDECAR_LOCAL_DEVICES": "2"},
     {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
      "local_devices": 2}),
    ({**JOBSET, "SIDECAR_SLICE_ID": "1", "SIDECAR_HOST_ID": "2"},
     {"coordinator_address": "train-slice-0-0.train:8476", "num_processes": 8,
      "process_id": 6}),
    ({**JOBSET, "SIDECAR_SLICE_ID": "0", "SIDECAR_HOST_ID": "3", "SIDECAR_SUBDOMAIN": "sub",
      "SIDECAR_COORDINATOR_PORT": "9000"},
     {"coordinator_address": "train-slice-0-0.sub:9000", "num_processes": 8, "process_id": 3}),
    ({**JOBSET, "SIDECAR_PROCESS_ID": "5", "SIDECAR_NUM_PROCESSES": "8",
      "SIDECAR_COORDINATOR_ADDRESS": "head:1"},
     {"coordinator_address": "head:1", "num_processes": 8, "process_id": 5}),
], ids=["explicit", "jobset", "jobset-subdomain-port", "jobset-explicit-overrides"])
def test_job_from_env(env, want):
  assert distributed.job_from_env(env) == want


def test_a_job_of_one_process_needs_no_coordinator():
  env = {"SIDECAR_NUM_PROCESSES": "1", "SIDECAR_PROCESS_ID": "0"}
  assert distributed.job_from_env(env) == {
      "coordinator_address": None, "num_processes": 1, "process_id": 0}
  with pytest.raises(errors.InvalidArgumentError, match="SIDECAR_COORDINATOR_ADDRESS is not"):
    distributed.job_from_env({**env, "SIDECAR_NUM_PROCESSES": "2"})


def test_initialize_for_one_process_starts_no_jax_distributed():
  # sidecar launch --hosts 1 sets no coordinator: a TPU host may allow no TCP socket.
  assert distributed.initialize(env={"SIDECAR_NUM_PROCESSES": "1",
                                     "SIDECAR_PROCESS_ID": "0"}) is False
  assert not distributed.is_initialized()


def test_a_detected_cluster_that_cannot_be_completed_runs_as_one_process(monkeypatch, caplog):
  # A lent TPU host looks like a Cloud TPU VM to JAX, whose detection then asks a metadata
  # server that is not there: requests' ConnectionError (an OSError).
  def unreachable(**kwargs):
    raise OSError("Max retries exceeded with url: metadata.google.internal")
  monkeypatch.setattr(distributed, "_jax_detects_cluster", lambda: True)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", unreachable)
  assert distributed.initialize(env={"HOME": "/root"}) is False
  assert not distributed.is_initialized()
  [record] = [r for r in caplog.records if r.name == distributed.__name__]
  assert "could not complete its detection (OSError: Max retries" in record.getMessage()
  assert "running as one process" in record.getMessage()


def test_no_job_in_the_environment_is_none():
  assert distributed.job_from_env({"HOME": "/root"}) is None


@pytest.mark.parametrize("env, match", [
    ({"SIDECAR_COORDINATOR_ADDRESS": "h:1"}, "SIDECAR_NUM_PROCESSES, SIDECAR_PROCESS_ID are"),
    ({"SIDECAR_COORDINATOR_ADDRESS": "h:1", "SIDECAR_NUM_PROCESSES": "2"},
     "SIDECAR_PROCESS_ID is not set"),
    ({"SIDECAR_COORDINATOR_ADDRESS": "h:1", "SIDECAR_NUM_PROCESSES": "two",
      "SIDECAR_PROCESS_ID": "0"}, "SIDECAR_NUM_PROCESSES must be an integer >= 1, got 'two'"),
    ({"SIDECAR_COORDINATOR_ADDRESS": "h:1", "SIDECAR_NUM_PROCESSES": "2",
      "SIDECAR_PROCESS_ID": "2"}, "process id 2 is not below the 2 processes"),
    ({**JOBSET, "SIDECAR_SLICE_ID": "0"}, "neither is SIDECAR_HOST_ID"),
], ids=["only-coordinator", "no-process-id", "malformed-count", "id-too-big", "jobset-no-host"])
def test_incomplete_environment_names_what_is_missing(env, match):
  with pytest.raises(errors.InvalidArgumentError, match=match):
    distributed.job_from_env(env)


def test_initialize_without_any_job_leaves_one_process(monkeypatch):
  monkeypatch.setattr(distributed, "_jax_detects_cluster", lambda: False)
  assert distributed.initialize(env={"HOME": "/root"}) is False
  assert not distributed.is_initialized()


def test_initialize_with_part_of_a_job_names_what_is_missing():
  with pytest.raises(errors.InvalidArgumentError, match="SIDECAR_PROCESS_ID is not set"):
    distributed.initialize(env={"SIDECAR_COORDINATOR_ADDRESS": "127.0.0.1:1",
                                "SIDECAR_NUM_PROCESSES": "2"})
  assert not distributed.is_initialized()


def test_all_gather_and_broadcast_across_three_processes():
  def body(peers):
    return (peers.all_gather("g", f"v{peers.index}"),
            peers.broadcast("b", "from-0" if peers.index == 0 else None))
  outcomes = run_processes(3, body)
  assert outcomes == [(["v0", "v1", "v2"], "from-0")] * 3


def test_agreement_fails_in_every_process_naming_each_value():
  outcomes = run_processes(2, lambda peers: peers.check_same(
      "a", {"step": 5 + peers.index, "seed": 0}, what="the step"))
  for e in outcomes:
    assert isinstance(e, errors.InvalidArgumentError)
    assert str(e).startswith(
        "the 2 processes disagree on the step: process 0: step=5; process 1: step=6.")


def test_agreement_of_equal_values_passes():
  assert run_processes(2, lambda peers: peers.check_same("a", [1, "x"], what="it")) == [None, None]


def test_a_missing_process_is_a_deadline_naming_it_not_a_hang():
  client = FakeCoordinationClient()
  lonely = distributed.JaxPeers(client, index=0, count=2)
  t0 = time.monotonic()
  with pytest.raises(errors.DeadlineExceededError,
                     match=r"process 0: process 1 gave no answer to 'k' within"):
    lonely.all_gather("k", "v", timeout=0.2)
  assert time.monotonic() - t0 < 5


def test_publishing_a_key_twice_says_the_calls_are_out_of_step():
  peers = distributed.JaxPeers(FakeCoordinationClient(), index=0, count=2)
  peers.publish("k", "1")
  with pytest.raises(errors.InvalidArgumentError, match="out of step"):
    peers.publish("k", "2")
