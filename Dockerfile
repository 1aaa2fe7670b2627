# cosyvoice-lb as a Kubernetes pod: the launcher, nginx, espeak-ng and the instances' Python
# on a CUDA runtime. It runs `cosyvoice-lb up --foreground` (SIGTERM drains every instance).
#
#   docker build -t cosyvoice-lb .                                  # the embedded espeak engine
#   docker build --build-arg COSYVOICE_REQUIREMENTS=requirements.txt -t cosyvoice-lb:cv3 .
#
# With COSYVOICE_REQUIREMENTS (a file in the build context, e.g. upstream CosyVoice's
# requirements.txt) torch and upstream's packages go into the same venv; the model itself is
# mounted (k8s render --model-volume) and named by COSYVOICE_LB_MODEL_DIR / _COSYVOICE_ROOT.

ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# --- build: the venv, with everything compiled here and nothing of the build left behind ---
FROM ${CUDA_IMAGE} AS build
ARG COSYVOICE_REQUIREMENTS=
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY setup.cfg pyproject.toml README.md app.py ./
COPY cosyvoice_lb ./cosyvoice_lb
COPY templates ./templates
RUN python3 -m venv /opt/cosyvoice-lb \
    && /opt/cosyvoice-lb/bin/pip install --upgrade pip \
    && /opt/cosyvoice-lb/bin/pip install . \
    && if [ -n "$COSYVOICE_REQUIREMENTS" ]; then /opt/cosyvoice-lb/bin/pip install -r "$COSYVOICE_REQUIREMENTS"; fi

# --- run: the CUDA runtime, nginx, espeak-ng, the venv; a user without privileges ---
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/cosyvoice-lb/bin:$PATH \
    COSYVOICE_LB_STATE_DIR=/var/lib/cosyvoice-lb COSYVOICE_LB_PUBLIC=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 nginx espeak-ng ffmpeg \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 cvlb && useradd --uid 10001 --gid 10001 --home-dir /var/lib/cosyvoice-lb --create-home cvlb
COPY --from=build /opt/cosyvoice-lb /opt/cosyvoice-lb
USER 10001:10001
WORKDIR /var/lib/cosyvoice-lb
EXPOSE 8080
# (ready for Kubernetes' probes through /ping; the Deployment sets them)
CMD ["cosyvoice-lb", "up", "--foreground"]
