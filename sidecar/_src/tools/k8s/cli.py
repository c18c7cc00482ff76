"""``sidecar k8s render`` and ``sidecar k8s check``.

``register(subparsers)`` adds the ``k8s`` command to the ``sidecar`` CLI's subparsers; each
subcommand sets ``func``, a callable ``(args) -> int`` exit status.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import yaml

from sidecar._src.core import errors
from sidecar._src.tools import cli_format
from sidecar._src.tools.k8s import checks, pool, render


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``k8s render`` and ``k8s check`` to ``subparsers``."""
  k8s = subparsers.add_parser("k8s", help="Kubernetes manifests for the sidecar",
                              description="Render and check JobSet manifests with the sidecar.",
                              formatter_class=cli_format.DefaultsFormatter)
  commands = k8s.add_subparsers(dest="k8s_command", metavar="{render,check}")
  commands.required = True
  _add_render(commands)
  _add_check(commands)


def _add_render(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser(
      "render", help="print a ready JobSet with the sidecar",
      formatter_class=cli_format.DefaultsFormatter,
      description="Print a JobSet (jobset.x-k8s.io/v1alpha2) whose pods run the trainer "
                  "beside a native sidecar container. Apply it with `kubectl apply -f -` after "
                  "creating the token Secret (see docs/kubernetes.md).")
  p.add_argument("--slices", type=int, default=1,
                 help="number of slices (JobSet replicas) (default: %(default)s)")
  p.add_argument("--hosts-per-slice", type=int,
                 help="pods per slice (default: what --tpu's topology needs; 1 without --tpu)")
  p.add_argument("--image", required=True,
                 help="the sidecar image, with your package in it: build it with "
                      "k8s/image/build.sh --tag REGISTRY/sidecar:TAG, then docker push it "
                      "(docs/kubernetes.md)")
  p.add_argument("--tpu", type=_tpu, metavar="VERSION:TOPOLOGY",
                 help="GKE TPU slice shape, e.g. v5e:4x4, v6e:2x4, v5p:2x2x4 (default: none, "
                      "pods without TPUs)")
  p.add_argument("--trainer-image", help="the training image (default: --image)")
  p.add_argument("--trainer-command", default="python -m my_pkg.train",
                 help="the trainer's command line (default: %(default)s)")
  p.add_argument("--name", default="train", help="JobSet name (default: %(default)s)")
  p.add_argument("--namespace", help="namespace to put in the manifest (default: none, "
                 "kubectl's current namespace)")
  p.add_argument("--shm-size", default="4GiB", help="arena size (default: %(default)s)")
  p.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                 help="module the sidecar imports to register your functions; repeatable "
                      "(default: my_pkg.sidecar_fns)")
  p.add_argument("--sidecar-cpu", default="1", help="sidecar CPU request (default: %(default)s)")
  p.add_argument("--port", type=int, default=8490, help="sidecar gRPC port (default: %(default)s)")
  p.add_argument("--health-port", type=int, default=8491,
                 help="sidecar plaintext health port (default: %(default)s)")
  p.add_argument("--coordinator-port", type=int, default=8476,
                 help="jax.distributed coordinator port in the trainer (default: %(default)s)")
  p.add_argument("--metrics-port", type=int, default=8492,
                 help="sidecar Prometheus /metrics port, with the prometheus.io/* scrape "
                      "annotations on the pods (default: %(default)s)")
  p.add_argument("--no-metrics", action="store_true",
                 help="no metrics port and no scrape annotations")
  p.add_argument("--token-secret", default="sidecar-token",
                 help="Secret holding the controller token under key 'token' "
                      "(default: %(default)s)")
  p.add_argument("--grace-seconds", type=int, default=300,
                 help="terminationGracePeriodSeconds (default: %(default)s)")
  p.add_argument("--trainer-restarts", type=int, default=4, metavar="N",
                 help="in-place restarts of a trainer the Job allows (pod restartPolicy "
                 "OnFailure; the sidecar keeps its arena); 0: restartPolicy Never "
                 "(default: %(default)s)")
  p.add_argument("--procs-per-pod", type=int, default=1, metavar="P",
                 help="PyTorch ranks per pod, one per accelerator: the trainer runs its "
                 "command under `sidecar torchrun --nproc-per-node P`, a torchrun node per "
                 "pod, its ranks sharing the pod's sidecar (default: %(default)s: the command "
                 "is the rank)")
  p.add_argument("--no-share-process-namespace", action="store_true",
                 help="give the trainer and the sidecar a PID namespace each (no pod "
                 "shareProcessNamespace): they cannot see or signal each other's processes, "
                 "and the trainer's liveness probe still fails a stalled trainer but cannot "
                 "ask it for its Python stacks")
  p.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
  p.set_defaults(func=run_render)


def _add_check(commands: argparse._SubParsersAction) -> None:
  p = commands.add_parser(
      "check", help="check JobSet or pool manifests offline",
      formatter_class=cli_format.DefaultsFormatter,
      description="Check JobSet manifests without a cluster: the JobSet CRD schema (with "
                  "--crd), each pod template as a Pod (kubernetes-validate --strict), and what "
                  "schemas miss (volumes, probe ports, sizeLimits, the native sidecar, the "
                  "shared socket, the arena's memory, discovery env). A shared pool's "
                  "StatefulSet and Service (k8s/pool) are checked too: the pool file in a "
                  "Secret others cannot read, the headless Service, the host id from the "
                  "pod's ordinal. Exit status 1 on any finding.")
  p.add_argument("files", nargs="+", metavar="FILE", help="manifest files; '-' for stdin")
  p.add_argument("--crd", help="JobSet CRD YAML, e.g. from "
                               "`kubectl get crd jobsets.jobset.x-k8s.io -o yaml` (default: "
                               "none, the JobSet schema is not checked)")
  p.add_argument("--kubernetes-version", dest="versions", action="append", metavar="X.Y",
                 help="validate pods at this version; repeatable (default: 1.29 and the "
                      "newest kubernetes-validate knows)")
  p.add_argument("--no-pod-schema", action="store_true",
                 help="skip kubernetes-validate (e.g. when it is not installed)")
  p.set_defaults(func=run_check)


def options_from_args(args: argparse.Namespace) -> render.RenderOptions:
  """The RenderOptions that ``k8s render`` flags describe."""
  hosts = args.hosts_per_slice
  if hosts is None:  # a TPU topology says how many hosts it needs; else one pod
    hosts = 1 if args.tpu is None else args.tpu.hosts
  return render.RenderOptions(
      slices=args.slices, hosts_per_slice=hosts, image=args.image, tpu=args.tpu,
      trainer_image=args.trainer_image, trainer_command=tuple(shlex.split(args.trainer_command)),
      name=args.name, namespace=args.namespace, shm_size=args.shm_size,
      imports=tuple(args.imports or ("my_pkg.sidecar_fns",)), sidecar_cpu=args.sidecar_cpu,
      port=args.port, health_port=args.health_port, coordinator_port=args.coordinator_port,
      metrics_port=None if args.no_metrics else args.metrics_port,
      token_secret=args.token_secret, grace_seconds=args.grace_seconds,
      trainer_restarts=args.trainer_restarts, procs_per_pod=args.procs_per_pod,
      share_process_namespace=not args.no_share_process_namespace)


def run_render(args: argparse.Namespace) -> int:
  """Renders, checks the result, and prints it; returns the exit status."""
  try:
    options = options_from_args(args)
  except errors.InvalidArgumentError as e:
    print(f"sidecar k8s render: {e}", file=sys.stderr)
    return 2
  doc = render.render_jobset(options)
  findings = checks.check_jobset(doc, kubernetes_versions=())
  if findings:  # a bug in render, or options that cannot work together
    print("sidecar k8s render: the rendered JobSet fails its checks:", file=sys.stderr)
    for finding in findings:
      print(f"  {finding}", file=sys.stderr)
    return 1
  text = render.to_yaml(doc, command="sidecar k8s render")
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  return 0


def run_check(args: argparse.Namespace) -> int:
  """Checks each file; prints findings; returns 1 if there are any, else 0."""
  versions = () if args.no_pod_schema else args.versions
  total = 0
  for name in args.files:
    try:
      text = sys.stdin.read() if name == "-" else open(name, encoding="utf-8").read()
      docs = checks.load_documents(text)
      found = pool.check_pool(docs, kubernetes_versions=versions)
      if not pool.pool_sets(docs) or any(d.get("kind") == "JobSet" for d in docs):
        found += checks.check_documents(docs, crd_path=args.crd, kubernetes_versions=versions)
    except (OSError, ImportError, yaml.YAMLError, errors.InvalidArgumentError) as e:
      print(f"sidecar k8s check: {name}: {e}", file=sys.stderr)
      return 2
    for finding in found:
      print(f"{name}: {finding}")
    total += len(found)
  if args.crd is None:
    print("note: JobSet schema not checked; pass --crd FILE to check it", file=sys.stderr)
  print(f"{total} problem(s) in {len(args.files)} file(s)", file=sys.stderr)
  return 1 if total else 0


def _tpu(text: str) -> render.TpuSpec:
  try:
    return render.parse_tpu(text)
  except errors.InvalidArgumentError as e:
    raise argparse.ArgumentTypeError(str(e)) from e
