#!/usr/bin/env bash
# Builds the sidecar image (the repository's Dockerfile) with docker or podman.
#
#   k8s/image/build.sh [--tag TAG] [--extras E] [--base IMAGE] [--engine docker|podman]
#                      [-- MORE BUILD FLAGS]
#
#   --tag TAG       the image to make (default: sidecar:dev); push it with `docker push TAG`
#   --extras E      pyproject extras, comma-separated: jax (JAX, Grain, Orbax, TensorStore),
#                   torch, and the built-in pipelines' tfds, parquet, arrayrecord, demo or all
#                   (default: jax)
#   --base IMAGE    the base image, with python3 >= 3.11 and its venv module (default:
#                   python:3.11-slim; where no registry answers, a Debian 12 base made here
#                   with debootstrap, as root, kept as localhost/sidecar-base:bookworm)
#   --engine E      docker or podman (default: $SIDECAR_IMAGE_ENGINE, else docker if its
#                   daemon answers, else podman)
#   after --        passed to the build, e.g. -- --build-arg USER_PACKAGES="my-pkg==1.2"
#
# The engine's layer cache is reused: a second build with the same pyproject.toml rebuilds
# only the project's own layers. The image gets the labels org.opencontainers.image.version
# and .revision, and colocated-sidecar.pip-freeze (its `pip freeze --all`, one space-separated
# line; /opt/sidecar/pip-freeze.txt in the image). A CA bundle for pip ($PIP_CERT, $SSL_CERT_FILE, else the system's) is passed to the
# build as a secret, so that pip reaches the index through a proxy that intercepts TLS; it
# stays out of the image, as do the wheels, the sources and pip's cache.
set -euo pipefail

DEFAULT_BASE=docker.io/library/python:3.11-slim
DEBIAN_BASE=localhost/sidecar-base:bookworm
FREEZE_LABEL=colocated-sidecar.pip-freeze

say() { echo "build.sh: $*" >&2; }
fail() { say "$*"; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

tag=sidecar:dev extras="jax" base="" engine="${SIDECAR_IMAGE_ENGINE:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tag|--extras|--base|--engine)
      [ $# -ge 2 ] || fail "$1 needs a value (--help lists the options)"
      case "$1" in
        --tag) tag=$2 ;; --extras) extras=$2 ;; --base) base=$2 ;; --engine) engine=$2 ;;
      esac
      shift 2 ;;
    --tag=*) tag=${1#*=}; shift ;;
    --extras=*) extras=${1#*=}; shift ;;
    --base=*) base=${1#*=}; shift ;;
    --engine=*) engine=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) fail "unknown argument $1 (--help lists the options; build flags go after --)" ;;
  esac
done
[ -n "$tag" ] || fail "--tag must name an image, e.g. --tag sidecar:dev"
case "$extras" in *[!a-z,]*) fail "--extras must be comma-separated names like parquet,tfds, got '$extras'" ;; esac

repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$repo/Dockerfile" ] || fail "no Dockerfile in $repo: run the script from a checkout"

# The engine: asked for, or the first that answers.
if [ -z "$engine" ]; then
  for e in docker podman; do
    if command -v "$e" >/dev/null && "$e" info >/dev/null 2>&1; then engine=$e; break; fi
  done
  [ -n "$engine" ] || fail "neither docker (with a running daemon) nor podman answers: install one (Debian: apt-get install podman) or start the docker daemon"
fi
case "$engine" in
  docker|podman) command -v "$engine" >/dev/null || fail "--engine $engine: $engine is not installed" ;;
  *) fail "--engine must be docker or podman, got '$engine'" ;;
esac

have_image() { "$engine" image inspect "$1" >/dev/null 2>&1; }

# A Debian 12 root with Python 3.11 from debootstrap, imported as an image: a base for a
# machine that reaches Debian's packages but no image registry.
make_debian_base() {
  [ "$(id -u)" = 0 ] || fail "no base image: $DEFAULT_BASE cannot be pulled, and making one with debootstrap needs root; pass --base IMAGE"
  command -v debootstrap >/dev/null || fail "no base image: $DEFAULT_BASE cannot be pulled and debootstrap is missing (apt-get install debootstrap), or pass --base IMAGE"
  local root
  root=$(mktemp -d "${TMPDIR:-/var/tmp}/sidecar-base.XXXXXX")
  say "making $DEBIAN_BASE with debootstrap (about a minute)"
  if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
      "$root" >"$root.log" 2>&1; then
    tail -20 "$root.log" >&2
    rm -rf "$root" "$root.log"
    fail "debootstrap failed (above)"
  fi
  rm -rf "$root.log" "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
      "$root"/var/log/*
  tar -C "$root" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$DEBIAN_BASE" >/dev/null
  rm -rf "$root"
}

if [ -z "$base" ]; then
  if have_image "$DEFAULT_BASE" || "$engine" pull -q "$DEFAULT_BASE" >/dev/null 2>&1; then
    base=$DEFAULT_BASE
  else
    have_image "$DEBIAN_BASE" || make_debian_base
    base=$DEBIAN_BASE
    say "no registry answers for $DEFAULT_BASE: building on $DEBIAN_BASE"
  fi
fi

flags=(--build-arg "BASE=$base" --build-arg "EXTRAS=$extras")
# Healthchecks are kept only in docker's image format.
[ "$engine" = podman ] && flags+=(--format docker --layers)
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[ -s "$ca" ] && flags+=(--secret "id=pip-cert,src=$ca")
case "${PIP_INDEX_URL:-}" in http://*|https://*) flags+=(--build-arg "INDEX_URL=$PIP_INDEX_URL") ;; esac

say "$engine build -t $tag (base $base${extras:+, extras $extras})"
start=$SECONDS
previous=$("$engine" image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
"$engine" build "${flags[@]}" "$@" -t "$tag" -f "$repo/Dockerfile" "$repo"

# The labels that need the built image: its pip freeze, the version and the commit.
# Read from a created container, never started: no runtime needed.
cid=$("$engine" create "$tag")
freeze=$("$engine" cp "$cid:/opt/sidecar/pip-freeze.txt" - | tar -xO | tr '\n' ' ' | sed 's/ $//')
"$engine" rm "$cid" >/dev/null
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
echo "FROM $tag" >"$ctx/Dockerfile"
label_flags=(--label "$FREEZE_LABEL=$freeze" --label "org.opencontainers.image.version=$version"
             --label "org.opencontainers.image.revision=$revision"
             --label "org.opencontainers.image.title=colocated-sidecar")
[ "$engine" = podman ] && label_flags+=(--format docker)
"$engine" build -q "${label_flags[@]}" -t "$tag" "$ctx" >/dev/null
# The image this tag named before, unless something still uses it (the layer cache keeps
# its own).
now=$("$engine" image inspect --format '{{.Id}}' "$tag")
if [ -n "$previous" ] && [ "$previous" != "$now" ]; then
  "$engine" rmi "$previous" >/dev/null 2>&1 || true
fi
size=$("$engine" image inspect --format '{{.Size}}' "$tag")
say "built $tag in $((SECONDS - start)) s: $((size / 1000000)) MB, $(echo "$freeze" | wc -w) packages (label $FREEZE_LABEL)"
