"""examples/lm: prepare.py's corpus and model.py's model, in this process."""

import importlib.util
import io
import json
import os
import pathlib
import signal
import sys

import jax
import numpy as np
import pytest

from pipelines import lm as lm_pipeline

pytestmark = pytest.mark.unit

LM = pathlib.Path(__file__).resolve().parents[3] / "examples" / "lm"


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"examples_lm_{name}", LM / f"{name}.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def prepare():
  return _load("prepare")


@pytest.fixture(scope="module")
def model():
  return _load("model")


def test_prepare_concatenates_sorted_sources_and_skips_tests(prepare, tmp_path):
  root = tmp_path / "lib"
  for rel, text in {"b.py": "B", "a/z.py": "AZ", "a.py": "A", "test/t.py": "T",
                    "site-packages/s.py": "S", "c.txt": "C"}.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
  assert prepare.main(["--out", str(tmp_path / "out"), "--root", str(root)]) == 0
  ds = lm_pipeline.Sequences(tmp_path / "out", seq_len=1)
  assert ds.span(0, len(ds) + 1) == b"A\nAZ\nB\n"  # a.py, a/z.py, b.py


def test_prepare_writes_the_stdlib_deterministically_up_to_max_mb(prepare, tmp_path):
  for out in ("one", "two"):
    assert prepare.main(["--out", str(tmp_path / out), "--max-mb", "0.25",
                         "--record-kb", "16", "--shard-mb", "1"]) == 0
  manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
  assert manifest["total_bytes"] == 1 << 18 and manifest["records"] == [16]
  assert manifest["sources"] > 100  # the stdlib has hundreds of modules
  one, two = (lm_pipeline.Sequences(tmp_path / d, 1 << 12) for d in ("one", "two"))
  assert one.span(0, 1 << 18) == two.span(0, 1 << 18)
  first = prepare.source_files()[0].read_bytes()
  assert one.span(0, min(len(first), 1 << 18)) == first[:1 << 18]


def test_the_chip_config_holds_a_gib_of_float32_state(model):
  chip = model.CONFIGS["chip"]
  state = model.abstract_state(chip, model.make_optimizer(chip))
  assert model.param_count(state["params"]) >= 90_000_000
  assert model.state_bytes(state) >= 1 << 30
  assert {x.dtype for x in jax.tree.leaves(state["params"])} == {np.dtype(np.float32)}


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 65}, "d_model must be a multiple of n_heads, got d_model=65, n_heads=4"),
    ({"n_layers": 0}, "n_layers must be at least 1, got 0"),
], ids=["heads", "layers"])
def test_config_refuses_bad_shapes(model, kwargs, match):
  base = {"seq_len": 8, "batch_size": 2, "d_model": 64, "n_layers": 1, "n_heads": 4}
  with pytest.raises(ValueError, match=match):
    model.Config(**{**base, **kwargs})


def test_train_step_learns_and_repeats_bit_exactly(model):
  config = model.Config(seq_len=16, batch_size=4, d_model=32, n_layers=2, n_heads=2,
                        warmup_steps=1, learning_rate=1e-2)
  optimizer = model.make_optimizer(config)
  step = model.make_train_step(config, optimizer)
  tokens = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)

  def run(n):
    state, losses = model.init_state(config, optimizer, seed=3), []
    for _ in range(n):
      state, loss = step(state, {"tokens": tokens})
      losses.append(float(loss))
    return state, losses

  state, losses = run(20)
  assert int(state["step"]) == 20
  assert losses[0] == pytest.approx(np.log(256), rel=0.05)  # uniform over bytes at init
  assert losses[-1] < losses[0] - 1
  assert run(20)[1] == losses


def test_plot_keeps_the_last_line_of_each_step_and_draws(tmp_path):
  plot = _load("plot")
  metrics = tmp_path / "run.jsonl"
  metrics.write_text("".join(json.dumps({"step": s, "loss": l, "time": t}) + "\n" for s, l, t in [
      (1, 5.0, 100.0), (2, 4.0, 101.0), (3, 3.5, 102.0), (2, 4.0, 110.0), (3, 3.0, 111.0)]))
  assert plot.read(str(metrics)) == ([1, 2, 3], [5.0, 4.0, 3.0], [0.0, 10.0, 11.0])
  assert plot.main([str(metrics), "--out", str(tmp_path / "loss.png")]) == 0
  assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_plot_draws_each_run_as_its_own_segment_and_no_line_across_a_restart(tmp_path):
  plot = _load("plot")
  metrics = tmp_path / "run.jsonl"
  # A run to step 4, killed; the next restores step 2 and goes on to 5 (re-doing 3 and 4).
  metrics.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s, "time": t}) + "\n"
                             for s, t in [(1, 0), (2, 1), (3, 2), (4, 3),
                                          (3, 20), (4, 21), (5, 22)]))
  assert plot.segments(str(metrics)) == [
      plot.Segment([1, 2], [9.0, 8.0], [0.0, 1.0]),
      plot.Segment([3, 4, 5], [7.0, 6.0, 5.0], [20.0, 21.0, 22.0])]
  fig = plot.draw([str(metrics)])
  by_step, by_time = fig.axes
  assert [list(line.get_xdata()) for line in by_step.get_lines()] == [[1, 2], [3, 4, 5]]
  assert [list(line.get_xdata()) for line in by_time.get_lines()] == [[0.0, 1.0],
                                                                      [20.0, 21.0, 22.0]]
  assert [line.get_label() for line in by_step.get_lines()][0] == "run"  # one legend entry
  assert len(by_step.get_legend().get_texts()) == 1


def test_each_refusal_the_command_line_can_fix_names_its_flag():
  """train.py's run() ends with the error and these lines (exit status 2): a damaged step,
  the flags that train past it; data changed since the checkpoint, --start-feed-anew (the
  processes tier runs the first whole; the second is the feed's refusal, as it reads)."""
  import sidecar
  train = _load("train")
  damaged = sidecar.CorruptCheckpointError(
      "step 50 of /ckpt: ...\nStep 50 of /ckpt is not restored as saved: older committed "
      "steps that check intact: [40, 30]; restore one (restore(40, ...)), or pass "
      "fallback=True to restore the newest that reads whole")
  assert train.flag_for(damaged) == (
      "From this command line: run it again with --restore-step 40 (that step), or with "
      "--fallback (the newest step that restores whole); either sets the steps after the "
      "one restored aside (<ckpt>/set-aside-<step>) and trains on, saving their numbers "
      "anew")
  changed = sidecar.PipelineInvalidArgumentError(
      "lm", "InvalidArgumentError", "feed 'lm': the state it resumes from was made from 'a', "
      "but with kwargs ['data'] it now reads 'b': the data changed since the checkpoint "
      "(re-prepared, or another path). ...", host_id=0)
  assert "or with --start-feed-anew" in train.flag_for(changed)
  assert train.flag_for(sidecar.InvalidArgumentError("something else")) is None


def test_plot_breaks_the_line_where_a_restart_resumed_right_after_the_last_line(tmp_path):
  """Issue 79 item 5: a run killed right after its step 4's line and resumed from step 4
  goes on at 5: the steps go up across the restart, and a line was drawn over the gap.
  train.py marks the first line of each start; plot.py breaks there."""
  plot, trainers = _load("plot"), _load("trainers")
  metrics = tmp_path / "run.jsonl"
  with open(metrics, "a") as f:
    for step, first in [(1, True), (2, False), (3, False), (4, False), (5, True),
                        (6, False)]:
      trainers.write_metric(f, step, jax.numpy.float32(10.0 - step), first)
  lines = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [line.get("first", False) for line in lines] == [True, False, False, False, True, False]
  assert [p.steps for p in plot.segments(str(metrics))] == [[1, 2, 3, 4], [5, 6]]


def test_the_progress_line_says_step_loss_rate_and_the_last_durable_step():
  trainers = _load("trainers")
  now, durable, out = [100.0], [None], io.StringIO()
  progress = trainers.Progress(10.0, lambda: durable[0], out=out, clock=lambda: now[0])
  progress.start(40)  # resumed after step 40
  for step in range(41, 61):
    now[0] += 0.5
    durable[0] = 50 if step > 50 else None
    progress.step(step, 3.0 - step / 100)
  assert out.getvalue().splitlines() == [
      "step 60: loss 2.4000, 2.0 steps/s, last durable step 50"]  # 20 steps in 10 s
  silent = io.StringIO()
  quiet = trainers.Progress(0, lambda: 1, out=silent, clock=lambda: now[0])
  quiet.step(1, 1.0)
  now[0] += 1e6
  quiet.step(2, 1.0)
  assert silent.getvalue() == ""


@pytest.fixture
def faults():
  """trainers.py, its injection signals' handlers put back afterwards."""
  trainers = _load("trainers")
  before = {sig: signal.getsignal(sig) for sig in trainers.INJECT.values()}
  yield trainers
  for sig, handler in before.items():
    signal.signal(sig, handler)


def test_an_injected_error_raises_in_the_next_step_and_only_there(faults):
  said = []
  injected = faults.Faults(True, say=said.append)
  injected.check(1)  # nothing injected: nothing happens
  os.kill(os.getpid(), faults.INJECT["error"])  # its handler only notes the kind
  with pytest.raises(RuntimeError, match=r"injected error in step 2 \(--inject-faults\)"):
    injected.check(2)
  injected.check(3)  # once
  assert len(said) == 1 and said[0].startswith(
      f"fault: injected error in step 2 (pid {os.getpid()}) at unix ")


def test_an_injected_hang_never_returns_from_its_step(faults, monkeypatch):
  class Slept(Exception):
    pass

  def sleep(seconds):  # the only way out of a hang here: a hung process is killed
    raise Slept(seconds)

  said = []
  injected = faults.Faults(True, say=said.append)
  os.kill(os.getpid(), faults.INJECT["hang"])
  monkeypatch.setattr(faults.time, "sleep", sleep)
  with pytest.raises(Slept):
    injected.check(7)
  assert said[0].startswith("fault: injected hang in step 7 ")


def test_without_the_flag_nothing_catches_the_signals(faults):
  before = {sig: signal.getsignal(sig) for sig in faults.INJECT.values()}
  faults.Faults(False, say=print).check(1)
  assert {sig: signal.getsignal(sig) for sig in faults.INJECT.values()} == before
  assert signal.SIGUSR2 not in faults.INJECT.values()  # the launcher's stacks signal
