"""Reading a pool file (``sidecar serve --pool FILE``): YAML in, a checked ``tenants.Pool``
out, every mistake named with its line (yaml's node marks). The keys are in docs/pool.md
("The pool file").
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import pwd
import stat
from typing import Any

import yaml

from sidecar._src.core import options as options_lib, paths
from sidecar._src.server.tenancy import quotas as quotas_lib
from sidecar._src.server.tenancy.tenants import Pool, Tenant, error_at

log = logging.getLogger(__name__)

POOL_FLAG = "--pool"
# A tenant's keys: who it is and what it may reach, then its quotas (``quotas.ALL``).
_TENANT_KEYS = frozenset({
    "name", "token_file", "checkpoint_roots", "data_roots", "functions", "pipelines", "weight",
    "uids", "uid", "gid", "tls_names", *quotas_lib.BY_KEY})
# The capabilities a sidecar needs to start a tenant's processes as its uid and gid
# (capabilities(7): CAP_SETGID is bit 6, CAP_SETUID bit 7 of CapEff).
_CAP_SETGID, _CAP_SETUID = 6, 7
_POOL_KEYS = frozenset({"tenants", "operator_token_file"})
# `sidecar serve`'s flag that names the operator token instead of the pool file's key.
OPERATOR_FLAG = "--operator-token-file"


def warn_if_readable(path: str, what: str) -> bool:
  """Warns (naming ``path`` and the fix) where others may read it; whether it did."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return False
  if not mode & (stat.S_IROTH | stat.S_IWOTH):
    return False
  log.warning("%s %s is readable by everyone (mode %o): anyone on this machine may read the "
              "tenants' tokens from it; chmod 600 %s", what, path, stat.S_IMODE(mode), path)
  return True


def load(path: str, *, operator_token_file: str | None = None) -> Pool:
  """The pool in the YAML file ``path``, checked.

  Args:
    operator_token_file: the operator's token file from ``--operator-token-file``, where
      the pool file names none (``operator_token_file:``); read at each load, as the
      tenants' token files are.

  Raises:
    OSError: the file (or a token file it names) cannot be read.
    InvalidArgumentError: the file is malformed; the message names the line.
  """
  warn_if_readable(path, "pool file")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    node = yaml.compose(text, Loader=yaml.SafeLoader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    raise error_at(path, mark.line + 1 if mark else 0,
                 f"not YAML: {getattr(e, 'problem', e)}") from None
  if not isinstance(node, yaml.MappingNode):
    raise error_at(path, node.start_mark.line + 1 if node else 1,
                 "a pool file is a mapping with 'tenants: [...]'")
  top = _mapping(path, node, _POOL_KEYS, "the pool file")
  if "tenants" not in top:
    raise error_at(path, node.start_mark.line + 1, "the pool file has no 'tenants' list")
  seq = top["tenants"]
  if not isinstance(seq, yaml.SequenceNode) or not seq.value:
    raise error_at(path, seq.start_mark.line + 1, "'tenants' must be a non-empty list")
  base = os.path.dirname(os.path.abspath(path))
  tenants: list[Tenant] = []
  for item in seq.value:
    tenant = _tenant(path, item, base)
    line = item.start_mark.line + 1
    for other in tenants:
      if other.name == tenant.name:
        raise error_at(path, line, f"tenant name {tenant.name!r} is also the name of the tenant "
                     f"on line {other.line}; each tenant needs a name of its own")
      if other.tls_names & tenant.tls_names:
        raise error_at(path, line, f"tenant {tenant.name!r} shares tls_names "
                     f"{sorted(other.tls_names & tenant.tls_names)} with tenant {other.name!r} "
                     f"(line {other.line}); a certificate can belong to one tenant only")
      if other.token and other.token == tenant.token:
        raise error_at(path, line, f"tenant {tenant.name!r} has the same token as tenant "
                     f"{other.name!r} (line {other.line}); each tenant needs a token of its "
                     "own, e.g. `openssl rand -hex 32 > FILE`")
    for other in tenants:
      _check_roots_apart(path, line, tenant, other)
      _check_data_apart(path, line, tenant, other)
      _check_data_apart(path, line, other, tenant, mine=False)
      if other.uids & tenant.uids:
        raise error_at(path, line, f"tenant {tenant.name!r} shares uids "
                     f"{sorted(other.uids & tenant.uids)} with tenant {other.name!r} (line "
                     f"{other.line}); a user's workers can belong to one tenant only")
      if tenant.uid is not None and tenant.uid == other.uid:
        raise error_at(path, line, f"tenant {tenant.name!r} has the uid {tenant.uid} of tenant "
                       f"{other.name!r} (line {other.line}); each tenant's processes run as a "
                       "user of its own, or the kernel would let one reach the other's")
    tenants.append(tenant)
  pool = Pool(tenants=tuple(tenants), path=path)
  fractions = sum(t.arena.fraction or 0.0 for t in pool.tenants)
  if fractions > 1.0 + 1e-9:
    raise error_at(path, seq.start_mark.line + 1,
                 "the tenants' guaranteed arena shares ("
                 + ", ".join(f"{t.name} {t.arena}" for t in pool.tenants if t.arena.fraction)
                 + f") sum to {fractions:g} of the arena, more than all of it; lower them")
  return _with_operator(path, top, base, pool, operator_token_file)


def operator_token_file(path: str) -> str | None:
  """The operator token file the pool file at ``path`` names (resolved as load does), or
  None: what `sidecar local` reads to know whether to make one. Reads only the YAML."""
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f)
  except (OSError, yaml.YAMLError):
    return None  # the sidecars' own load says what is wrong with it
  v = data.get("operator_token_file") if isinstance(data, dict) else None
  if not isinstance(v, str) or not v:
    return None
  return os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(v))


def _with_operator(path: str, top: dict[str, yaml.Node], base: str, pool: Pool,
                   flag_file: str | None) -> Pool:
  """``pool`` with its operator token (the key ``operator_token_file``, or the flag's
  file), checked to be no tenant's token."""
  if "operator_token_file" in top:
    line = top["operator_token_file"].start_mark.line + 1
    if flag_file is not None:
      raise error_at(path, line, f"operator_token_file is given here and by {OPERATOR_FLAG} "
                     f"{flag_file}; name the operator's token in one place")
    v = _scalar(path, top["operator_token_file"], "operator_token_file")
    if not isinstance(v, str) or not v:
      raise error_at(path, line, f"operator_token_file must be a file's path, got {v!r}")
    token_file, where = os.path.join(base, os.path.expanduser(v)), f"{path}:{line}"
  elif flag_file is not None:
    line, token_file = 0, os.path.abspath(flag_file)
    where = f"{OPERATOR_FLAG} {token_file}"
  else:
    return pool
  token = _read_token(path, line, "the operator", token_file)
  for t in pool.tenants:
    if t.token and hmac.compare_digest(t.token.encode(), token.encode()):
      named = token_file if line else where
      raise error_at(path, line, f"the operator token ({named}) is also the token of tenant "
                     f"{t.name!r} (line {t.line}); the operator is no tenant: give it a token "
                     "of its own (`openssl rand -hex 32 > FILE; chmod 600 FILE`)")
  return dataclasses.replace(pool, operator_token=token, operator_token_file=token_file,
                             operator_where=where)


def _check_roots_apart(path: str, line: int, tenant: Tenant, other: Tenant) -> None:
  """Refuses two tenants' checkpoint roots of which one is, holds or lies in the other: a
  directory belongs to one tenant (each one's checkpoints are its own, docs/pool.md)."""
  for mine in tenant.checkpoint_roots:
    for theirs in other.checkpoint_roots:
      if paths.overlap(mine, theirs):
        raise error_at(path, line, f"tenant {tenant.name!r}'s checkpoint root {mine} "
                       f"{'is' if mine == theirs else 'overlaps'} tenant {other.name!r}'s "
                       f"{theirs} (line {other.line}); each tenant's checkpoint_roots must "
                       "be directories of its own, none inside another's")


def _check_data_apart(path: str, line: int, tenant: Tenant, other: Tenant, *,
                      mine: bool = True) -> None:
  """Refuses a data root of ``tenant`` that is, holds or lies in a checkpoint root of
  ``other``, or that holds or lies in one of ``other``'s data roots without being it: one
  tenant would read the other's data (``mine``: ``tenant`` is the one on ``line``). Equal
  data roots are data both may read, as the operator chose."""
  for r in tenant.data_roots:
    theirs = [c for c in other.checkpoint_roots if paths.overlap(r, c)]
    theirs += [d for d in other.data_roots if d != r and paths.overlap(r, d)]
    if theirs:
      kind = "checkpoint" if theirs[0] in other.checkpoint_roots else "data"
      raise error_at(path, line, f"tenant {tenant.name!r}'s data root {r}"
                     f"{'' if mine else f' (line {tenant.line})'} "
                     f"{'is' if r == theirs[0] else 'overlaps'} tenant {other.name!r}'s "
                     f"{kind} root {theirs[0]}{f' (line {other.line})' if mine else ''}; "
                     "a tenant's pipelines read everything beneath its data roots: give each "
                     "tenant data roots of its own (or the very same directory, to share it)")


def _mapping(path: str, node: yaml.Node, keys: frozenset[str], what: str
             ) -> dict[str, yaml.Node]:
  if not isinstance(node, yaml.MappingNode):
    raise error_at(path, node.start_mark.line + 1, f"{what} must be a mapping of keys")
  out: dict[str, yaml.Node] = {}
  for k, v in node.value:
    key = k.value if isinstance(k, yaml.ScalarNode) else None
    line = k.start_mark.line + 1
    if key not in keys:
      raise error_at(path, line, f"unknown key {key!r} in {what}; the keys are "
                   f"{', '.join(sorted(keys))} (docs/pool.md)")
    if key in out:
      raise error_at(path, line, f"key {key!r} given twice in {what}")
    out[key] = v
  return out


def _scalar(path: str, node: yaml.Node, what: str) -> Any:
  if not isinstance(node, yaml.ScalarNode):
    raise error_at(path, node.start_mark.line + 1, f"{what} must be a single value")
  return yaml.safe_load(yaml.serialize(node))


def _tenant(path: str, node: yaml.Node, base: str) -> Tenant:
  line = node.start_mark.line + 1
  m = _mapping(path, node, _TENANT_KEYS, f"a tenant (line {line})")
  name = _scalar(path, m["name"], "name") if "name" in m else None
  if not isinstance(name, str) or not name or not all(c.isalnum() or c in "._-" for c in name):
    raise error_at(path, line, f"a tenant's name is letters, digits, '.', '_' or '-', got "
                 f"{name!r}")
  where = f"tenant {name!r}"

  def at(key: str) -> int:
    return m[key].start_mark.line + 1

  def names(key: str) -> frozenset[str] | None:
    if key not in m:
      return None
    v = yaml.safe_load(yaml.serialize(m[key]))
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
      raise error_at(path, at(key), f"{where}: {key} must be a list of registered names, got "
                   f"{v!r:.100}")
    return frozenset(v)

  tls_names = names("tls_names") or frozenset()
  token_file = _scalar(path, m["token_file"], "token_file") if "token_file" in m else None
  if token_file is None and tls_names:
    token = ""  # its certificate says who it is
  elif not isinstance(token_file, str) or not token_file:
    raise error_at(path, line, f"{where} has no token_file: give the file that holds its token "
                 "(`openssl rand -hex 32 > FILE; chmod 600 FILE`), or its tls_names")
  else:
    token_file = os.path.join(base, os.path.expanduser(token_file))
    token = _read_token(path, at("token_file"), where, token_file)
  def directories(key: str) -> tuple[str, ...] | None:
    if key not in m:
      return None
    v = yaml.safe_load(yaml.serialize(m[key]))
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
      raise error_at(path, at(key), f"{where}: {key} must be a list of directories, got "
                     f"{v!r:.100}")
    return tuple(os.path.realpath(os.path.join(base, x)) for x in v)

  roots = directories("checkpoint_roots") or ()
  data_roots = directories("data_roots")
  uids: frozenset[int] = frozenset()
  if "uids" in m:
    v = yaml.safe_load(yaml.serialize(m["uids"]))
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
      raise error_at(path, at("uids"), f"{where}: uids must be a list of user ids (ints >= 0), "
                   f"got {v!r:.100}")
    uids = frozenset(v)
  uid, gid = _user(path, m, where, at)
  weight = 1.0
  if "weight" in m:
    w = _scalar(path, m["weight"], "weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
      raise error_at(path, at("weight"), f"{where}: weight must be a positive number, got {w!r}")
    weight = float(w)
  quotas = {}
  for quota in quotas_lib.ALL:
    if quota.key in m:
      try:
        quotas[quota.key] = quota.read(_scalar(path, m[quota.key], quota.key))
      except ValueError as e:
        raise error_at(path, at(quota.key), f"{where}: {e}") from None
  return Tenant(
      name=name, token=token, token_file=token_file, line=line, quotas=quotas,
      checkpoint_roots=roots, data_roots=roots if data_roots is None else data_roots,
      functions=names("functions"), pipelines=names("pipelines"),
      weight=weight, uids=uids, uid=uid, gid=gid, tls_names=tls_names)


def can_switch_user() -> bool:
  """Whether this process may start others as another user: root's, or with CAP_SETUID
  and CAP_SETGID (a container's root may lack them)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), None)
  except (OSError, ValueError):
    caps = None
  if caps is None:
    return os.geteuid() == 0
  return bool(caps >> _CAP_SETUID & 1 and caps >> _CAP_SETGID & 1)


def _user(path: str, m: dict[str, yaml.Node], where: str, at) -> tuple[int | None, int | None]:
  """A tenant's ``uid`` and ``gid`` (its processes' user and group): checked, the group
  the user's primary one (the password database's) or its uid's number where not given."""
  def an_id(key: str) -> int | None:
    if key not in m:
      return None
    v = _scalar(path, m[key], key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << 31:
      what = "user" if key == "uid" else "group"
      raise error_at(path, at(key), f"{where}: {key} must be a {what} id, an int from 1 (0 "
                     f"is root's: its processes would be bounded by nothing), got {v!r}")
    return v
  uid, gid = an_id("uid"), an_id("gid")
  if uid is None:
    if gid is not None:
      raise error_at(path, at("gid"), f"{where}: gid is the group of its uid's processes; "
                     "give its uid too")
    return None, None
  if uid == os.geteuid():
    raise error_at(path, at("uid"), f"{where}: uid {uid} is the sidecar's own user: its "
                   "processes would reach the sidecar's memory (/proc/PID/mem); give the tenant "
                   "a user of its own")
  if not can_switch_user():
    raise error_at(path, at("uid"), f"{where}: uid {uid}: this sidecar (uid {os.geteuid()}) "
                   "cannot start processes as another user: run it as root, or give its "
                   "container CAP_SETUID and CAP_SETGID (securityContext.capabilities.add), or "
                   "leave uid out (the tenant's processes then run as the sidecar's user)")
  if gid is None:
    try:
      gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
      gid = uid
  if gid == 0:
    raise error_at(path, at("uid"), f"{where}: uid {uid}'s group is root's (0): give gid")
  return uid, gid


def _read_token(path: str, line: int, where: str, token_file: str) -> str:
  try:
    with open(token_file, encoding="utf-8") as f:
      token = f.read().strip()
  except (OSError, UnicodeDecodeError) as e:
    raise error_at(path, line, f"{where}: cannot read its token_file {token_file}: "
                 f"{getattr(e, 'strerror', None) or e}") from None
  try:
    options_lib.check_token(token, f"{where}'s token ({token_file})")
  except ValueError as e:
    raise error_at(path, line, str(e)) from None
  warn_if_readable(token_file, f"{where}'s token file")
  return token
