"""The environment variables of a process started by ``sidecar launch``, by name.

A leaf module: the standard library and errors only. The launcher sets these in each
trainer's environment; ``sidecar.distributed.initialize()``, ``Worker`` and
``Controller.from_env()`` read them. ``DESCRIPTIONS`` holds one line on each, for
``sidecar launch --help``. ``int_var`` and ``float_var`` read a number, with a clear error.
"""

from __future__ import annotations

import math
import os
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
# Read by Worker and Controller, never set by the launcher (so not in DESCRIPTIONS):
# seconds a silent sidecar is given before what waits on it ends with HostLostError.
PEER_TIMEOUT = "SIDECAR_PEER_TIMEOUT"

DEFAULT_PEER_TIMEOUT_S = 30.0
# Read by Controller: TLS to the sidecars' control ports (PEM files). TLS_CA verifies the
# sidecars' certificates; TLS_CLIENT_CERT and TLS_CLIENT_KEY are this side's, for mTLS.
TLS_CA = "SIDECAR_TLS_CA"
TLS_CLIENT_CERT = "SIDECAR_TLS_CLIENT_CERT"
TLS_CLIENT_KEY = "SIDECAR_TLS_CLIENT_KEY"


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


def float_var(env: Mapping[str, str], name: str, default: float, *, minimum: float,
              maximum: float | None = None) -> float:
  """The number in ``env[name]`` (``default`` when unset); above ``minimum``, at most ``maximum``.

  Raises:
    InvalidArgumentError: it is not a finite number or out of bounds; the message names the
      variable and what it holds.
  """
  text = env.get(name, "").strip()
  if not text:
    return default
  try:
    value: float | None = float(text)
  except ValueError:
    value = None
  if value is None or not math.isfinite(value) or value <= minimum or (
      maximum is not None and value > maximum):
    bounds = f"> {minimum:g}" + ("" if maximum is None else f" and <= {maximum:g}")
    raise errors.InvalidArgumentError(f"{name} must be a number of seconds {bounds}, got {text!r}")
  return value


def peer_timeout(value: float | None, env: Mapping[str, str] | None = None) -> float:
  """``value``, or ``$SIDECAR_PEER_TIMEOUT`` when None (30 s unset): how long a silent
  sidecar is waited on before it counts as lost.

  Raises:
    InvalidArgumentError: ``value`` or the variable is not a positive number of seconds.
  """
  if value is None:
    return float_var(os.environ if env is None else env, PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT_S,
                     minimum=0.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise errors.InvalidArgumentError(
        f"peer_timeout must be a positive number of seconds, got {value!r}")
  return float(value)
