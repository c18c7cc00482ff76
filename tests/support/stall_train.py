"""A trainer for ``sidecar launch --stall-timeout``: it trains, then hangs (or worse).

Run as ``sidecar launch --hosts N --import tests.support.feed_fns --stall-timeout S --
python -m tests.support.stall_train DIR HOW HANGS [S [RANK]]``. It takes one batch of the
``ids`` feed per step (each step sleeps STEP_S), saves every SAVE_EVERY steps into DIR (the
goodput ledger's directory), and after step HANG_AT, while ``SIDECAR_RESTART`` is below
HANGS, does HOW (only process RANK where given: the others go on until it hangs, waiting
meanwhile in a long phase, ``ctl.phase``, then take one more step and wait for it in a
blocked call, as in a collective: idle too, but stalled after it; with
``STALL_TRAIN_WAIT=phase``, still in a long phase, never stalled):

- ``sleep``: hangs for good in ``time.sleep`` (in :func:`hang_in_sleep`); ``recv``: in a
  socket read that never returns (in :func:`hang_in_recv`), both C calls;
- ``wakes``: hangs until the launcher's stacks signal comes, writes its stacks itself, and
  steps on at once (a trainer that stepped while its stacks were written);
- ``slow``: every life's first step takes 3x S (its "compile", after its first batch was
  taken), step 3 is a long phase (``ctl.phase``, 2x S, budget 4x S), and after HANG_AT the
  trainer is SIGKILLed (a crash; issue 69's compile taken for a hang);
- ``raise``: step HANG_AT raises the same error in every life (a deterministic bug).

A second thread waits meanwhile (in :func:`side_thread`): the stacks printed must show every
thread. It prints ``RESULT {json}`` lines: each step and the end.
"""

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time

STEPS, STEP_S, SAVE_EVERY, HANG_AT = 12, 0.05, 4, 6


def hang_in_sleep() -> None:
  time.sleep(3600)


def hang_in_recv() -> None:
  a, b = socket.socketpair()
  a.recv(1)  # b never writes


def hang_until_signalled() -> None:
  """Until the stacks signal: its stacks written (as faulthandler would), then on."""
  woken = threading.Event()
  sig = signal.Signals[os.environ.get("SIDECAR_STACKS_SIGNAL", "SIGUSR2")]
  faulthandler.unregister(sig)  # the Worker's: this trainer writes them itself

  def on_signal(signum, frame):
    faulthandler.dump_traceback(all_threads=True)
    woken.set()
  signal.signal(sig, on_signal)
  while not woken.wait(0.01):
    pass


def side_thread(stop: threading.Event) -> None:
  stop.wait()


def main(directory: str, how: str, hangs: str, stall_s: str = "8", rank: str = "") -> int:
  import sidecar
  sidecar.jax.initialize()  # a job of several processes (RANK): their JAX runtime

  import jax
  import numpy as np

  restart = int(os.environ.get("SIDECAR_RESTART", "0"))
  marker = f"{directory}.hanging{restart}"  # the hanging rank's word to the others
  hangs_here = not rank or rank == os.environ.get("SIDECAR_PROCESS_ID", "0")

  def emit(kind, **fields):
    print("RESULT " + json.dumps({"kind": kind, "restart": restart, "pid": os.getpid(),
                                  **fields}), flush=True)

  stop = threading.Event()
  side = threading.Thread(target=side_thread, args=(stop,), name="side")
  side.start()
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("data",)),
                                        jax.sharding.PartitionSpec("data"))
  try:
    with sidecar.jax.Controller.from_env(timeout=60) as ctl:
      ckpt = ctl.checkpointer(directory, max_to_keep=2)
      first = 0
      if (latest := ckpt.latest_step()) is not None:
        first = int(ckpt.restore(latest, target={"step": np.int32(0)})["step"])
      with ctl.feed("ids", kwargs={"n": 1 << 20}, global_batch_size=4,
                    sharding=sharding) as feed:
        for step in range(first + 1, STEPS + 1):
          next(feed)
          time.sleep(STEP_S)
          if how == "slow" and step == first + 1:
            time.sleep(3 * float(stall_s))  # its first step's compile, after batch 1
          if how == "slow" and step == 3:
            with ctl.phase("eval", budget_s=4 * float(stall_s)):
              time.sleep(2 * float(stall_s))
          if how == "raise" and step == HANG_AT:
            raise RuntimeError(f"a bug in step {step}")
          if step % SAVE_EVERY == 0:
            ckpt.save(step, {"step": np.int32(step)}).durable.result()
          emit("step", step=step)
          if step == HANG_AT and restart < int(hangs) and hangs_here:
            emit("hanging", step=step)
            open(marker, "w").close()
            if how == "slow":
              os.kill(os.getpid(), signal.SIGKILL)
            {"sleep": hang_in_sleep, "recv": hang_in_recv,
             "wakes": hang_until_signalled}[how]()
          elif step == HANG_AT and restart < int(hangs):  # another rank hangs: wait for it
            with ctl.phase("eval", budget_s=100 * float(stall_s)):
              while not os.path.exists(marker):
                time.sleep(0.01)
            next(feed)  # one more step, after its last one
            emit("waiting", step=step)
            if os.environ.get("STALL_TRAIN_WAIT") == "phase":  # still waiting, declared
              with ctl.phase("eval", budget_s=100 * float(stall_s)):
                hang_in_sleep()
            hang_in_sleep()
      ckpt.close()
  finally:
    stop.set()
    side.join()
  emit("done")
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
