"""A trainer's next process, started before it is needed (``sidecar launch --standby``).

A restart pays for the new process's interpreter and imports (JAX's alone is 1.3-1.5 s on
the lent TPU host) after the old one is gone. A standby pays them while the job still
trains: the launcher starts ``python -m sidecar._src.tools.standby [--preload M]... --
SCRIPT ARGS...`` (or ``-- -m MODULE ARGS...``; a trainer run as ``env NAME=VALUE...
python ...`` gets ``--set NAME=VALUE`` for each) beside the trainer; it imports JAX (where
installed) and the ``--preload`` modules, then waits on its stdin. When the trainer dies
the launcher writes one line, ``{"env": {...}}``, the environment of the new start, and
closes the pipe; the standby takes that environment (keeping what its imports exported,
and the ``--set`` variables), sets :data:`env.STARTED` to now (the goodput ledger's
process start: its imports were not the restart's cost), points stdin
at ``/dev/null`` and runs the script as ``python SCRIPT ARGS`` would (``__main__``,
``sys.argv``, ``sys.path[0]`` the script's directory; ``-m``: the module). End of input
without a line (the job ended): it exits 0.

Once its imports are done, it writes what it imported to ``--report FILE`` (:func:`write_report`:
every module file it loaded, and the script, each with its inode, size and mtime): before
it takes over, the launcher checks them (:func:`changed_files`) and, where one changed (an
operator's fix), starts a fresh process instead, which imports the new code. The report
also says where each top-level module it imported was found on the script's ``sys.path``
(its directory first, as ``python SCRIPT`` has it; the preloads are imported so too): a
fix made by adding a file that is found first now (one beside the script, shadowing an
installed module) is a change as well (:func:`shadowed`).

Until it runs the script its name (``/proc/PID/comm``) is :data:`NAME`, so tools watching
trainers can tell it from one. What the preloaded modules read from the environment
at import time is the launcher's environment of the start before: variables that change
between starts (the restart count, a new coordinator port) are set before the script
runs, not before the imports.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.machinery
import json
import os
import re
import runpy
import sys
import time
from collections.abc import Sequence

from sidecar._src.core import env as env_lib

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.DOTALL)  # env's NAME=VALUE
NAME = b"sidecar-standby"  # at most 15 bytes: the kernel's limit for a process name
_PR_SET_NAME = 15


def command(trainer: Sequence[str], preload: Sequence[str], *, report: str | None = None
            ) -> list[str] | None:
  """The standby's command for ``trainer``, or None where ``trainer`` is not
  ``PYTHON SCRIPT [ARGS]`` or ``PYTHON -m MODULE [ARGS]``, optionally after ``env
  NAME=VALUE...`` (a standby runs Python only); ``report``: the file it writes what it
  imported to."""
  trainer = list(trainer)
  sets = []
  if trainer and os.path.basename(trainer[0]) == "env":
    trainer.pop(0)
    while trainer and _ASSIGNMENT.fullmatch(trainer[0]):
      sets.append(trainer.pop(0))
  if len(trainer) < 2 or not os.path.basename(trainer[0]).startswith("python"):
    return None
  rest = trainer[1:]
  if rest[0] == "-m" and len(rest) >= 2 or not rest[0].startswith("-"):
    flags = [x for m in preload for x in ("--preload", m)] + [
        x for a in sets for x in ("--set", a)] + (["--report", report] if report else [])
    return [trainer[0], "-m", "sidecar._src.tools.standby", *flags, "--", *rest]
  return None


def _set_name(name: bytes) -> None:
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
  except (OSError, AttributeError):  # not Linux: the name is only a courtesy
    pass


def _own_name() -> bytes:
  try:
    with open("/proc/self/comm", "rb") as f:
      return f.read().strip()
  except OSError:
    return b"python"


def _preload(modules: Sequence[str]) -> None:
  try:
    importlib.import_module("jax")
  except ImportError:
    pass  # a PyTorch-only install: nothing to load ahead
  for name in modules:
    try:
      importlib.import_module(name)
    except Exception as e:  # the script's own import of it will say the same, in context
      print(f"sidecar standby: --preload {name} failed: {type(e).__name__}: {e}",
            file=sys.stderr, flush=True)


def _stat(path: str) -> list[int] | None:
  try:
    st = os.stat(path)
  except OSError:
    return None  # not a file on disk (a zip's member, a frozen module): nothing to compare
  return [st.st_ino, st.st_size, st.st_mtime_ns]


def write_report(path: str, since_ns: int, script: str | None) -> None:
  """Writes to ``path`` (whole, by a rename) the files this process imported, and
  ``script``, each with its inode, size and mtime, and ``since_ns``: when it began
  importing (a file modified after that may have been read before or after the change);
  and where each top-level module imported is found on ``sys.path`` (:func:`found_on`)."""
  files = {os.path.abspath(f) for m in list(sys.modules.values())
           if isinstance(f := getattr(m, "__file__", None), str)}
  if script is not None:
    files.add(os.path.abspath(script))
  stats = {f: st for f in sorted(files) if (st := _stat(f)) is not None}
  names = sorted(n for n in list(sys.modules) if "." not in n and n != "__main__"
                 and n not in sys.builtin_module_names)
  search = [os.path.abspath(p or os.curdir) for p in sys.path]
  with open(path + ".tmp", "w", encoding="utf-8") as out:
    json.dump({"since_ns": since_ns, "files": stats, "path": search,
               "found": found_on(names, search)}, out)
  os.replace(path + ".tmp", path)


def found_on(names: Sequence[str], search: Sequence[str]) -> dict[str, str | None]:
  """Where a fresh import of each of ``names`` (top-level modules) finds it on the path
  ``search``, by the path's own finder (what sits earlier on the path comes first):
  its file, its directories (a namespace package), or None (not found there: built in,
  or found by another finder, an editable install's, say, which the path does not
  change)."""
  importlib.invalidate_caches()  # a file added since the last look is seen
  found: dict[str, str | None] = {}
  for name in names:
    try:
      spec = importlib.machinery.PathFinder.find_spec(name, list(search))
    except (ImportError, ValueError):
      spec = None
    if spec is None:
      found[name] = None
    else:
      found[name] = spec.origin or os.pathsep.join(spec.submodule_search_locations or ())
  return found


def changed_files(path: str) -> list[str] | None:
  """The files of the report at ``path`` changed since the standby imported them (or while
  it did), or None where there is no report yet (it is still importing: what it reads is
  what is on disk now)."""
  try:
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
  except FileNotFoundError:
    return None
  since = report["since_ns"]
  return [f for f, st in report["files"].items() if _stat(f) != st or st[2] >= since]


def shadowed(path: str) -> list[tuple[str, str | None, str | None]]:
  """The top-level modules of the report at ``path`` that a fresh process would now find
  elsewhere than the standby did (a file added earlier on the script's path): each
  ``(module, where the standby found it, where it is found now)``; [] where there is no
  report (or one of an older standby, which does not say)."""
  try:
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
  except FileNotFoundError:
    return []
  then = report.get("found") or {}
  now = found_on(list(then), report.get("path") or [])
  return [(name, was, now[name]) for name, was in then.items() if now[name] != was]


def _go() -> dict[str, str] | None:
  """The next start's environment from stdin, or None at the end of input."""
  line = sys.stdin.buffer.readline()
  if not line.strip():
    return None
  message = json.loads(line)
  environ = message["env"]
  if not isinstance(environ, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in environ.items()):
    raise ValueError("the launcher's env must map names to strings")
  return environ


def _take(environ: dict[str, str], spawned_with: dict[str, str]) -> None:
  """Makes ``os.environ`` the new start's ``environ``, keeping what the imports set.

  What the launcher gave at the spawn and no longer gives goes; what the new start gives
  is set. What the imports added stays: JAX's TPU setup (``cloud_tpu_init``) exports
  variables at import that libtpu reads when the device opens, and without them the
  runtime looks its topology up again (on the lent TPU host a restart then took 30 s
  instead of 14 before its first step).
  """
  for name in spawned_with.keys() - environ.keys():
    os.environ.pop(name, None)
  os.environ.update(environ)


def _run(target: list[str]) -> None:
  if target[0] == "-m":
    sys.argv = [target[1], *target[2:]]  # run_module sets argv[0] to the module's file
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    return
  script = target[0]
  sys.argv = list(target)
  sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
  runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m sidecar._src.tools.standby",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--preload", action="append", default=[], metavar="MODULE")
  p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                 help="a variable the trainer command set with env, for every start")
  p.add_argument("--report", metavar="FILE",
                 help="write what was imported to FILE once the imports are done")
  p.add_argument("target", nargs=argparse.REMAINDER)
  args = p.parse_args(argv)
  target = args.target[1:] if args.target[:1] == ["--"] else args.target
  if not target or target[0] == "-m" and len(target) < 2:
    p.error("give the trainer after --: SCRIPT [ARGS] or -m MODULE [ARGS]")
  own = _own_name()
  _set_name(NAME)
  sets = dict(a.split("=", 1) for a in args.set)
  os.environ.update(sets)
  spawned_with = dict(os.environ)
  since = time.time_ns()
  if target[0] != "-m":  # the preloads import what the script would: its directory first
    sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
  _preload(args.preload)
  if args.report:
    write_report(args.report, since, None if target[0] == "-m" else target[0])
  environ = _go()
  if environ is None:
    return 0
  environ.update(sets)
  environ[env_lib.STARTED] = repr(time.time())
  _take(environ, spawned_with)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0, /dev/null now
  _set_name(own)
  _run(target)
  return 0


if __name__ == "__main__":
  sys.exit(main())
