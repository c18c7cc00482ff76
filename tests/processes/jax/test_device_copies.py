"""Tier 3: a save that returns before its device-to-host copies end (accelerators' way).

On an accelerator ``save()`` copies each shard on its device, starts the copies' transfers
to the host and returns; a stager thread lands them in the arena. CPU devices take the
direct way by default (their shards are host memory), so these tests turn the device
copies on (``JaxFramework(device_copies=True)``) to run that path here: bit-exact
restores, a jitted step that donates the state right after ``save()``, the state
changed in place, a copy that fails, and what it leaves behind.
"""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sidecar
from sidecar._src.controller.checkpoint import staging
from sidecar._src.jax import checkpoint as jax_checkpoint
from sidecar._src.jax.framework import JaxFramework
from tests.conftest import eventually
from tests.support.paths import ROOT, entries
from tests.support.states import abstract, assert_same

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def cluster():
  with sidecar.testing.LocalCluster(num_hosts=2, devices_per_host=2, shm_size="64MiB") as c:
    yield c


def make_state():
  m = Mesh(np.array(jax.devices()[:4]), ("data",))
  return {"w": jax.device_put(jnp.arange(4096 * 64, dtype=jnp.float32).reshape(4096, 64),
                              NamedSharding(m, P("data"))),
          "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(m, P())),
          "host": np.arange(10, dtype=np.int64)}


def copying(cluster):
  return cluster.controller(framework=JaxFramework(device_copies=True))


def test_shards_come_as_host_copies_of_copies_on_their_devices():
  state = make_state()
  leaves = jax_checkpoint.save_leaves(state, device_copies=True)
  by_name = {leaf.spec.param_name: leaf for leaf in leaves}
  w = by_name["w"].shards
  assert len(w) == 4 and all(isinstance(s.data, jax_checkpoint.DeviceToHost) for s in w)
  assert len(by_name["b"].shards) == 1  # replicated: saved once
  assert isinstance(by_name["host"].shards[0].data, np.ndarray)
  for s in w:
    (a, b), _ = s.record.index
    np.testing.assert_array_equal(s.data.result(), np.asarray(state["w"])[a:b])
  with pytest.raises(sidecar.ClosedError, match="already taken"):
    w[0].data.result()
  direct = jax_checkpoint.save_leaves(state)  # CPU devices: host arrays, no copies
  assert all(isinstance(s.data, np.ndarray) for leaf in direct for s in leaf.shards)


def test_save_then_a_donating_step_restores_what_was_saved(cluster, tmp_path):
  state = make_state()
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)
  step = jax.jit(lambda s: {"w": s["w"] * 2 + 1, "b": s["b"] + 1, "host": s["host"]},
                 donate_argnums=0)
  with copying(cluster) as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    handle = ckpt.save(1, state)
    for _ in range(3):  # at once, before the copies could have landed
      state = step(state)
    assert handle.staged.result(30) == 1 and handle.durable.result(60) == 1
    assert_same(ckpt.restore(1, target=abstract(want)), want)
    np.testing.assert_array_equal(np.asarray(state["w"]), want["w"] * 8 + 7)


def test_a_host_leaf_changed_after_save_returns_is_saved_as_it_was(cluster, tmp_path):
  state = make_state()
  with copying(cluster) as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, state)
    state["host"][:] = -1  # the host leaf was copied before save() returned
    ckpt.wait()
    restored = ckpt.restore(1, target=abstract(state))
  np.testing.assert_array_equal(restored["host"], np.arange(10))


def test_a_copy_that_fails_after_save_returned_fails_the_save_and_frees_it(
    cluster, tmp_path, monkeypatch):
  state = make_state()
  arena_used = lambda ctl: sorted(s.arena_used for s in ctl.status())
  with copying(cluster) as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    ckpt.save(1, state).durable.result(60)
    before = arena_used(ctl)

    def failing(self, out):
      raise RuntimeError("the device lost the copy")
    monkeypatch.setattr(jax_checkpoint.DeviceToHost, "copy_into", failing)
    handle = ckpt.save(2, state)  # returns: the copies fail later, in the stager
    with pytest.raises(RuntimeError, match="the device lost the copy"):
      handle.durable.result(60)
    with pytest.raises(RuntimeError, match="the device lost the copy"):
      handle.staged.result(0)
    ckpt.wait()  # told by its handle: not raised again
    monkeypatch.undo()
    assert ckpt.all_steps() == [1]
    assert entries(tmp_path / "ck") == ["1"]
    assert eventually(lambda: arena_used(ctl) == before)
    ckpt.save(2, state).durable.result(60)
    assert_same(ckpt.restore(2, target=abstract(state)), state)
  assert not staging.STAGER.busy  # nothing left copying


def test_a_device_without_room_for_the_copies_waits_for_its_transfers(monkeypatch):
  state = make_state()
  monkeypatch.setattr(jax_checkpoint, "_fits", lambda device, nbytes: device.id != 1)
  leaves = {leaf.spec.param_name: leaf for leaf in
            jax_checkpoint.save_leaves(state, device_copies=True)}
  kinds = {s.device_id: type(s.data).__name__ for s in leaves["w"].shards}
  assert kinds == {0: "DeviceToHost", 1: "ndarray", 2: "DeviceToHost", 3: "DeviceToHost"}
  for s in leaves["w"].shards:
    (a, b), _ = s.record.index
    got = s.data if isinstance(s.data, np.ndarray) else s.data.result()
    np.testing.assert_array_equal(got, np.asarray(state["w"])[a:b])


def test_a_first_save_goes_whole_while_its_split_compiles_then_in_pieces(monkeypatch):
  monkeypatch.setattr(jax_checkpoint, "PIECE_BYTES", 16 << 10)  # 64 rows of 256 B
  state = make_state() | {"scalar": jax.device_put(jnp.int32(41), jax.devices()[0])}
  first = {leaf.spec.param_name: leaf for leaf in
           jax_checkpoint.save_leaves(state, device_copies=True)}
  for s in first["w"].shards:  # this layout's split is not compiled yet: whole copies
    assert s.data._rows == ((0, 1024),)
    (a, b), _ = s.record.index
    np.testing.assert_array_equal(s.data.result(), np.asarray(state["w"])[a:b])
  assert jax_checkpoint.wait_for_splits(60)
  leaves = {leaf.spec.param_name: leaf for leaf in
            jax_checkpoint.save_leaves(state, device_copies=True)}
  for s in leaves["w"].shards:  # 1024 rows each: 16 pieces, split on the device
    assert len(s.data._rows) == 16 and s.data._rows[0] == (0, 64)
    (a, b), _ = s.record.index
    out = np.full(s.data.shape, -1, s.data.dtype)
    s.data.copy_into(out)
    np.testing.assert_array_equal(out, np.asarray(state["w"])[a:b])
  for name in ("b", "scalar"):  # one piece each, a copy of its own
    (s,) = leaves[name].shards
    assert len(s.data._rows) == 1
    np.testing.assert_array_equal(s.data.result(), np.asarray(state[name]))


@pytest.mark.parametrize("piece_bytes, compiled", [(4 << 10, True), (1 << 30, True),
                                                   (8 << 10, False)],
                         ids=["pieces", "one-piece", "first-save-whole"])
def test_a_save_of_pieces_then_a_donating_step_restores_what_was_saved(
    cluster, tmp_path, monkeypatch, piece_bytes, compiled):
  monkeypatch.setattr(jax_checkpoint, "PIECE_BYTES", piece_bytes)
  state = make_state()
  if compiled:  # this layout's split compiled beforehand, as after a process's first save
    jax_checkpoint.save_leaves(state, device_copies=True)
    assert jax_checkpoint.wait_for_splits(60)
  else:  # a piece size of this test alone, its split held back: the save copies whole
    held, compile_split = threading.Event(), jax_checkpoint._compile_split
    monkeypatch.setattr(jax_checkpoint, "_compile_split",
                        lambda *args: (held.wait(60), compile_split(*args)))
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)
  given = state["w"]
  step = jax.jit(lambda s: {"w": s["w"] * 2 + 1, "b": s["b"] + 1, "host": s["host"]},
                 donate_argnums=0)
  with copying(cluster) as ctl, ctl.checkpointer(tmp_path / "ck") as ckpt:
    handle = ckpt.save(1, state)
    if not compiled:
      assert jax_checkpoint._COMPILING  # the split of this layout was asked for, not waited
      held.set()
    state = step(state)  # at once: donates what save() was given
    assert given.is_deleted()
    state = step(state)
    assert handle.durable.result(60) == 1
    assert_same(ckpt.restore(1, target=abstract(want)), want)
  assert jax_checkpoint.wait_for_splits(60)


def test_a_process_that_exits_right_after_its_first_save_exits_cleanly(tmp_path):
  """Its split may still be compiling at exit: the interpreter waits for it (a thread that
  compiled on while JAX's exit handlers tore the runtime down aborted the process: 134)."""
  script = textwrap.dedent(f"""
      import jax.numpy as jnp
      import sidecar
      from sidecar._src.jax import checkpoint as jax_checkpoint
      from sidecar._src.jax.framework import JaxFramework
      jax_checkpoint.PIECE_BYTES = 4 << 10  # 64 pieces a leaf: a compilation of some length
      state = {{f"w{{i}}": jnp.full((4096, 64), i, jnp.float32) for i in range(8)}}
      with sidecar.testing.LocalCluster(num_hosts=1, devices_per_host=1, shm_size="64MiB",
                                        checkpoint_roots=[{str(tmp_path)!r}]) as cluster, \\
          cluster.controller(framework=JaxFramework(device_copies=True)) as ctl, \\
          ctl.checkpointer({str(tmp_path / "ck")!r}) as ckpt:
        ckpt.save(1, state)
        print("compiling:", bool(jax_checkpoint._COMPILING), flush=True)
      """)
  # Compiled for real: a split another process left in JAX's persistent cache (the suite
  # shares one, tests/conftest.py) could be loaded before the exit this test is about.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=240, env=env)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "compiling: True" in done.stdout and "terminate called" not in done.stderr
  assert entries(tmp_path / "ck") == ["1"]
