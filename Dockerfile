# syntax=docker/dockerfile:1
# The sidecar image: `sidecar serve`, with your package installed beside it so that
# `--import my_pkg.sidecar_fns` (or SIDECAR_IMPORTS) registers your functions and pipelines.
#
#   docker build -t sidecar:dev .
#   docker build -t sidecar:dev --build-arg USER_PACKAGES="my-pkg==1.2" .
#   docker build -t sidecar:dev --build-arg EXTRAS=parquet,tfds .   # built-in pipelines' libraries
#
# For code that is not on an index, build on top of this image (docs/kubernetes.md):
#
#   FROM sidecar:dev
#   COPY --chown=1000:1000 . /home/sidecar/src
#   RUN pip install --no-cache-dir /home/sidecar/src
#
# It runs as uid 1000 (the manifests set runAsNonRoot) and needs no accelerator.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY . .
# The extras of the built-in pipelines the image should serve (pyproject.toml): tfds, parquet,
# arrayrecord, demo or all; none by default.
ARG EXTRAS=""
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"

FROM python:${PYTHON_VERSION}-slim
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin sidecar \
 && python -m venv /opt/sidecar \
 && chown -R 1000:1000 /opt/sidecar
ENV PATH=/opt/sidecar/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 1000
WORKDIR /home/sidecar
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/*.whl
# Your package(s), as pip requirement specifiers: names, pins, URLs.
ARG USER_PACKAGES=""
RUN if [ -n "$USER_PACKAGES" ]; then pip install --no-cache-dir $USER_PACKAGES; fi
# gRPC and plaintext health ports used by the manifests in k8s/.
EXPOSE 8490 8491
ENTRYPOINT ["sidecar"]
CMD ["serve"]
