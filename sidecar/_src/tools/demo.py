"""``sidecar demo``: train a small MLP on real data fed by sidecars through shared memory.

A LocalCluster of sidecar processes runs the digits pipeline (scikit-learn's
bundled 8x8 handwritten digits, no download); every host produces the rows its
devices own, which arrive as one sharded ``jax.Array`` per step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sidecar._src.controller import elastic as elastic_lib
from sidecar._src.core import errors, logs, options as options_lib
from sidecar._src.jax import distributed, elastic as jax_elastic
from sidecar._src.jax.controller import Controller
from sidecar._src.tools import launch
from sidecar._src.tools.local import LocalCluster

PIPELINES = "pipelines.digits"
# Without --verbose the demo prints its story only: log records below ERROR, the
# launcher's lines and what the trainer processes write to stderr (Gloo's connection
# lines, say) go to a log file of this run's own, $TMPDIR/sidecar-demo-*.log: removed when
# the run succeeds or is interrupted, kept and named when it fails.
LOG_PREFIX, LOG_SUFFIX = "sidecar-demo-", ".log"
CKPT_PREFIX = "sidecar-demo-ckpt-"
INTERRUPTED = 130  # a shell's status for a command that SIGINT ended


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[str | None]:
  """Sends this process's log records below ERROR to a new log file unless ``verbose``
  (one per run, so two demos never write into one); yields its path (None when verbose)."""
  if verbose:
    yield None
    return
  fd, path = tempfile.mkstemp(prefix=LOG_PREFIX, suffix=LOG_SUFFIX)
  os.close(fd)
  root = logging.getLogger()
  handlers, level = root.handlers[:], root.level
  to_file = logging.FileHandler(path, mode="a")
  to_file.setFormatter(logging.Formatter(logs.TEXT_FORMAT))
  errors_only = logging.StreamHandler(sys.stderr)
  errors_only.setLevel(logging.ERROR)
  root.handlers[:] = [to_file, errors_only]
  root.setLevel(min(level, logging.INFO) if level else logging.INFO)
  try:
    yield path
  finally:
    root.handlers[:] = handlers
    root.setLevel(level)
    to_file.close()


def init_params(key: jax.Array, sizes=(64, 128, 10)) -> list[tuple[jax.Array, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [(jax.random.normal(k, (m, n)) * np.sqrt(2.0 / m), jnp.zeros(n))
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def logits_fn(params, images: jax.Array) -> jax.Array:
  x = images.reshape(images.shape[0], -1)
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def loss_fn(params, batch) -> jax.Array:
  logp = jax.nn.log_softmax(logits_fn(params, batch["image"]))
  return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], axis=1))


@jax.jit
def train_step(params, batch, lr: float = 0.1):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


@jax.jit
def correct(params, batch) -> jax.Array:
  return jnp.sum(jnp.argmax(logits_fn(params, batch["image"]), -1) == batch["label"])


class Progress:
  """A one-line progress bar on a terminal; silent otherwise."""

  def __init__(self, total: int, stream=sys.stdout):
    self.total, self.stream, self.live = total, stream, stream.isatty()

  def update(self, done: int, text: str) -> None:
    if self.live:
      filled = int(30 * done / self.total)
      self.stream.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {text}")
      self.stream.flush()

  def close(self) -> None:
    if self.live:
      self.stream.write("\n")


def evaluate(ctl, params, sharding) -> tuple[int, int]:
  hits = total = 0
  with ctl.feed("digits", kwargs={"split": "test"}, global_batch_size=32, sharding=sharding,
                num_epochs=1) as test:
    for batch in test:
      hits += int(correct(params, batch))
      total += batch["label"].shape[0]
  return hits, total


def run(*, hosts: int = 2, devices_per_host: int = 2, steps: int = 300,
        global_batch_size: int = 64, checkpoint_every: int = 100, processes: int = 1,
        elastic: bool = False, verbose: bool = False) -> int:
  """Runs the demo; returns a process exit code.

  ``processes=1``: one process owns every device and drives a LocalCluster of ``hosts``
  sidecars. ``processes=N``: the same training as a multi-controller job, N trainer
  processes under ``jax.distributed`` (one per host, each beside its own sidecar),
  started by ``sidecar launch``. ``verbose``: log records and the trainers' stderr come
  to the terminal too; else they go to a log file of this run's own, removed at the end
  unless the run failed (then named and kept). The checkpoints go to a new temporary
  directory, removed at the end. Ctrl-C stops it with one line and removes both.
  """
  for name, value in (("num_hosts", hosts), ("devices_per_host", devices_per_host),
                      ("steps", steps), ("processes", processes)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # before any print
      raise errors.InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
  if importlib.util.find_spec("sklearn") is None:  # pipelines.digits, in every sidecar
    print("sidecar demo needs scikit-learn for its dataset (pipelines.digits): "
          "pip install 'colocated-sidecar[demo]'", file=sys.stderr)
    return 2
  code, log_file = 1, None
  try:
    with _quiet(verbose) as log_file:
      try:
        code = _run(hosts=hosts, devices_per_host=devices_per_host, steps=steps,
                    global_batch_size=global_batch_size, checkpoint_every=checkpoint_every,
                    processes=processes, elastic=elastic, log_file=log_file)
      except KeyboardInterrupt:  # the sidecars and the checkpoints are gone by now
        code = INTERRUPTED
  finally:  # a failure keeps its log, and names it: that is when it is read
    if log_file is not None and code in (0, INTERRUPTED):
      os.unlink(log_file)
    elif log_file is not None:
      print(f"The log: {log_file}, kept (--verbose shows it here instead).", file=sys.stderr)
  if code == INTERRUPTED:
    print("sidecar demo: interrupted; its sidecars are stopped and what it made is removed",
          file=sys.stderr)
  return code


def _run(*, hosts: int, devices_per_host: int, steps: int, global_batch_size: int,
         checkpoint_every: int, processes: int, elastic: bool, log_file: str | None) -> int:
  if elastic:
    hosts = max(hosts, 3)  # a global batch both meshes split evenly, before and after
    batch = math.lcm(hosts * devices_per_host, (hosts - 1) * devices_per_host) * 4
    return run_elastic(hosts=hosts, devices_per_host=devices_per_host, steps=steps,
                       global_batch_size=batch)
  # Made here and removed here, once every sidecar and trainer is gone (nothing writes in
  # it then), however the run ends: training removes it itself when it completes.
  ckpt_dir = tempfile.mkdtemp(prefix=CKPT_PREFIX)
  try:
    if processes > 1:
      return _launch(processes=processes, devices_per_host=devices_per_host, steps=steps,
                     global_batch_size=global_batch_size, checkpoint_every=checkpoint_every,
                     ckpt_dir=ckpt_dir, log_file=log_file)
    print(f"Starting a LocalCluster: {hosts} sidecar processes, {devices_per_host} CPU "
          "devices each.")
    t0 = time.perf_counter()
    with LocalCluster(hosts, devices_per_host, shm_size="64MiB", imports=[PIPELINES]) as cluster:
      with cluster.controller() as ctl:
        print(f"Sidecars ready in {time.perf_counter() - t0:.1f} s:")
        train(ctl, steps=steps, global_batch_size=global_batch_size,
              checkpoint_every=checkpoint_every, ckpt_dir=ckpt_dir)
    print("Done: every sidecar stopped, no shared memory left behind.")
    return 0
  finally:
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def _launch(*, processes: int, devices_per_host: int, steps: int, global_batch_size: int,
            checkpoint_every: int, ckpt_dir: str, log_file: str | None) -> int:
  """``--processes N``: the training as N trainer processes, through ``sidecar launch``."""
  print(f"Launching {processes} trainer processes under jax.distributed, each beside its "
        f"own sidecar ({devices_per_host} CPU devices each), through `sidecar launch`.")
  quiet = log_file is not None
  with open(log_file or os.devnull, "a") as launcher_log:
    code = launch.run([sys.executable, "-m", "sidecar._src.tools.demo", str(steps),
                       str(global_batch_size), str(checkpoint_every), ckpt_dir,
                       *([log_file] if log_file else [])],
                      hosts=processes, devices_per_host=devices_per_host,
                      imports=[PIPELINES], shm_size="64MiB",
                      stderr=launcher_log if quiet else None)
  if code == INTERRUPTED:
    raise KeyboardInterrupt  # the launcher stopped every trainer and sidecar
  if code == 0:
    print("Done: every trainer and sidecar stopped, no shared memory left behind.")
  return code


def train(ctl, *, steps: int, global_batch_size: int, checkpoint_every: int, ckpt_dir: str,
          say=print) -> None:
  """The training: the same calls in one process that owns every device, or in each of N;
  its checkpoints in ``ckpt_dir`` (an empty directory every process sees), removed at the
  end."""
  for h in ctl.hosts:
    say(f"  host {h.host_id}: {h.address}, pid {h.pid}, devices {list(h.device_ids)}, "
        f"pipelines {list(h.pipelines)}")
  mesh = Mesh(np.array([d for d in jax.devices() if d.id in ctl.device_hosts]), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  params = jax.device_put(init_params(jax.random.key(0)), NamedSharding(mesh, P()))
  say(f"Training an MLP on the digits, global batch {global_batch_size} sharded over "
      f"{mesh.devices.size} devices of {jax.process_count()} process(es), {steps} steps:")
  progress = Progress(steps)
  ckpt = ctl.checkpointer(ckpt_dir, max_to_keep=2)
  blocked = []
  with ctl.feed("digits", kwargs={"split": "train"}, global_batch_size=global_batch_size,
                sharding=sharding, seed=0, options=options_lib.FeedOptions(prefetch=4)) as feed:
    t1 = time.perf_counter()
    for step in range(1, steps + 1):
      params, loss = train_step(params, next(feed))
      if step % checkpoint_every == 0 or step == steps:
        jax.block_until_ready(params)
        t = time.perf_counter()
        ckpt.save(step, {"params": params}, data_state=feed.state())
        blocked.append(time.perf_counter() - t)
      if step % 10 == 0 or step == steps:
        progress.update(step, f"loss {float(loss):.3f}")
    jax.block_until_ready(params)
    train_s = time.perf_counter() - t1
    stats = feed.stats()
    state = feed.state()
  progress.close()
  hits, total = evaluate(ctl, params, sharding)
  say(f"  final loss {float(loss):.3f}; test accuracy {hits / total:.1%} on {total} "
      "held-out digits")
  say(f"  {steps / train_s:.0f} steps/s; trainer waited for data {stats['wait_s_mean'] * 1e3:.2f}"
      f" ms per step on average (p50 {stats['wait_s_p50'] * 1e3:.2f} ms); data position "
      f"epoch {state['epoch']}, example {state['position']}")
  t = time.perf_counter()
  ckpt.wait(progress=lambda line: say("  " + line))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  say(f"Checkpoints: {len(blocked)} saves, the trainer blocked "
      f"{np.median(blocked) * 1e3:.1f} ms per save (median); the sidecars wrote them in "
      f"Orbax's layout to {ckpt_dir} (steps {ckpt.all_steps()}, the last durable "
      f"{(time.perf_counter() - t) * 1e3:.0f} ms after training ended); the demo removes "
      "that directory when it ends.")
  say(f"  (A state of {nbytes / 1024:.0f} KiB: the time blocked is the save's calls to "
      f"the {len(ctl.hosts)} sidecars, not a copy. save() returns once every sidecar took "
      "the step over: from then on it survives this process. Several hosts need a Begin, "
      "then a Stage on each; one host's first Stage begins the step, which "
      "benchmarks.save_return measures: about 5 ms here. A large state blocks for its "
      "copy into the arenas: docs/benchmarks.md.)")
  target = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)}
  t = time.perf_counter()
  restored = ckpt.restore(target=target, progress=lambda line: say("  " + line))["params"]
  restore_ms = (time.perf_counter() - t) * 1e3
  again, _ = evaluate(ctl, restored, sharding)
  same = all(np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)))
  say(f"  restored step {ckpt.latest_step()} from the sidecars' RAM tier in "
      f"{restore_ms:.0f} ms: {'bit-exact' if same else 'DIFFERENT'}, test accuracy "
      f"{again / total:.1%}; its data position: {ckpt.data_state()}")
  ckpt.close()
  ctl.peers.all_gather("demo/done", "")  # nobody reads the directory any more
  if ctl.process_index == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    say(f"  {'could not remove' if os.path.exists(ckpt_dir) else 'removed'} {ckpt_dir}")


def run_elastic(*, hosts: int, devices_per_host: int, steps: int,
                global_batch_size: int) -> int:
  """The demo's training on ``hosts`` hosts, one of which is SIGKILLed mid-way."""
  lost_host, kill_at, every = hosts - 1, steps // 2, max(steps // 10, 1)
  print(f"Elastic: {hosts} sidecar hosts, {devices_per_host} CPU devices each; host "
        f"{lost_host}'s sidecar is SIGKILLed at step {kill_at}, and training goes on on the "
        "others from the last checkpoint in host memory (each host's shards also live in a "
        "peer's arena: replicas=1).")
  ckpt_dir = tempfile.mkdtemp(prefix="sidecar-demo-elastic-")
  marks: dict[str, float] = {}
  try:
    with LocalCluster(hosts, devices_per_host, shm_size="64MiB", imports=[PIPELINES]) as cluster:
      with cluster.controller() as ctl:

        @elastic_lib.retry(ctl, min_hosts=hosts - 1)
        def train(live):
          mesh = Mesh(np.array(jax_elastic.devices(ctl, live)), ("data",))
          sharding = NamedSharding(mesh, P("data"))
          ckpt = ctl.checkpointer(ckpt_dir, max_to_keep=2, replicas=1)
          start, data, restarted = ckpt.latest_step(), None, "killed" in marks
          if start is None:
            params = jax.device_put(init_params(jax.random.key(0)), NamedSharding(mesh, P()))
            start = 0
          else:
            like = jax.device_put(init_params(jax.random.key(0)), NamedSharding(mesh, P()))
            with elastic_lib.phase("restore"):
              params = ckpt.restore(target={"params": jax.tree.map(
                  lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                  like)})["params"]
            data = ckpt.data_state() or {}
            print(f"  restarted on hosts {live}: restored step {start} "
                  f"({_sources(ckpt)}), data position {data.get('position')} of epoch "
                  f"{data.get('epoch')}")
          with ctl.feed("digits", kwargs={"split": "train"}, global_batch_size=global_batch_size,
                        sharding=sharding, seed=0, state=data or None,
                        options=options_lib.FeedOptions(prefetch=4)) as feed:
            for step in range(start + 1, steps + 1):
              if step == kill_at and "killed" not in marks:
                marks["killed"] = time.perf_counter()
                print(f"  step {step}: SIGKILL to host {lost_host}'s sidecar "
                      f"(pid {cluster.pid(lost_host)})")
                cluster.kill(lost_host)
              params, loss = train_step(params, next(feed))
              if restarted and "recovered" not in marks:
                jax.block_until_ready(params)
                marks["recovered"] = time.perf_counter()
              if step % every == 0:
                ckpt.save(step, {"params": params}, data_state=feed.state())
              if step % 50 == 0 or step == steps:
                print(f"  step {step} on hosts {live}: loss {float(loss):.3f}")
          ckpt.close()
          return params, mesh

        params, mesh = train()
        hits, total = evaluate(ctl, params, NamedSharding(mesh, P("data")))
        print(f"  final loss on {len(ctl.hosts)} hosts; test accuracy {hits / total:.1%} on "
              f"{total} held-out digits")
        for e in train.events:
          took = f" ({e.seconds:.3f} s)" if e.seconds is not None else ""
          print(f"  event: {e.kind}{': ' + e.detail if e.detail else ''}{took}, live hosts "
                f"{list(e.hosts)}")
        print(f"Recovery: {marks['recovered'] - marks['killed']:.2f} s from the SIGKILL to "
              "the first training step on the survivors (detect, cancel, restore, reopen "
              "the feed, recompile).")
  finally:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
  print("Done: every sidecar stopped, no shared memory left behind.")
  return 0


def _sources(ckpt) -> str:
  stats = ckpt.last_restore_stats()
  return ", ".join(f"{n} shards from {source}" for source, n in sorted(stats.shards.items()))


def main(argv: list[str]) -> int:
  """One trainer process of ``sidecar demo --processes N`` (started by ``sidecar launch``).

  ``argv``: steps, global batch size, checkpoint interval, the checkpoint directory, and
  the log file that takes everything but the story (log records, what JAX and Gloo print
  to stdout and stderr), if there is one.
  """
  story = sys.stdout
  if len(argv) > 4:  # the story keeps the launcher's pipe; file descriptors 1 and 2 go
    story = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    with open(argv[4], "a") as log:
      os.dup2(log.fileno(), sys.stdout.fileno())
      os.dup2(log.fileno(), sys.stderr.fileno())
  distributed.initialize()
  steps, global_batch_size, checkpoint_every = (int(a) for a in argv[:3])
  with Controller.from_env(timeout=60) as ctl:
    say = (lambda text: print(text, file=story, flush=True)) if ctl.process_index == 0 else (
        lambda *_: None)
    train(ctl, steps=steps, global_batch_size=global_batch_size,
          checkpoint_every=checkpoint_every, ckpt_dir=argv[3], say=say)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
