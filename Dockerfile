# syntax=docker/dockerfile:1
# The sidecar image: `sidecar serve`, with your package installed beside it so that
# `--import my_pkg.sidecar_fns` (or SIDECAR_IMPORTS) registers your functions and pipelines.
# The same image is a trainer image too: it has jax and sidecar.jax.Worker/Controller.
#
#   k8s/image/build.sh --tag sidecar:dev                    # docker or podman, labels, checks
#   docker build -t sidecar:dev .                           # the same, by hand
#   docker build -t sidecar:dev --build-arg EXTRAS=jax,parquet,tfds .   # + pipelines' libraries
#   docker build -t sidecar:dev --build-arg USER_PACKAGES="my-pkg==1.2" .
#
# For code that is not on an index, build on top of this image (docs/kubernetes.md):
#
#   FROM sidecar:dev
#   USER root
#   COPY . /src
#   RUN pip install --no-cache-dir /src && rm -rf /src
#   USER 1000
#
# It runs as uid 1000 with a read-only root file system, as the manifests in k8s/ run it:
# nothing in it is writable by uid 1000 outside /home/sidecar, and it needs no accelerator.
# `sidecar serve` runs JAX on the CPU and hides the accelerators from itself and its feed
# workers (JAX_PLATFORMS=cpu, CUDA_VISIBLE_DEVICES="", PJRT_DEVICE=CPU), set at its start:
# not here, where an ENV would put a trainer run from this image on the CPU too.

# The base: any Debian-like image with python3 (>= 3.11) and its venv module. With no
# registry, k8s/image/build.sh makes one with debootstrap.
ARG BASE=docker.io/library/python:3.11-slim

FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# A pip index of your own, for the dependencies (the build stage only: nothing of it stays).
ARG INDEX_URL=""
# A CA bundle for the index, as the build secret `pip-cert` (build.sh passes the machine's
# own, for a proxy that intercepts TLS); without one, pip's own certificates.
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && python3 -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir ${INDEX_URL:+--index-url "$INDEX_URL"} \
      "setuptools>=68" wheel
WORKDIR /src
# Every dependency's wheel, from pyproject.toml alone (with a stand-in README), so that
# this layer is rebuilt only when the dependencies change, not with every source change.
COPY pyproject.toml ./
# The extras the image should serve (pyproject.toml): jax (JAX, Grain, Orbax, TensorStore: the
# default), torch, and the built-in pipelines' tfds, parquet, arrayrecord, demo or all.
ARG EXTRAS="jax"
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && touch README.md \
 && /opt/build/bin/pip wheel --no-cache-dir --no-build-isolation --wheel-dir /wheels/deps \
      ${INDEX_URL:+--index-url "$INDEX_URL"} ".${EXTRAS:+[$EXTRAS]}" \
 && rm /wheels/deps/colocated_sidecar-*.whl \
 && cd /wheels/deps \
 && ls *.whl | sed -E 's/^([^-]+)-([^-]+)-.*[.]whl$/\1==\2/' > requirements.txt
# Then the project's own wheel.
COPY . .
RUN /opt/build/bin/pip wheel --no-cache-dir --no-build-isolation --no-deps \
      --wheel-dir /wheels/project . \
 && cd /wheels/project && sha256sum *.whl > SHA256SUMS

FROM ${BASE}
# Root owns the virtual environment: uid 1000 can run it, not change it.
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/sidecar \
      --shell /usr/sbin/nologin sidecar \
 && python3 -m venv /opt/sidecar
ENV PATH=/opt/sidecar/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# Offline, from the wheels of the build stage, which stay there: the dependencies first
# (a layer that source changes leave cached), then the project. Each install follows a COPY
# of what names its wheels, so that the layer cache sees when they change (buildah's cache
# does not look into a RUN's mounts): the requirements, and the project wheel's checksum.
COPY --from=build /wheels/deps/requirements.txt /opt/sidecar/requirements.txt
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels/deps \
      -r /opt/sidecar/requirements.txt
COPY --from=build /wheels/project/SHA256SUMS /opt/sidecar/colocated-sidecar.sha256
ARG EXTRAS="jax"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels/deps \
      --find-links=/wheels/project "colocated-sidecar${EXTRAS:+[$EXTRAS]}"
# Your package(s), as pip requirement specifiers: names, pins, URLs (from the index).
ARG USER_PACKAGES=""
RUN --mount=type=secret,id=pip-cert \
    if [ -n "$USER_PACKAGES" ]; then \
      if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
      pip install --no-cache-dir $USER_PACKAGES; \
    fi
# What is installed, for `docker inspect` (build.sh copies it into a label) and for you.
# Nothing writable by others (the base's /tmp, /var/tmp, /run/lock): under a read-only root
# a scratch directory is a mounted volume; elsewhere Python's tempfile falls back to $HOME.
RUN pip freeze --all > /opt/sidecar/pip-freeze.txt \
 && find / -xdev -perm -0002 ! -type l -exec chmod o-w {} + \
 && rm -rf /root/.cache /var/cache/apt/archives/*.deb /var/lib/apt/lists/*
USER 1000:1000
WORKDIR /home/sidecar
# The manifests' ports (k8s/components/sidecar): gRPC, plaintext health, Prometheus metrics.
EXPOSE 8490 8491 8492
# The kubelet probes the health port itself; this is for docker and podman. The timeout
# leaves room for a Python start on a loaded machine (5 s was exceeded at a load of 15).
HEALTHCHECK --interval=30s --timeout=30s --start-period=120s --retries=3 \
  CMD ["sidecar", "health"]
ENTRYPOINT ["sidecar"]
CMD ["serve"]
