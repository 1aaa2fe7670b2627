# cosyvoice-lb as a Kubernetes pod: the launcher, nginx, espeak-ng and the instances' Python.
# It runs `cosyvoice-lb up --foreground` (every program's lines on its stdout; SIGTERM drains
# every instance). Two images from this one file:
#
#   docker build --network host -t cosyvoice-lb .                 # the embedded espeak engine
#   docker build --network host -t cosyvoice-lb:cv3 \
#       --build-arg UPSTREAM=docker/CosyVoice .                   # upstream's code and requirements
#
# Build arguments (paths are relative to the build context and must lie under docker/, the
# one folder of the context the build stage copies; see docker/README.md):
#   BASE                    the base image of both stages (default: the CUDA runtime)
#   CA_BUNDLE               a CA bundle pip trusts in the build stage (a proxy's CA); never
#                           left in the image
#   UPSTREAM                upstream CosyVoice's source, a folder (docker/CosyVoice, with
#                           third_party/Matcha-TTS inside); it lands in /opt/cosyvoice
#   UPSTREAM_COMMIT         instead: clone UPSTREAM_REPO at this commit (with its submodules)
#   COSYVOICE_REQUIREMENTS  the requirements installed with upstream's code (default: its
#                           requirements.txt); torch comes from them
# The model's weights are not in the image: `k8s render --model-volume` mounts them.

ARG BASE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# --- build: the venv (and upstream's code), with everything compiled here left behind ---
FROM ${BASE} AS build
ARG CA_BUNDLE=
ARG UPSTREAM=
ARG UPSTREAM_REPO=https://github.com/FunAudioLLM/CosyVoice.git
ARG UPSTREAM_COMMIT=
ARG COSYVOICE_REQUIREMENTS=
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY docker/ /ctx/docker/
# pip (and git) in this stage trust the system's bundle, with CA_BUNDLE added to it; the run
# stage below starts from BASE again, without either.
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN if [ -n "$CA_BUNDLE" ]; then \
        [ -f "/ctx/$CA_BUNDLE" ] || { echo "CA_BUNDLE=$CA_BUNDLE is not a file of the build context under docker/" >&2; exit 1; }; \
        cat "/ctx/$CA_BUNDLE" >> /etc/ssl/certs/ca-certificates.crt; \
    fi
# The dependencies first (their layer survives changes to the code), from setup.cfg itself.
COPY setup.cfg pyproject.toml /src/
RUN set -e; \
    python3 -m venv /opt/cosyvoice-lb; \
    /opt/cosyvoice-lb/bin/pip install --upgrade pip; \
    /opt/cosyvoice-lb/bin/python /ctx/docker/requirements.py /src/setup.cfg > /tmp/requirements.txt; \
    /opt/cosyvoice-lb/bin/pip install -r /tmp/requirements.txt
RUN set -e; \
    mkdir -p /opt/cosyvoice; \
    if [ -n "$UPSTREAM" ]; then \
        [ -d "/ctx/$UPSTREAM/cosyvoice" ] || { echo "UPSTREAM=$UPSTREAM has no cosyvoice/ under docker/ in the build context" >&2; exit 1; }; \
        cp -a "/ctx/$UPSTREAM/." /opt/cosyvoice/; \
    elif [ -n "$UPSTREAM_COMMIT" ]; then \
        git clone --recursive "$UPSTREAM_REPO" /opt/cosyvoice; \
        git -C /opt/cosyvoice checkout "$UPSTREAM_COMMIT"; \
        git -C /opt/cosyvoice submodule update --init --recursive; \
        rm -rf /opt/cosyvoice/.git; \
    fi; \
    if [ -d /opt/cosyvoice/cosyvoice ]; then \
        requirements="${COSYVOICE_REQUIREMENTS:+/ctx/$COSYVOICE_REQUIREMENTS}"; \
        requirements="${requirements:-/opt/cosyvoice/requirements.txt}"; \
        [ -f "$requirements" ] || { echo "no requirements file at $requirements" >&2; exit 1; }; \
        cd "$(dirname "$requirements")"; \
        /opt/cosyvoice-lb/bin/pip install -r "$requirements"; \
        [ -d /opt/cosyvoice/third_party/Matcha-TTS ] || echo "warning: no third_party/Matcha-TTS in upstream's code" >&2; \
    fi
COPY README.md app.py /src/
COPY templates /src/templates
COPY cosyvoice_lb /src/cosyvoice_lb
RUN /opt/cosyvoice-lb/bin/pip install --no-deps /src && find /opt/cosyvoice-lb /opt/cosyvoice -name __pycache__ -prune -exec rm -rf {} +

# --- run: the base, nginx, espeak-ng, ffmpeg (the UI streams with it), the venv; a user without privileges ---
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/cosyvoice-lb/bin:$PATH \
    COSYVOICE_LB_STATE_DIR=/var/lib/cosyvoice-lb COSYVOICE_LB_PUBLIC=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 nginx espeak-ng ffmpeg \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 cvlb && useradd --uid 10001 --gid 10001 --home-dir /var/lib/cosyvoice-lb --create-home cvlb
COPY --from=build /opt/cosyvoice-lb /opt/cosyvoice-lb
COPY --from=build /opt/cosyvoice /opt/cosyvoice
USER 10001:10001
WORKDIR /var/lib/cosyvoice-lb
EXPOSE 8080
# (ready for Kubernetes' probes through /ping; the Deployment sets them)
CMD ["cosyvoice-lb", "up", "--foreground"]
