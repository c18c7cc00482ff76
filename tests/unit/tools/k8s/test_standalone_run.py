"""Tier 1: docs/kubernetes.md's standalone `docker run` line serves where `-p` reaches it."""

import shlex

import pytest

from sidecar._src.core import options as options_lib
from sidecar._src.tools import cli
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

DOC = ROOT / "docs" / "kubernetes.md"
IMAGE = "REGISTRY/sidecar:TAG"


def _run_line() -> list[str]:
  lines = [ln for ln in DOC.read_text().splitlines()
           if ln.startswith(("docker run ", "podman run ")) and IMAGE in ln]
  assert len(lines) == 1, f"docs/kubernetes.md should give one standalone run line, got {lines}"
  return shlex.split(lines[0])


def _published(run: list[str]) -> set[int]:
  """The container ports that the run line's -p flags publish."""
  return {int(run[i + 1].rsplit(":", 1)[1]) for i, a in enumerate(run) if a == "-p"}


def test_the_docs_standalone_run_line_serves_on_the_published_ports():
  # issue 35 item 14: the image's default `serve` listens on the container's loopback, so
  # `podman run -p` reached nothing, and no doc gave a line that works.
  run = _run_line()
  image = run.index(IMAGE)
  engine, given = run[:image], run[image + 1:]
  assert given[0] == "serve", given
  args = cli.parser().parse_args(given)  # every flag is one `sidecar serve` takes
  token = "-e" in engine and engine[engine.index("-e") + 1] == "SIDECAR_TOKEN"
  assert token or args.token_file or args.insecure, "a non-loopback --listen needs a token"
  opts = options_lib.ServerOptions(listen=args.listen, port=args.port or options_lib.DEFAULT_PORT,
                                   health_port=args.health_port or options_lib.DEFAULT_HEALTH_PORT,
                                   socket_path=args.socket, insecure=args.insecure,
                                   token="t" * 32 if token else None)
  assert opts.listen not in (options_lib.LOOPBACK, "localhost", "::1"), opts.listen
  assert {opts.port, opts.health_port} <= _published(engine)
  # uid 1000 may write only its home in the image: /run/sidecar is root's.
  assert opts.socket_path.startswith("/home/sidecar/"), opts.socket_path


@pytest.mark.parametrize("section", ["loopback", "--listen 0.0.0.0", "--insecure"])
def test_the_doc_says_why_the_default_is_loopback(section):
  assert section in DOC.read_text()
