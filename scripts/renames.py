# ruff: noqa: E501
"""Issue 43 items 5 and 6: names with one meaning, one public door per name, tests named
after their module. Run once on the merged tree, from the repository root:

  python scripts/renames.py            # renames, then prints every file it changed
  python scripts/renames.py --check    # changes nothing; exit 1 if anything is left to do

Idempotent: a second run changes nothing (each group is guarded by the old name's
definition, so a rename whose new name another group frees, ``Sidecars``, is not applied
twice). Word-bounded throughout. In Python files, identifiers are renamed as tokens (names in
code and in f-string braces), never inside string literals or comments, except within
backticks (``Hosts``, :class:`Hosts`); names with no other meaning (constants, private
helpers, module paths) are renamed everywhere, strings included (``monkeypatch.setattr(
staging, "STAGE_PART_BYTES", ...)``). Markdown: inline code and fenced blocks.

What is kept, and why (wire, files on disk, flags and environment stay compatible):
  * proto messages and fields (``ckpt_pb.Peer``, ``ReplicaPart``, ``DcpPart``, ``CallPart``,
    the ``format_part`` oneof, the ``CallParts`` rpc): renaming them changes the wire and
    the committed generated code; Python names around them change instead.
  * ``--peer-token-file``, ``SIDECAR_PEER_TOKEN[_FILE]``, ``SIDECAR_PEER_TIMEOUT``, the
    ``sidecar-peer`` metadata key, the ``peer-token`` rendezvous file, the k8s Secret
    ``sidecar-peer-token`` (and ``peer_token_secret``, the k8s render option that names it),
    ``args.peer_token_file`` (argparse's name for the flag): what operators and manifests
    already use; and env.py's and rendezvous.py's constants that mirror those names
    (``PEER_TOKEN``, ``PEER_TOKEN_FILE``, ``PEER_TIMEOUT``: env.py's table is keyed by them).
  * the JSON key ``"peer_token"`` inside a replica link's attach token (``ReplicaAttach``):
    sidecars of two versions in one job still understand each other.
  * gRPC's and the kernel's own names (``context.peer()``, ``SO_PEERCRED``); ours for the
    other end of a connection change: ``server/limits.peer_of`` becomes ``connection_of``,
    the Unix-socket credentials ``ipc.Peer`` become ``ipc.Ucred`` (``ucred_of``,
    ``check_server``), ``sockets.peer_pid`` ``client_pid``.

Lines marked ``!`` need a hand: a line still past 100 columns, an exact edit whose text
changed since. Then: ``ruff check .``, ``mypy``, the suite; then delete this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Callable

ROOTS = ("sidecar", "tests", "benchmarks", "examples", "docs", "k8s", "pipelines", "scripts")
TOP_FILES = ("README.md", "ARCHITECTURE.md", "CONTRIBUTING.md", "CHANGELOG.md", "pyproject.toml",
             "Dockerfile")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".ipynb")
NEVER = ("sidecar/v1/", "scripts/renames.py")  # generated code; this script
PB = re.compile(r"(?:\bpb|_pb|_pb2)\s*\.\s*$")  # a name after ``pb.``: a proto message

# ---- module moves: (old path, new path) ------------------------------------------------

MOVES = [
    ("sidecar/_src/controller/hosts.py", "sidecar/_src/controller/sidecars.py"),
    ("sidecar/_src/server/checkpoint/host.py", "sidecar/_src/server/checkpoint/checkpoints.py"),
    ("sidecar/_src/server/feeds/pool.py", "sidecar/_src/server/feeds/processes.py"),
    # Tests named after the module they test (item 6).
    ("tests/unit/controller/test_hosts.py", "tests/unit/controller/test_sidecars.py"),
    ("tests/unit/controller/test_feed_logic.py", "tests/unit/controller/test_feed.py"),
    ("tests/unit/controller/checkpoint/test_protocol.py",
     "tests/unit/controller/checkpoint/test_save_protocol.py"),
    ("tests/unit/server/checkpoint/test_step_writer.py", "tests/unit/server/checkpoint/test_save.py"),
    ("tests/unit/server/feeds/test_batches.py", "tests/unit/server/feeds/test_producer.py"),
    ("tests/unit/torch/test_launcher_env.py", "tests/unit/torch/test_distributed.py"),
    ("tests/unit/tools/slurm/test_trainer_env.py", "tests/unit/tools/slurm/test_tasks.py"),
]


def _dotted(path: str) -> str:
  return path.removesuffix(".py").replace("/", ".")


# ---- renames ---------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
  """Renames that go together, applied only while ``pending`` (the old names) holds."""
  name: str
  pending: Callable[[dict[str, str]], bool]
  code: dict[str, str] = dataclasses.field(default_factory=dict)  # names, as tokens
  text: dict[str, str] = dataclasses.field(default_factory=dict)  # everywhere, word-bounded
  # (regex, repl) or (regex, repl, a path regex of files it skips)
  raw: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
  # {file-name regex: {old: new}} names renamed as tokens in matching files only
  scoped: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
  not_after_pb: frozenset[str] = frozenset()  # names also a proto message's: not after pb.
  # {text regex: {old: new}}: names renamed as tokens in files whose text matches
  scoped_if: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


def _defines(files: dict[str, str], pattern: str, where: str = "sidecar/_src/") -> bool:
  rx = re.compile(pattern, re.M)
  return any(p.startswith(where) and rx.search(t) for p, t in files.items())


GROUPS = [
    # `host` is a machine index. The sidecars a controller reaches: `Sidecars` (was
    # controller/hosts.Hosts); the checkpointer's frozen view of them: `SidecarsSnapshot`
    # (was controller/checkpoint/sidecars.Sidecars). The sidecar's checkpoint object, which
    # owns writer, RAM tier, replicator and reader: `Checkpoints` (was CheckpointHost).
    Group(
        "sidecars",
        lambda f: _defines(f, r"^class Hosts\b"),
        code={"Hosts": "Sidecars", "Sidecars": "SidecarsSnapshot"},
        raw=[(r"(?<=\.)_hosts(?=\.conns\b)", "_sidecars"),
             (r"\bcontroller\.hosts\.Hosts\b", "controller.sidecars.Sidecars")],
        scoped={r"^sidecar/_src/controller/controller\.py$": {"_hosts": "_sidecars"}},
    ),
    Group(
        "checkpoints",
        lambda f: _defines(f, r"^class CheckpointHost\b"),
        text={"CheckpointHost": "Checkpoints"},
    ),
    # `Pool` is a pool's tenants only; a feed's worker processes are `FeedProcesses`.
    Group(
        "feed-processes",
        lambda f: _defines(f, r"^class Pool\b", "sidecar/_src/server/feeds/"),
        text={"feed_pool": "feed_processes"},
        raw=[(r"(from sidecar\._src\.server\.feeds import [^\n]*?)\bpool as feed_processes\b",
              r"\1processes as feed_processes"),
             (r"\bfeed_processes\.Pool\b", "feed_processes.FeedProcesses")],
        scoped={r"^sidecar/_src/server/feeds/(pool|processes)\.py$": {"Pool": "FeedProcesses"}},
    ),
    # `peer` is one of a job's trainer processes (controller/peers.Peers, JaxPeers,
    # TorchPeers). A sidecar that holds another's replicas is reached over a replica link,
    # with the replica token; a worker waits `silence_timeout` on a silent sidecar.
    Group(
        "replica-links",
        lambda f: _defines(f, r"^class PeerAttach\b"),
        code={"peer_token": "replica_token"},
        text={"PeerAttach": "ReplicaAttach", "PEER_KEY": "REPLICA_KEY",
              "PEER_TOKEN_DIR": "REPLICA_TOKEN_DIR",
              "is_peer": "is_replica_link", "_is_peer": "_is_replica_link",
              "_no_peer": "_no_replica_link", "_check_not_peer": "_check_not_replica_link",
              "_peer_sessions": "_replica_sessions", "_peer_tenant": "_replica_tenant",
              "_peer_token": "_replica_token"},
        # "peer_token" as a string names the option (getattr, kw.setdefault), except the JSON
        # key of a replica link's attach token (tenants.py), which stays for the wire.
        raw=[(r"""(["'])peer_token\1""", '"replica_token"', r"(^|/)tenants\.py$")],
        scoped={r"^sidecar/_src/server/service\.py$": {"_peer": "_replica_bearer"},
                # the replica links' TLS (not a Unix socket's credentials, SO_PEERCRED)
                r"^sidecar/_src/server/(server|checkpoint/(links|host|checkpoints|tenant_checks))\.py$":
                    {"peer_credentials": "replica_credentials"},
                r"^sidecar/_src/server/(pool/)?tenants\.py$": {"_peer": "_replica_token"}},
    ),
    Group(
        "sidecar-timeout",
        lambda f: _defines(f, r"\bpeer_timeout\b"),
        text={"peer_timeout": "silence_timeout",
              "DEFAULT_PEER_TIMEOUT_S": "DEFAULT_SILENCE_TIMEOUT_S"},
    ),
    Group(
        "socket-credentials",
        lambda f: _defines(f, r"^class Peer\b", "sidecar/_src/wire/"),
        text={"check_peer": "check_server", "peer_pid": "client_pid", "_peer_uid": "_client_uid",
              "_peer_open": "_client_open"},
        raw=[(r"\bipc\.Peer\b", "ipc.Ucred"), (r"\bipc\.peer_of\b", "ipc.ucred_of")],
        scoped_if={r"from sidecar\._src\.wire\.ipc import[^\n]*\bpeer_of\b": {"peer_of": "ucred_of"},
                   r"from sidecar\._src\.wire\.ipc import[^\n]*\bPeer\b": {"Peer": "Ucred"}},
        scoped={r"^sidecar/_src/wire/ipc\.py$": {"Peer": "Ucred", "peer_of": "ucred_of"},
                r"^sidecar/_src/server/(pool/)?limits\.py$": {"peer_of": "connection_of"},
                r"^sidecar/_src/server/service\.py$": {"peer_of": "connection_of"}},
    ),
    # `part` had five meanings: (1) one host's (or one rank's) share of a step, the files it
    # writes (write_host_part, write_rank_part, DcpPart); (2) a format's typed data on a Stage
    # or Commit request (the `format_part` oneof, STAGE_PARTS); (3) some bytes of a shard or
    # of a message in transit (ReplicaPart, links._Part, CallPart, calls._InParts); (4) the
    # shards a save hands on together (staging.Parts, STAGE_PART_BYTES); (5) a component
    # ("the checkpoint parts of one sidecar"). `part` keeps (1); (2) is a format's `extra`
    # (as Format.manifest_extras), (3) a `piece`, (4) a `lot`; (5) is prose, left to review.
    # On the wire, the proto names stay (`format_part`, ReplicaPart, CallPart, CallParts).
    Group(
        "parts",
        lambda f: _defines(f, r"^class (ReplicaPart|Parts|_Part|_InParts)\b"),
        code={"ReplicaPart": "ReplicaPiece", "Parts": "Lots"},
        text={"STAGE_PART_BYTES": "STAGE_LOT_BYTES", "STAGE_PARTS": "STAGE_EXTRAS",
              "COMMIT_PARTS": "COMMIT_EXTRAS", "format_part_to_pb": "format_extra_to_pb",
              "format_part_from_pb": "format_extra_from_pb", "READ_PART_BYTES": "READ_PIECE_BYTES",
              "_read_parts": "_read_pieces"},
        scoped={r"^sidecar/_src/server/checkpoint/links\.py$": {"_Part": "_Piece"},
                r"^sidecar/_src/controller/calls\.py$": {"_InParts": "_InPieces"}},
        raw=[(r"\b(links(?:_lib)?)\._Part\b", r"\1._Piece"),
             (r"\b(calls(?:_lib)?)\._InParts\b", r"\1._InPieces")],
        not_after_pb=frozenset({"ReplicaPart"}),
    ),
    # core/progress and controller/progress were one module under two names: core's stays
    # (the arena's Worker, below the controller, uses it too).
    Group(
        "progress",
        lambda f: "sidecar/_src/controller/progress.py" in f,
        raw=[(r"(?m)^(from sidecar\._src\.controller import [^\n(]*?), progress as progress_lib(.*)$",
              r"\1\2\nfrom sidecar._src.core import progress as progress_lib"),
             (r"\bfrom sidecar\._src\.controller import progress\b",
              "from sidecar._src.core import progress"),
             (r"(?<![\w.])sidecar\._src\.controller\.progress\b", "sidecar._src.core.progress"),
             (r"(?<![\w./])(sidecar/_src/)?controller/progress\.py\b", r"\1core/progress.py")],
    ),
    # One public door per name: JAX's Controller, Worker, initialize, is_initialized and
    # JaxPeers in sidecar.jax (as PyTorch's are in sidecar.torch); CheckpointOptions and
    # FeedOptions (both frameworks') in sidecar; sidecar.distributed keeps the framework-free
    # Peers and LocalPeers.
    Group(
        "doors",
        lambda f: '"Controller": "sidecar._src.jax.controller"' in f.get("sidecar/__init__.py", ""),
        raw=[(r"(?<![\w.])sidecar\.(Controller|Worker)\b", r"sidecar.jax.\1"),
             (r"(?<![\w.])sidecar\.distributed\.(initialize|is_initialized|JaxPeers)\b",
              r"sidecar.jax.\1"),
             (r"(?<![\w.])sidecar\.torch\.CheckpointOptions\b", "sidecar.CheckpointOptions"),
             (r"(?<![\w.])sidecar\.jax\.FeedOptions\b", "sidecar.FeedOptions")],
    ),
]


# ---- rewriting -------------------------------------------------------------------------

BACKTICKS = re.compile(r"``[^`\n]+``|`[^`\n]+`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
FSTRING_EXPR = re.compile(r"\{[^{}\n]*\}")
ARG_ENTRY = re.compile(r"(?m)^(\s+)(\w+)(?=(?: \([^)\n]*\))?: )")
WIDTH = 100


def _word_sub(mapping: dict[str, str], text: str, not_after_pb: frozenset[str] = frozenset()
              ) -> str:
  if not mapping:
    return text
  rx = re.compile(r"(?<![\w$])(" + "|".join(map(re.escape, sorted(mapping, key=len,
                                                                     reverse=True))) + r")\b")

  def one(m: re.Match) -> str:
    if m.group(1) in not_after_pb and PB.search(text[max(0, m.start() - 12):m.start()]):
      return m.group(0)
    return mapping[m.group(1)]

  return rx.sub(one, text)


def _in_backticks(mapping: dict[str, str], text: str, not_after_pb: frozenset[str]) -> str:
  return BACKTICKS.sub(lambda m: _word_sub(mapping, m.group(0), not_after_pb), text)


def _python(text: str, mapping: dict[str, str], not_after_pb: frozenset[str]) -> str:
  """``mapping`` applied to NAME tokens, f-string braces, and backticks in strings/comments."""
  if not mapping:
    return text
  try:
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
  except (tokenize.TokenError, SyntaxError, IndentationError):
    return _word_sub(mapping, text, not_after_pb)
  lines = text.splitlines(keepends=True)
  starts = [0]
  for line in lines:
    starts.append(starts[-1] + len(line))
  edits: list[tuple[int, int, str]] = []
  for tok in tokens:
    a = starts[tok.start[0] - 1] + tok.start[1]
    b = starts[tok.end[0] - 1] + tok.end[1]
    if tok.type == tokenize.NAME:
      new = mapping.get(tok.string)
      if new is not None and not (tok.string in not_after_pb and PB.search(text[max(0, a - 12):a])):
        edits.append((a, b, new))
    elif tok.type in (tokenize.STRING, tokenize.COMMENT):
      s = tok.string
      if tok.type == tokenize.STRING and "f" in s[:s.find(s[-1])].lower():
        s = FSTRING_EXPR.sub(lambda m: _word_sub(mapping, m.group(0), not_after_pb), s)
      s = _in_backticks(mapping, s, not_after_pb)
      if tok.type == tokenize.STRING and s.endswith(('"""', "'''")):  # Args: name: ...
        s = ARG_ENTRY.sub(lambda m: m.group(1) + mapping.get(m.group(2), m.group(2)), s)
      if s != tok.string:
        edits.append((a, b, s))
  for a, b, new in reversed(edits):
    text = text[:a] + new + text[b:]
  return text


def _markdown(text: str, mapping: dict[str, str], not_after_pb: frozenset[str]) -> str:
  out, last = [], 0
  for m in FENCE.finditer(text):
    out.append(_in_backticks(mapping, text[last:m.start()], not_after_pb))
    out.append(_word_sub(mapping, m.group(0), not_after_pb))
    last = m.end()
  out.append(_in_backticks(mapping, text[last:], not_after_pb))
  return "".join(out)


def _wrap(old: str, new: str) -> str:
  """Lines the renames pushed past ``WIDTH`` in a Python file, wrapped: code at its last
  ", " inside brackets (aligned under the bracket), a comment or docstring at a space."""
  kept = set(old.splitlines())
  carry_lead = ""
  try:
    tokens = list(tokenize.generate_tokens(io.StringIO(new).readline))
  except (tokenize.TokenError, SyntaxError, IndentationError):
    return new
  in_string = {r for t in tokens if t.type == tokenize.STRING and t.string.endswith(('"""', "'''"))
               for r in range(t.start[0] + (not t.line[:t.start[1]].isspace() and t.start[1] > 0),
                              t.end[0] + 1)}
  out: list[str] = []
  carry = ""  # words a wrapped docstring or comment line pushed onto its next line
  for row, line in enumerate(new.splitlines(keepends=True), 1):
    body = line.rstrip("\n")
    if carry:
      lead = body[:len(body) - len(body.lstrip())]
      if row in in_string and body.strip() and not body.strip().startswith(('"""', "'''")):
        body = lead + carry + " " + body.lstrip()
      else:
        out.append(carry_lead + carry + "\n")
      carry = ""
    if len(body) <= WIDTH or body in kept:
      out.append(body + line[len(line.rstrip("\n")):])
      continue
    wrapped = _wrap_line(body, row in in_string)
    if wrapped is None:
      print(f"  ! a line past {WIDTH} columns, wrap it by hand: {body.strip()[:60]!r}")
      out.append(body + line[len(line.rstrip("\n")):])
    elif row in in_string:
      first, rest = wrapped.split("\n", 1)
      carry_lead = rest[:len(rest) - len(rest.lstrip())]
      carry = rest.lstrip()
      out.append(first + "\n")
    else:
      out.append(wrapped + line[len(line.rstrip("\n")):])
  if carry:
    out.append(carry_lead + carry + "\n")
  return "".join(out)


def _wrap_line(body: str, in_string: bool) -> str | None:
  indent = body[:len(body) - len(body.lstrip())]
  if in_string or body.lstrip().startswith("#"):
    lead = indent + ("# " if body.lstrip().startswith("#") else "")
    cut = body.rfind(" ", len(lead) + 1, WIDTH + 1)
    return None if cut < 0 else body[:cut] + "\n" + lead + body[cut + 1:]
  opens: list[int] = []
  best = None
  quote = None
  for i, c in enumerate(body[:WIDTH]):
    if quote:
      quote = None if c == quote else quote
    elif c in "\"'":
      quote = c
    elif c in "([{":
      opens.append(i)
    elif c in ")]}":
      opens and opens.pop()
    elif c == "," and opens and body[i + 1:i + 2] == " ":
      best = (i, opens[-1])
  if best is None:
    return None
  i, col = best
  return body[:i + 1] + "\n" + " " * (col + 1) + body[i + 2:]


def rewrite(path: str, text: str, groups: list[Group]) -> str:
  for g in groups:
    code = dict(g.code)
    for pattern, names in g.scoped.items():
      if re.search(pattern, path):
        code.update(names)
    for pattern, names in g.scoped_if.items():
      if re.search(pattern, text):
        code.update(names)
    if path.endswith(".py"):
      text = _python(text, code, g.not_after_pb)
    elif path.endswith(".md"):
      text = _markdown(text, code, g.not_after_pb)
    text = _word_sub(g.text, text)
    for pattern, repl, *skip in g.raw:
      if not (skip and re.search(skip[0], path)):
        text = re.sub(pattern, repl, text)
  return text


def _module_paths(text: str, moves: list[tuple[str, str]]) -> str:
  """``sidecar._src.controller.hosts``, ``sidecar/_src/controller/hosts.py`` and any tail of
  that path of two names or more (``controller/hosts.py``, ``checkpoint/host.py``)."""
  for old, new in moves:
    text = re.sub(r"(?<![\w.])" + re.escape(_dotted(old)) + r"(?!\w)", _dotted(new), text)
    parts_old, parts_new = old.split("/"), new.split("/")
    for i in range(len(parts_old) - 1):
      tail_old, tail_new = "/".join(parts_old[i:]), "/".join(parts_new[i:])
      text = re.sub(r"(?<![\w./])" + re.escape(tail_old) + r"\b", tail_new, text)
      # `controller/hosts.Hosts`: a module's path, then a name in it
      text = re.sub(r"(?<![\w./])" + re.escape(tail_old.removesuffix(".py")) + r"(?=\.[A-Z_])",
                    tail_new.removesuffix(".py"), text)
  return text


# ---- the public modules (one door each) ------------------------------------------------

ARCH = "ARCHITECTURE.md"
# Exact edits, by group: text only this script's author's files hold (the public modules,
# their pinning test, ARCHITECTURE.md's Layout), after the group's rules ran on them.
EDITS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "sidecars": {ARCH: [
        ("), hosts (the\n", "), sidecars (the\n"),
        ("\n`scripts/renames.py` (issue 43) gives the code these words; until it has run, the names in\n"
         "backquotes above are the old ones.\n", ""),
    ]},
    "checkpoints": {ARCH: [("service (gRPC), host (what owns the parts",
                            "service (gRPC), checkpoints (what owns the parts")]},
    "feed-processes": {ARCH: [("producer (a host's part of a feed), pool\n",
                               "producer (a host's part of a feed), processes\n")]},
    "progress": {ARCH: [(", elastic, progress\n    checkpoint/", ", elastic\n    checkpoint/")]},
}
DOOR_EDITS: dict[str, list[tuple[str, str]]] = {
    "sidecar/__init__.py": [
        ("  from sidecar._src.jax.controller import Controller\n  from sidecar._src.jax.worker"
         " import Worker\n", ""),
        ("# ``Controller`` and ``Worker`` are JAX's (``sidecar.jax``'s, kept here for compatibility):\n"
         "# without the ``jax`` extra, naming them says which extra to install.\n",
         "# JAX's ``Controller`` and ``Worker`` are ``sidecar.jax``'s, PyTorch's ``sidecar.torch``'s:\n"
         "# one door each (``_MOVED`` says where a name that left the root went).\n"),
        ('    "Controller": "sidecar._src.jax.controller",\n', ""),
        ('    "Worker": "sidecar._src.jax.worker",\n', ""),
        ('    "Controller",\n', ""),
        ('    "Worker",\n', ""),
        ('_SUBMODULES = ("distributed", "elastic", "testing")\n',
         '_SUBMODULES = ("distributed", "elastic", "testing")\n'
         '_MOVED = {"Controller": "sidecar.jax.Controller (PyTorch: sidecar.torch.Controller)",\n'
         '          "Worker": "sidecar.jax.Worker"}\n'),
        ('    raise AttributeError(f"module \'sidecar\' has no attribute {name!r}")\n',
         '    if name in _MOVED:\n'
         '      raise AttributeError(f"sidecar.{name} is {_MOVED[name]}: import sidecar.jax")\n'
         '    raise AttributeError(f"module \'sidecar\' has no attribute {name!r}")\n'),
    ],
    "sidecar/jax.py": [
        ('"""JAX through the sidecars: the Controller, the Worker, multi-controller JAX.\n\n'
         "``sidecar.jax`` stands beside ``sidecar.torch``; ``sidecar.jax.Controller`` and\n"
         "``sidecar.jax.Worker`` are the same classes, kept there for compatibility. Needs the\n",
         '"""JAX through the sidecars: the Controller, the Worker, multi-controller JAX.\n\n'
         "``sidecar.jax`` stands beside ``sidecar.torch``: each framework's Controller and Worker\n"
         "are reached there and nowhere else (``sidecar.FeedOptions`` and\n"
         "``sidecar.CheckpointOptions`` are both frameworks'). Needs the\n"),
        ("from sidecar._src.core.options import FeedOptions\n", ""),
        ('__all__ = ["Controller", "FeedOptions", "JaxPeers", "Worker", "initialize", "is_initialized"]',
         '__all__ = ["Controller", "JaxPeers", "Worker", "initialize", "is_initialized"]'),
    ],
    "sidecar/distributed.py": [
        ('"""Multi-controller JAX: one trainer process per host under ``jax.distributed``.\n\n'
         "Example::\n\n  import sidecar\n  sidecar.jax.initialize()         # before any other JAX call\n"
         "  ctl = sidecar.jax.Controller.from_env()      # every sidecar; this process drives its own host\n"
         '"""\n',
         '"""A job\'s trainer processes (its peers), whatever the framework: what agrees across them.\n\n'
         "``Peers`` is what a controller asks of them (how many, which is this one, a barrier, one\n"
         "value agreed); ``LocalPeers`` is a job of one process. JAX's are ``sidecar.jax.JaxPeers``\n"
         "(``sidecar.jax.initialize()``), PyTorch's ``sidecar.torch.TorchPeers``.\n\n"
         "Example::\n\n  import sidecar.jax\n  sidecar.jax.initialize()                 # before any other JAX call\n"
         "  ctl = sidecar.jax.Controller.from_env()  # every sidecar; this process drives its own host\n"
         '"""\n'),
        ("from sidecar._src.jax.distributed import JaxPeers, LocalPeers, Peers, initialize, is_initialized\n",
         "from sidecar._src.controller.peers import LocalPeers, Peers\n"),
        ('__all__ = ["JaxPeers", "LocalPeers", "Peers", "initialize", "is_initialized"]',
         '__all__ = ["LocalPeers", "Peers"]'),
    ],
    "sidecar/torch.py": [
        ("from sidecar._src.controller.checkpoint.options import CheckpointOptions\n", ""),
        ('__all__ = ["CheckpointOptions", "Checkpointer",', '__all__ = ["Checkpointer",'),
    ],
    "tests/unit/test_public_api.py": [
        ('      "Controller", "CorruptCheckpointError",', '      "CorruptCheckpointError",'),
        ('"VersionMismatchError", "Worker", "default_registry",', '"VersionMismatchError", "default_registry",'),
        ('  assert sidecar.distributed.__all__ == [\n      "JaxPeers", "LocalPeers", "Peers", "initialize", "is_initialized"]',
         '  assert sidecar.distributed.__all__ == ["LocalPeers", "Peers"]'),
        ("  # (sidecar.jax.Controller, the JAX one, inherits them from the controller core).\n"
         "  assert [m for m in dir(sidecar.jax.Controller)",
         "  # (sidecar.jax.Controller inherits them from the controller core).\n"
         "  assert [m for m in dir(sidecar.jax.Controller)"),
        ('      "CheckpointOptions", "Checkpointer", "Controller", "DataLoader",',
         '      "Checkpointer", "Controller", "DataLoader",'),
        ("  # One CheckpointOptions for both frameworks.\n"
         "  assert sidecar.CheckpointOptions is sidecar.CheckpointOptions\n",
         "  # One door per name: CheckpointOptions is both frameworks', sidecar's alone.\n"
         "  assert not hasattr(sidecar.torch, \"CheckpointOptions\")\n"),
        ('      "Controller", "FeedOptions", "JaxPeers", "Worker", "initialize", "is_initialized"]',
         '      "Controller", "JaxPeers", "Worker", "initialize", "is_initialized"]'),
        ("  # sidecar.jax.Controller and sidecar.jax.Worker stay the JAX ones, for compatibility.\n"
         "  assert sidecar.jax.Controller is sidecar.jax.Controller\n"
         "  assert sidecar.jax.Worker is sidecar.jax.Worker\n"
         "  assert sidecar.FeedOptions is sidecar.FeedOptions\n"
         "  assert sidecar.jax.initialize is sidecar.jax.initialize\n",
         "  # One door per name: JAX's classes are sidecar.jax's alone; a name that left the root\n"
         "  # says where it went.\n"
         "  for name in (\"Controller\", \"Worker\"):\n"
         "    with pytest.raises(AttributeError, match=f\"sidecar.{name} is sidecar.jax.{name}\"):\n"
         "      getattr(sidecar, name)\n"
         "  assert not hasattr(sidecar.jax, \"FeedOptions\")\n"
         "  assert not hasattr(sidecar.distributed, \"initialize\")\n"),
    ],
}


DOOR_EDITS["tests/processes/torch/test_no_jax.py"] = [
    ("  except ImportError as e:\n    out[name] = str(e)\ntry:\n  import sidecar.jax",
     "  except AttributeError as e:\n    out[name] = str(e)\ntry:\n  import sidecar.jax"),
    ('      "Controller": f"sidecar.jax.Controller needs jax, which is not installed: {hint}",\n'
     '      "Worker": f"sidecar.jax.Worker needs jax, which is not installed: {hint}",\n',
     '      "Controller": "sidecar.Controller is sidecar.jax.Controller (PyTorch: "\n'
     '                    "sidecar.torch.Controller): import sidecar.jax",\n'
     '      "Worker": "sidecar.Worker is sidecar.jax.Worker: import sidecar.jax",\n'),
]
EDITS["doors"] = DOOR_EDITS


def _edits(files: dict[str, str], groups: list[Group]) -> dict[str, str]:
  """The pending groups' exact edits, on the files as the rules left them."""
  out: dict[str, str] = {}
  for g in groups:
    for path, edits in EDITS.get(g.name, {}).items():
      if path not in files:
        continue
      text = out.get(path, files[path])
      for old, new in edits:
        if old in text:
          text = text.replace(old, new, 1)
        elif new and new not in text:
          print(f"  ! {path}: expected text not found (edited since?): {old[:70]!r}")
      out[path] = text
  return out


def _sort_imports(paths: list[str]) -> None:
  """A renamed module moves in its import block: ruff's isort, on the files changed only."""
  py = [p for p in paths if p.endswith(".py")]
  ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
  if not py or not os.path.exists(ruff):
    print("  ! ruff not found: run `ruff check --fix --select I` on the files above")
    return
  subprocess.run([ruff, "check", "--fix", "--select", "I", "-q", *py], check=False)


# ---- driver ----------------------------------------------------------------------------


DELETES = ["sidecar/_src/controller/progress.py"]  # re-exports of a module under another name


def _tracked() -> list[str]:
  out = subprocess.run(["git", "ls-files", "-z", *ROOTS, *TOP_FILES], check=True,
                       capture_output=True).stdout.decode().split("\0")
  return [p for p in out if p and p.endswith((*SUFFIXES, "Dockerfile")) and not p.startswith(NEVER)
          and os.path.isfile(p)]


def _git_mv(old: str, new: str, check: bool) -> bool:
  if not os.path.exists(old) or os.path.exists(new):
    if os.path.exists(old) and os.path.exists(new):
      print(f"  ! both {old} and {new} exist: merge them by hand")
    return False
  print(f"moved {old} -> {new}")
  if not check:
    subprocess.run(["git", "mv", old, new], check=True)
  return True


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if pending")
  args = parser.parse_args()
  if not os.path.isdir("sidecar/_src"):
    sys.exit("run from the repository root")
  files = {p: open(p, encoding="utf-8").read() for p in _tracked()}
  groups = [g for g in GROUPS if g.pending(files)]
  print("pending groups:", ", ".join(g.name for g in groups) or "none")

  moved = [(o, n) for o, n in MOVES if _git_mv(o, n, args.check)]
  for path in DELETES:
    if os.path.exists(path):
      print(f"removed {path}")
      files.pop(path, None)
      if not args.check:
        subprocess.run(["git", "rm", "-q", path], check=True)
  changed, written = 0, []
  for path, text in sorted(files.items()):
    new = _module_paths(text, MOVES)
    new = rewrite(path, new, groups)
    if path.endswith(".py") and new != text:
      new = _wrap(text, new)
    if new != text:
      changed += 1
      where = dict(MOVES).get(path, path) if not args.check else path
      n = sum(a != b for a, b in zip(text.splitlines(), new.splitlines()))
      print(f"rewrote {where} ({n} lines)")
      if not args.check:
        with open(where if os.path.exists(where) else path, "w", encoding="utf-8") as f:
          f.write(new)
        written.append(where if os.path.exists(where) else path)
      files[path] = new
  for path, text in _edits(files, groups).items():
    if text != files[path]:
      changed += 1
      print(f"edited  {path}")
      if not args.check:
        with open(path, "w", encoding="utf-8") as f:
          f.write(text)
  if written and not args.check:
    _sort_imports(written)
  print(f"{len(moved)} files moved, {changed} rewritten")
  return 1 if args.check and (moved or changed) else 0


if __name__ == "__main__":
  sys.exit(main())
