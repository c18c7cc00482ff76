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
  return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
  args = p.parse_args(argv)
  if args.save_every < 1 or args.steps < 1:
    p.error("--steps and --save-every must be at least 1")
  if args.progress_every < 0:
    p.error(f"--progress-every must be >= 0 seconds, got {args.progress_every}")
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
