"""Tier 2: what a trainer tells its sidecar's stall rule (core/stall.py) over the worker
socket, seen in ``Status.trainers``: a long phase's budget (``Controller.phase``,
``Worker.phase``), the end of its startup, and a malformed phase frame refused."""

import numpy as np
import pytest

import sidecar
from sidecar._src.controller import startup, status as status_lib
from sidecar._src.core import stall
from sidecar._src.wire import ipc
from tests.conftest import eventually

pytestmark = pytest.mark.server
FLOOR_S = 30.0


def _trainer(address: str):
  [t] = status_lib.fetch(address, timeout=10).trainers
  return t


def test_a_long_phase_has_its_budget_in_status_while_it_lasts(make_server):
  server = make_server(stall_timeout_s=FLOOR_S)
  with sidecar.jax.Controller([server.address]) as ctl:
    t = _trainer(server.address)
    assert t.since_step_s == -1 and t.stall_timeout_s == FLOOR_S  # its startup: untimed
    ctl.worker(0).tell(stall.Phase(stall.STARTUP))  # as its feed's second batch does
    ctl.worker(0).check_alive()  # a request after the frame: the frame was handled
    assert _trainer(server.address).since_step_s >= 0
    with ctl.phase("eval", budget_s=600):
      ctl.worker(0).check_alive()
      assert _trainer(server.address).stall_timeout_s == 600
      with ctl.worker(0).phase("restore", budget_s=900):
        ctl.worker(0).check_alive()
        assert _trainer(server.address).stall_timeout_s == 900
    ctl.worker(0).check_alive()
    t = _trainer(server.address)
    assert t.stall_timeout_s == FLOOR_S and not t.stalled and t.slowest_step_s == 0


@pytest.mark.parametrize("name, budget", [("", 60), ("eval", 0), ("eval", 1e9),
                                          ("eval", float("nan")), (stall.STARTUP, 60)],
                         ids=["no-name", "zero", "over-max", "nan", "startup"])
def test_a_bad_phase_is_refused_before_it_is_sent(make_server, name, budget):
  server = make_server(stall_timeout_s=FLOOR_S)
  with sidecar.jax.Controller([server.address]) as ctl:
    with pytest.raises(sidecar.InvalidArgumentError, match="phase"):
      with ctl.phase(name, budget_s=budget):
        pass
    with pytest.raises(sidecar.InvalidArgumentError, match="phase"):
      with ctl.worker(0).phase(name, budget_s=budget):
        pass


def test_a_malformed_phase_frame_is_refused_and_the_session_goes_on(make_server):
  server = make_server(stall_timeout_s=FLOOR_S)
  with sidecar.jax.Controller([server.address]) as ctl:
    w = ctl.worker(0)
    for frame in ({"op": stall.OP, "name": "eval", "budget_s": 1e12},
                  {"op": stall.OP, "name": ["x"], "budget_s": 60},
                  {"op": stall.OP}):
      with w._lock:
        ipc.send(w._sock, frame)
    w.check_alive()  # answered: the connection stands
    assert _trainer(server.address).stall_timeout_s == FLOOR_S


class Told:
  def __init__(self):
    self.phases = []

  def tell(self, phase):
    self.phases.append(phase)
    return True


def test_the_startup_ends_at_the_second_batch_taken_and_is_told_once():
  told, ledger = Told(), []
  s = startup.Startup(lambda: [told], then=lambda b, n: ledger.append(b))
  s.batch(0.1, 1.0)  # taken before the first step's compile
  assert told.phases == []
  s.batch(0.0, 2.0)
  s.batch(0.0, 3.0)
  assert told.phases == [stall.Phase(stall.STARTUP)] and ledger == [0.1, 0.0, 0.0]


def test_each_elastic_attempt_is_a_phase_until_its_first_step(make_server):
  """Issue 69: an elastic attempt restores and recompiles before its first step; each one
  has stall.ATTEMPT's budget until its feed's second batch, then the floor again. The second
  attempt (here after a Regrow, as after a loss) is one too."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from sidecar._src.user import registry as registry_lib
  from tests.support import feed_fns

  reg = registry_lib.Registry()
  reg.add(registry_lib.PIPELINE, "ids", feed_fns.ids)
  server = make_server(stall_timeout_s=FLOOR_S, registry=reg)
  rows = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
  seen: list[float] = []  # the trainer's stall timeout, as Status lists it

  def look(ctl):
    ctl.worker(0).check_alive()  # a request after the frames: they were handled
    t = _trainer(server.address)
    seen.append(t.stall_timeout_s)

  with sidecar.jax.Controller([server.address]) as ctl:
    @sidecar.elastic.retry(ctl, grow=True)
    def train(hosts):
      look(ctl)  # its restore would run here
      with ctl.feed("ids", kwargs={"n": 64}, global_batch_size=2, sharding=rows) as feed:
        next(feed)  # taken before the first step's compile
        look(ctl)
        next(feed)  # step 1 is done
        look(ctl)
        next(feed)
      if len(seen) < 6:
        raise sidecar.elastic.Regrow(1, [])  # a second attempt, as after a loss
      return hosts

    assert train() == [0]
  budget = stall.ATTEMPT_BUDGET_S
  assert seen == [budget, budget, FLOOR_S] * 2


def test_a_phase_until_a_step_ends_once_at_the_second_batch_or_at_its_end():
  told = Told()
  s = startup.Startup(lambda: [told])
  with s.until_step("retry", 60):
    s.batch(0.0, 1.0)
    s.batch(0.0, 2.0)  # the first step since it began: it ends (and the startup)
    s.batch(0.0, 3.0)
  assert told.phases == [stall.Phase("retry", 60), stall.Phase(stall.STARTUP),
                         stall.Phase("retry")]
  told.phases.clear()
  with s.until_step("retry", 60):
    s.batch(0.0, 4.0)  # no step completed: it ends with the block
  assert told.phases == [stall.Phase("retry", 60), stall.Phase("retry")]


def test_an_attempt_with_no_feed_of_ours_ends_its_phase_at_its_second_save(make_server,
                                                                           tmp_path):
  """Issue 69: a trainer that takes no batch from our feeds (its own loader) has its saves
  as its only steps. Its elastic attempt's phase ended only with the attempt, so a second
  attempt that hung after saving had an hour to be found; it ends at the attempt's second
  save, as a startup does (core/stall.py), and the hang is found by the floor."""
  floor = 1.0
  server = make_server(stall_timeout_s=floor)
  seen: list[float] = []  # the trainer's stall timeout after each save, as Status lists it

  with sidecar.jax.Controller([server.address]) as ctl:
    ckpt = ctl.checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)

    @sidecar.elastic.retry(ctl, grow=True)
    def train(hosts):
      first = ckpt.latest_step() or 0
      if first:  # the second attempt restores, as after a loss
        ckpt.restore(first, target={"w": np.zeros(4, np.float32)})
      for step in (first + 1, first + 2):
        ckpt.save(step, {"w": np.full(4, step, np.float32)}).durable.result()
        ctl.worker(0).check_alive()  # a request after the frames: they were handled
        seen.append(_trainer(server.address).stall_timeout_s)
      if not first:
        raise sidecar.elastic.Regrow(1, [])  # a second attempt
      assert seen[-1] < stall.ATTEMPT_BUDGET_S, seen  # its phase ended at its second save
      # It hangs here (a collective that never returns): found by the floor, not the hour.
      assert eventually(lambda: _trainer(server.address).stalled, timeout=60)
      return hosts

    assert train() == [0]
    ckpt.close()
  budget = stall.ATTEMPT_BUDGET_S
  assert seen[0] == budget and seen[2] == budget, seen  # its first save: its phase lasts
  assert seen[1] < budget and seen[3] < budget, seen  # its second: the rule's own timeout


def test_a_phase_until_a_step_ends_once_at_the_second_save():
  """A trainer with no feed of ours: its saves are its steps; a first one may precede a
  recompile."""
  told = Told()
  s = startup.Startup(lambda: [told])
  with s.until_step("retry", 60):
    s.saved()
    s.batch(0.0, 1.0)  # one of each is no step
    assert told.phases == [stall.Phase("retry", 60)]
    s.saved()
    s.saved()
  assert told.phases == [stall.Phase("retry", 60), stall.Phase("retry")]
