"""The environment variables of a process started by ``sidecar launch``, by name.

A leaf module: stdlib only. The launcher sets these in each trainer's environment;
``sidecar.distributed.initialize()``, ``Worker`` and ``Controller.from_env()`` read them.
``DESCRIPTIONS`` holds one line on each, for ``sidecar launch --help``.
"""

from __future__ import annotations

DESCRIPTIONS: dict[str, str] = {}


def _var(name: str, description: str) -> str:
  DESCRIPTIONS[name] = description
  return name


COORDINATOR_ADDRESS = _var("SIDECAR_COORDINATOR_ADDRESS",
                           "the jax.distributed coordinator (process 0 runs it), host:port")
NUM_PROCESSES = _var("SIDECAR_NUM_PROCESSES", "how many trainer processes the job has")
PROCESS_ID = _var("SIDECAR_PROCESS_ID", "this trainer's process index, 0..NUM_PROCESSES-1")
LOCAL_DEVICES = _var("SIDECAR_LOCAL_DEVICES", "how many CPU devices this process owns")
HOST_ID = _var("SIDECAR_HOST_ID", "the host id of this process's sidecar")
SLICE_ID = _var("SIDECAR_SLICE_ID", "the slice id of this process's sidecar")
ADDRESS = _var("SIDECAR_ADDRESS", "unix://PATH of this host's sidecar worker socket")
HOSTS = _var("SIDECAR_HOSTS", "every sidecar, in host order: HOST:PORT:HEALTH_PORT,...")
RESTART = _var("SIDECAR_RESTART", "how often --elastic restarted the job: 0 on the first start")
TOKEN = _var("SIDECAR_TOKEN", "the sidecars' bearer token, when they have one")
TOKEN_FILE = _var("SIDECAR_TOKEN_FILE", "a file holding the bearer token (read if no TOKEN)")
