"""Options: frozen, keyword-only, validated when made."""

from __future__ import annotations

import dataclasses

MIN_SHM = 1 << 20
# Not 8470/8471: libtpu listens on 8471 inside TPU VMs and pods.
DEFAULT_PORT = 8490
DEFAULT_HEALTH_PORT = 8491


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
  """How one sidecar serves. Every field has a ``sidecar serve`` flag."""
  host_id: int = 0
  slice_id: int = 0
  device_ids: tuple[int, ...] = ()
  listen: str = "[::]"
  port: int = DEFAULT_PORT
  health_port: int = DEFAULT_HEALTH_PORT
  socket_path: str = "/run/sidecar/sidecar.sock"
  shm_size: int = 1 << 30
  token: str | None = None
  max_message_size: int = 256 << 20
  inline_limit: int = 64 << 10
  threads: int = 32
  imports: tuple[str, ...] = ()  # modules the sidecar imported; feed workers import them too

  def __post_init__(self):
    for name in ("host_id", "slice_id"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    for name in ("port", "health_port"):
      v = getattr(self, name)
      if not isinstance(v, int) or not 0 <= v <= 65535:
        raise ValueError(f"{name} must be a TCP port in [0, 65535] (0 picks a free one), got {v!r}")
    if self.port and self.port == self.health_port:
      raise ValueError(f"port and health_port must differ, both are {self.port}")
    if not isinstance(self.shm_size, int) or self.shm_size < MIN_SHM:
      raise ValueError(f"shm_size must be at least {MIN_SHM} bytes, got {self.shm_size!r}")
    if any(not isinstance(d, int) or d < 0 for d in self.device_ids):
      raise ValueError(f"device_ids must be non-negative ints, got {self.device_ids!r}")
    if not self.socket_path:
      raise ValueError("socket_path must name a Unix socket path, got an empty string")
    if self.token is not None and not self.token.strip():
      raise ValueError("token must be a non-empty string or None")
    if self.threads < 2:
      raise ValueError(f"threads must be at least 2, got {self.threads!r}")
    if self.inline_limit < 0 or self.max_message_size < 1 << 16:
      raise ValueError(
          f"inline_limit must be >= 0 and max_message_size >= 65536, got {self.inline_limit!r} "
          f"and {self.max_message_size!r}")
