"""What both trainers of this directory share: their flags, their data-parallel setup,
their metrics line, their progress line and the failures a benchmark injects, so
``train.py`` (the sidecars) and ``train_baseline.py`` (Grain + Orbax) differ only in how
they feed and checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def parser(description: str, *, ckpt_help: str) -> argparse.ArgumentParser:
  """The flags both trainers take; a trainer adds its own, then calls :func:`parse`."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--config", default="tiny", help="model.CONFIGS key: tiny, cpu or chip")
  p.add_argument("--data", required=True, help="a corpus written by prepare.py")
  p.add_argument("--ckpt", required=True, help=ckpt_help)
  p.add_argument("--steps", type=int, required=True, help="train until this step")
  p.add_argument("--metrics", required=True, help="JSON-lines file to append to")
  p.add_argument("--save-every", type=int, default=100, help="steps between saves")
  p.add_argument("--keep", type=int, default=3, help="checkpoints kept (max_to_keep)")
  p.add_argument("--seed", type=int, default=0, help="initialisation and shuffle seed")
  p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                 help="print a progress line (step, loss, steps/s, last durable step) this "
                      "often; 0: never")
  p.add_argument("--inject-faults", action="store_true",
                 help="testing: a signal of INJECT makes the next step raise (error) or "
                      "never return (hang); benchmarks.goodput sends them")
  p.add_argument("--eval-every", type=int, default=0, metavar="N",
                 help="every N steps, evaluate the model on held-out text (the corpus's "
                      "heldout.bin, from prepare.py): the mean loss of --eval-batches "
                      "batches, printed; 0: never")
  p.add_argument("--eval-batches", type=int, default=4, help="batches of an evaluation")
  p.add_argument("--eval-min-seconds", type=float, default=0.0, metavar="S",
                 help="testing: an evaluation goes over its batches again until it has "
                      "taken S seconds (a long evaluation, on the CPU)")
  return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
  args = p.parse_args(argv)
  if args.save_every < 1 or args.steps < 1:
    p.error("--steps and --save-every must be at least 1")
  if args.progress_every < 0:
    p.error(f"--progress-every must be >= 0 seconds, got {args.progress_every}")
  if args.eval_every < 0 or args.eval_batches < 1 or args.eval_min_seconds < 0:
    p.error("--eval-every and --eval-min-seconds must be >= 0, --eval-batches >= 1")
  return args


def data_parallel(config: Any) -> tuple[Any, Any, Any, Any]:
  """``(optimizer, train_step, replicated, rows)``: the state replicated over a "data" mesh
  axis of every device, each batch's rows split over it."""
  import jax
  import model
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  optimizer = model.make_optimizer(config)
  train_step = model.make_train_step(config, optimizer, state_sharding=replicated,
                                     batch_sharding=rows)
  return optimizer, train_step, replicated, rows


HELDOUT = "heldout.bin"  # pipelines.lm.HELDOUT: beside the corpus, text it never holds


class Evaluation:
  """``--eval-every``: the model's mean loss on held-out text, every N steps.

  The text is the corpus's ``heldout.bin`` (:data:`HELDOUT`, written by
  ``prepare.py``: sources the corpus never holds); its batches are ``--eval-batches`` of
  the training batch's shape, windows spread evenly over it, the same every time, their
  rows split over the devices as a training batch's. Each batch's loss is read on the host
  (an evaluation works: it is no hang); ``--eval-min-seconds`` goes over them again until
  that long has passed. :meth:`maybe` runs it after the steps it is due, inside
  ``declare("eval")`` (a trainer's way to tell its watchdog: ``ctl.phase``).
  """

  def __init__(self, args: argparse.Namespace, config: Any, rows: Any, *,
               say: Callable[[str], None]):
    import jax
    import model
    import numpy as np
    self.every, self._min_s, self._say = args.eval_every, args.eval_min_seconds, say
    if not self.every:
      return
    path = os.path.join(args.data, HELDOUT)
    try:
      with open(path, "rb") as f:
        text = np.frombuffer(f.read(), np.uint8)
    except FileNotFoundError:
      raise SystemExit(f"--eval-every: no held-out text at {path}: run examples/lm/prepare.py "
                       f"--out {args.data} again (it writes {HELDOUT})") from None
    n, per = config.seq_len + 1, config.batch_size * args.eval_batches
    if len(text) < n:
      raise SystemExit(f"--eval-every: {path} holds {len(text)} bytes, fewer than a sequence")
    starts = np.linspace(0, len(text) - n, per).astype(np.int64)
    windows = np.stack([text[s:s + n] for s in starts]).astype(np.int32)
    me, processes = jax.process_index(), jax.process_count()
    local = config.batch_size // processes
    self._batches = [
        jax.make_array_from_process_local_data(
            rows, windows[b * config.batch_size:][me * local:(me + 1) * local],
            (config.batch_size, n))
        for b in range(args.eval_batches)]
    self._loss = jax.jit(lambda params, tokens: model.loss_fn(config, params, tokens))

  def maybe(self, step: int, state: Any, declare: Callable[[str], Any]) -> None:
    """Evaluates after step ``step`` if it is due."""
    if not self.every or step % self.every:
      return
    t0 = time.monotonic()
    with declare("eval"):
      losses, passes = [], 0
      while not passes or time.monotonic() - t0 < self._min_s:
        losses += [float(self._loss(state["params"], b).addressable_data(0))
                   for b in self._batches]
        passes += 1
    self._say(f"eval after step {step}: held-out loss {sum(losses) / len(losses):.4f} "
              f"({len(self._batches)} batches x {passes}, {time.monotonic() - t0:.2f} s)")


def write_metric(metrics: TextIO, step: int, loss: Any, first: bool = False) -> float:
  """Step ``step``'s line: ``{"step", "loss", "time"}``, the loss read from this process's
  copy of the replicated value, the time when it was ready, and ``"first": true`` where
  ``first``: the first step of a start (or of an in-process rollback), where plot.py
  breaks the line; returns the loss."""
  value = float(loss.addressable_data(0))
  line = {"step": step, "loss": value, "time": time.time(), **({"first": True} if first else {})}
  metrics.write(json.dumps(line) + "\n")
  metrics.flush()
  return value


class Progress:
  """The progress line, at most every ``every_s`` seconds (0: never)::

    step 120: loss 2.9134, 18.3 steps/s, last durable step 100

  steps/s over the steps since the previous line; ``durable()``: the latest step a
  restart would resume from (the checkpointer's latest committed step), None before any.
  """

  def __init__(self, every_s: float, durable: Callable[[], int | None], *,
               out: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
    self._every, self._durable, self._out, self._clock = every_s, durable, out, clock
    self._since: tuple[float, int] | None = None  # (time, step) of the previous line

  def start(self, step: int) -> None:
    """Training begins (again) after ``step``: steps/s counts from here."""
    self._since = (self._clock(), step)

  def step(self, step: int, loss: float) -> None:
    """Step ``step``'s loss is known: prints the line if it is due."""
    if self._every <= 0:
      return
    now = self._clock()
    if self._since is None:
      self._since = (now, step - 1)
    t0, step0 = self._since
    if now - t0 < self._every:
      return
    rate = (step - step0) / (now - t0)
    durable = self._durable()
    print(f"step {step}: loss {loss:.4f}, {rate:.1f} steps/s, last durable step "
          f"{'none' if durable is None else durable}", file=self._out or sys.stdout, flush=True)
    self._since = (now, step)


# The signals that inject a failure into a live trainer (--inject-faults), by kind. Not
# SIGUSR2: sidecar launch asks a stalled trainer for its stacks with it.
INJECT = {"error": signal.SIGRTMIN + 1, "hang": signal.SIGRTMIN + 2}


class Faults:
  """``--inject-faults``: a failure a benchmark injects, happening inside a step.

  The signal's handler only notes the kind (a handler that raised would raise wherever
  the main thread happens to be: in a save, in the feed); the step loop calls
  :meth:`check` inside each step, after its batch is taken, and there the step raises
  (``error``) or never returns (``hang``: it sleeps until the process is killed). Each
  prints ``fault: injected KIND in step N at unix T`` first. Disabled, it does nothing.
  """

  def __init__(self, enabled: bool, *, say: Callable[[str], None]):
    self._pending: str | None = None
    self._say = say
    if enabled:
      for kind, sig in INJECT.items():
        signal.signal(sig, lambda *_, kind=kind: self._note(kind))

  def _note(self, kind: str) -> None:
    self._pending = kind

  def check(self, step: int) -> None:
    """Step ``step`` fails here if a failure was injected since the last check."""
    kind, self._pending = self._pending, None
    if kind is None:
      return
    self._say(f"fault: injected {kind} in step {step} (pid {os.getpid()}) at unix "
              f"{time.time():.6f}")
    if kind == "error":
      raise RuntimeError(f"injected error in step {step} (--inject-faults)")
    while True:  # a hang: a step that never returns (the launcher's SIGKILL ends it)
      time.sleep(3600)
