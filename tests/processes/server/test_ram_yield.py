"""The RAM tier gives way (issue 45): a real sidecar, a 32 MiB arena, an 18 MiB state.

A durable step's RAM-tier copy yields to a save that needs its room (the same job's next
step, another job's) and to a feed's batches; a step not durable yet never does (its write
held by the fault hook ``slow@7:PATH`` until the test creates PATH); an operator frees
copies at once through the API and the CLI.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.arena import shm
from sidecar._src.controller import status as status_lib
from sidecar._src.core import env as env_lib
from sidecar._src.tools import cli
from tests.conftest import eventually
from tests.support.metrics import samples, scrape, value

pytestmark = pytest.mark.processes

MiB = 1 << 20
HELD = 7  # the step whose write waits for the gate file


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
  return tmp_path_factory.mktemp("gate") / "go"


@pytest.fixture(scope="module")
def cluster(gate):
  # A save this large copies on shm.copy's threads, made once per process: made here.
  shm.copy(np.empty(16 * MiB, np.uint8), np.zeros(16 * MiB, np.uint8))
  with sidecar.testing.LocalCluster(
      num_hosts=1, devices_per_host=1, shm_size="32MiB", metrics=True,
      imports=["tests.support.feed_fns"],
      host_env={0: {env_lib.CKPT_FAULT: f"slow@{HELD}:{gate}"}}) as c:
    yield c


def state(fill: float) -> dict:
  return {"w": np.full(18 * MiB // 4, fill, np.float32)}  # over half the arena


def status(cluster):
  (one,) = [status_lib.fetch(a, timeout=5, token=cluster.token) for a in cluster.addresses]
  return one


def ram_steps(cluster, directory) -> list[int]:
  return [s for c in status(cluster).checkpoints if c.directory == str(directory)
          for s in c.ram_steps]


def arena_used(cluster) -> int:
  return status(cluster).arena_used


def evictions(cluster, reason) -> float:
  return value(samples(scrape(cluster.metrics_urls[0])), "sidecar_ram_tier_evictions_total",
               reason=reason) or 0


def test_a_state_over_half_the_arena_saves_step_after_step_with_the_defaults(cluster, tmp_path):
  before = evictions(cluster, "room")
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    for step in range(3):  # each save needs the room of the step before, durable by then
      assert ckpt.save(step, state(step)).durable.result(60) == step
    assert ckpt.all_steps() == [0, 1, 2]
    assert ram_steps(cluster, tmp_path / "ck") == [2]
    restored = ckpt.restore(1, target={"w": np.zeros(18 * MiB // 4, np.float32)})
    assert restored["w"][0] == 1.0  # from storage: its copy gave way
  assert evictions(cluster, "room") >= before + 2
  assert "leaves the RAM tier of host 0: new work needs" in cluster.log(0)


def test_a_finished_jobs_copy_yields_to_another_jobs_save(cluster, tmp_path):
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(0, state(1.0)).durable.result(60)
  assert ram_steps(cluster, tmp_path / "a") == [0]  # the job is gone; its copy stays
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "b", ram_steps=0) as ckpt:
    assert ckpt.save(0, state(2.0)).durable.result(60) == 0
  assert ram_steps(cluster, tmp_path / "a") == []
  with cluster.controller() as ctl, ctl.checkpointer(tmp_path / "a") as ckpt:
    assert ckpt.restore(0, target=state(0.0))["w"][-1] == 1.0  # durable all along


def test_a_finished_jobs_copy_yields_to_a_feeds_batches(cluster, tmp_path):
  with cluster.controller() as ctl:
    with ctl.checkpointer(tmp_path / "ck") as ckpt:
      ckpt.save(0, state(1.0)).durable.result(60)
    assert ram_steps(cluster, tmp_path / "ck") == [0]  # 18 MiB of 32: 14 MiB free
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    # A batch of 15 MiB: more than the 14 MiB free while the copy stays.
    with ctl.feed("huge_rows", kwargs={"nbytes": 5 * MiB}, global_batch_size=3,
                  sharding=sharding, options=sidecar.FeedOptions(prefetch=1)) as feed:
      assert next(feed)["x"].shape == (3, 5 * MiB)
    assert ram_steps(cluster, tmp_path / "ck") == []
  assert "new work needs" in cluster.log(0)


def test_reopening_a_directory_with_ram_steps_0_frees_its_copies(cluster, tmp_path):
  with cluster.controller() as ctl:
    with ctl.checkpointer(tmp_path / "ck") as ckpt:
      ckpt.save(0, state(1.0)).durable.result(60)
    assert ram_steps(cluster, tmp_path / "ck") == [0]
    with ctl.checkpointer(tmp_path / "ck", ram_steps=0):
      assert ram_steps(cluster, tmp_path / "ck") == []


def test_a_step_not_durable_yet_is_never_evicted(cluster, gate, tmp_path):
  """Job 1's step is staged and held being written; job 2's save fails at once, saying
  what holds the arena; once job 1's step is durable it gives way."""
  assert not gate.exists()
  with cluster.controller() as job1, job1.checkpointer(tmp_path / "held") as held:
    try:
      first = held.save(HELD, state(7.0))
      assert first.staged.result(60) == HELD  # in the RAM tier; its write waits for the gate
      with cluster.controller() as job2, job2.checkpointer(tmp_path / "other") as other:
        with pytest.raises(sidecar.ResourceExhaustedError) as e:
          other.save(1, state(1.0))
        message = str(e.value)
        assert "does not fit host 0's arena now" in message
        assert (f"{tmp_path / 'held'} step {HELD} (18.0 MiB, being written: not durable yet, "
                "kept)") in message
        assert not first.durable.done()
        gate.touch()  # the write goes on
        assert first.durable.result(60) == HELD
        assert other.save(1, state(1.0)).durable.result(60) == 1  # now it gives way
      assert held.all_steps() == [HELD]
    finally:
      gate.touch()


def test_an_operator_drops_a_directorys_copies_through_the_api_and_the_cli(
    cluster, tmp_path, capsys, monkeypatch):
  directory = tmp_path / "op"
  with cluster.controller() as ctl:
    with ctl.checkpointer(directory) as ckpt:
      ckpt.save(0, state(1.0)).durable.result(60)
    assert eventually(lambda: arena_used(cluster) >= 18 * MiB, 10)
    dropped = ctl.drop_ram_tier(directory)
    assert [(s.directory, s.steps) for s in dropped.dropped] == [(str(directory), (0,))]
    assert dropped.nbytes >= 18 * MiB and dropped.kept == ()
    assert eventually(lambda: arena_used(cluster) < MiB, 10)
    assert ctl.drop_ram_tier(directory).dropped == ()  # nothing left
    with ctl.checkpointer(directory) as ckpt:
      ckpt.save(1, state(2.0)).durable.result(60)
      assert ckpt.drop_ram_tier().dropped[0].steps == (1,)
      ckpt.save(2, state(2.0)).durable.result(60)
  assert eventually(lambda: arena_used(cluster) >= 18 * MiB, 10)
  if cluster.token:
    monkeypatch.setenv(env_lib.TOKEN, cluster.token)
  assert cli.main(["ram-tier", "drop", "--directory", str(directory), *cluster.addresses]) == 0
  assert f"host 0: dropped {directory} step 2 (18.0 MiB)" in capsys.readouterr().out
  assert eventually(lambda: arena_used(cluster) < MiB, 10)
  assert evictions(cluster, "operator") >= 3


def test_the_cli_needs_a_directory_or_a_tenant(capsys):
  with pytest.raises(SystemExit):
    cli.main(["ram-tier", "drop", "127.0.0.1:1"])
  assert "one of the arguments --directory --tenant is required" in capsys.readouterr().err
