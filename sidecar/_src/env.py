"""The environment variables of a process started by ``sidecar launch``, by name.

A leaf module: the standard library and errors only. The launcher sets these in each
trainer's environment; ``sidecar.distributed.initialize()``, ``Worker`` and
``Controller.from_env()`` read them. ``DESCRIPTIONS`` holds one line on each, for
``sidecar launch --help``. ``int_var`` reads an integer variable, with a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar._src import errors

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


def int_var(env: Mapping[str, str], name: str, default: int | None, *, minimum: int,
            maximum: int | None = None) -> int:
  """The integer in ``env[name]`` (``default`` when unset, if there is one).

  Raises:
    InvalidArgumentError: it is unset with no default, not an integer, or out of bounds;
      the message names the variable and what it holds.
  """
  text = env.get(name, "").strip()
  if not text and default is not None:
    return default
  try:
    value: int | None = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum or (maximum is not None and value > maximum):
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    raise errors.InvalidArgumentError(f"{name} must be an integer {bounds}, got {text!r}")
  return value
