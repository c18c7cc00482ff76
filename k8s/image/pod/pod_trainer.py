"""The pod test's trainer (k8s/image/test_pod.py runs it in the trainer container).

``python3 pod_trainer.py MODE`` prints one JSON line, ``RESULT {...}``, and exits 0:

- ``train``: map the arena through the socket volume, feed, save steps 1-3, restore step 3,
  read the sidecar's /metrics;
- ``hold``: save step 4 and wait until durable, print ``READY``, then read the feed until the
  sidecar is killed: the result names the error (HostLostError);
- ``restore``: a new controller (beside a restarted sidecar) restores the latest step;
- ``handshake``: only connect (the versions test runs it with other package versions).
"""

import json
import os
import sys
import time
import urllib.request

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import sidecar  # noqa: E402

GRPC = f"127.0.0.1:{os.environ.get('SIDECAR_PORT', '8490')}"  # the pod's one network
METRICS = f"http://127.0.0.1:{os.environ.get('SIDECAR_METRICS_PORT', '8492')}/metrics"
CKPT = "/ckpt/run"
BATCH = 8


def result(**fields) -> None:
  print("RESULT " + json.dumps(fields), flush=True)


def rows() -> NamedSharding:
  return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))


def state(step: int) -> dict:
  return {"w": jax.device_put(jnp.arange(4096, dtype=jnp.float32) * step, rows())}


def target() -> dict:
  return {"w": jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=rows())}


def connect() -> tuple[sidecar.jax.Controller, sidecar.jax.Worker]:
  # The worker attaches over the Unix socket of the shared volume ($SIDECAR_ADDRESS) and
  # receives the arena's memfd over it: no /dev/shm, no IPC namespace is shared.
  worker = sidecar.jax.Worker()
  return sidecar.jax.Controller([GRPC], workers={0: worker}), worker


def arena_mapped() -> bool:
  with open("/proc/self/maps") as f:
    return "memfd:sidecar-arena" in f.read()


def train() -> None:
  ctl, worker = connect()
  with ctl, worker:
    seen = []
    with ctl.feed("counting", global_batch_size=BATCH, sharding=rows()) as feed:
      for _, batch in zip(range(5), feed):
        seen.append(np.asarray(batch["i"]).tolist())
        assert np.array_equal(np.asarray(batch["x"])[:, 0], np.asarray(batch["i"]))
    ckpt = ctl.checkpointer(CKPT, max_to_keep=3)
    for step in (1, 2, 3):
      ckpt.save(step, state(step))
    ckpt.wait()
    restored = ckpt.restore(3, target=target())
    ok = bool(np.array_equal(np.asarray(restored["w"]), np.arange(4096, dtype=np.float32) * 3))
    steps = ckpt.all_steps()
    ckpt.close()
    metrics = urllib.request.urlopen(METRICS, timeout=10).read().decode()
    where = ctl.call("where")[0]
    result(batches=seen, restored_ok=ok, steps=steps, arena_mapped=arena_mapped(),
           sidecar_ipc=where["ipc"], trainer_ipc=os.readlink("/proc/self/ns/ipc"),
           sidecar_uid=where["uid"], trainer_uid=os.getuid(),
           metrics_lines=len(metrics.splitlines()),
           checkpoint_metrics="sidecar_checkpoint" in metrics or "sidecar.ckpt" in metrics,
           dev_shm=sorted(os.listdir("/dev/shm")))


def hold() -> None:
  ctl, worker = connect()
  with ctl, worker:
    ckpt = ctl.checkpointer(CKPT, max_to_keep=3)
    ckpt.save(4, state(4))
    ckpt.wait()  # durable: on /ckpt, committed
    with ctl.feed("counting", global_batch_size=BATCH, sharding=rows()) as feed:
      next(feed)
      print("READY", flush=True)
      deadline = time.monotonic() + 120
      try:
        while time.monotonic() < deadline:
          next(feed)
          time.sleep(0.05)
      except sidecar.HostLostError as e:
        result(error=type(e).__name__, message=str(e)[:500])
        return
      except Exception as e:  # the wrong error: the test says which
        result(error=type(e).__name__, message=str(e)[:500])
        return
    result(error=None)


def restore() -> None:
  ctl, worker = connect()
  with ctl, worker:
    ckpt = ctl.checkpointer(CKPT, max_to_keep=3)
    step = ckpt.latest_step()
    restored = ckpt.restore(step, target=target())
    ok = bool(np.array_equal(np.asarray(restored["w"]),
                             np.arange(4096, dtype=np.float32) * step))
    ckpt.close()
    result(step=step, restored_ok=ok, steps=ckpt.all_steps())


def handshake() -> None:
  try:
    ctl = sidecar.jax.Controller([GRPC])
  except sidecar.SidecarError as e:
    result(error=type(e).__name__, message=str(e))
    return
  ctl.close()
  result(error=None)


if __name__ == "__main__":
  {"train": train, "hold": hold, "restore": restore, "handshake": handshake}[sys.argv[1]]()
