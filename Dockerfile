# syntax=docker/dockerfile:1
# tpustream on a Cloud TPU VM (or the XLA CPU device). The syntax line above gives the
# BuildKit frontend that the heredoc below needs (the legacy builder cannot parse it).
#   docker build -t tpustream .                               # TPU image: torch_xla[tpu], with libtpu
#   docker build -t tpustream-cpu --build-arg EXTRAS=dev .    # XLA CPU device, plus the test tools
# The entrypoint is `python train.py`, so the arguments of `docker run` are Hydra overrides.
# On every host of a TPU VM at once (gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...):
#   docker run --privileged --net=host --shm-size=16g tpustream accelerator=tpu data=cifar10 \
#       data.root=gs://BUCKET/cifar10 output_dir=gs://BUCKET/runs/r18 model=resnet18
# --privileged gives the container the host's TPU devices, --net=host the host's network (on
# which the TPU runtimes of a pod's hosts reach each other), and --shm-size room for the batches
# DataLoader workers hand over through /dev/shm (Docker's default is 64 MB). GCS credentials
# come from the VM's service account (Application Default Credentials), as without Docker.
# accelerator=tpu selects the TPU: train.py sets PJRT_DEVICE from it, so the image does not.
FROM python:3.11-slim

ARG EXTRAS=tpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/tpustream

# Dependencies first, from pyproject.toml alone, so this ~7 GB layer is cached
# until the dependencies change, not on every source edit. Plain PyPI is enough:
# torch_xla 2.9.0's `tpu` extra requires libtpu==0.0.21 and tpu-info, both on PyPI
# (torch_xla-2.9.0 METADATA; its README installs with `pip install torch==2.9.0
# 'torch_xla[tpu]==2.9.0'`), so the libtpu-releases find-links page that releases
# up to 2.5 needed is not.
COPY pyproject.toml ./
RUN python - <<'PY' > /tmp/requirements.txt
import os, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in os.environ.get("EXTRAS", "").split(",") if e]
print("\n".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]))
PY
RUN pip install -r /tmp/requirements.txt

COPY README.md train.py ./
COPY src ./src
COPY conf ./conf
COPY scripts ./scripts
RUN pip install --no-deps -e .

# Persistent XLA compilation cache (accelerator/tpu.yaml); mount a volume here to keep it.
VOLUME /tmp/tpustream-xla-cache
ENTRYPOINT ["python", "train.py"]
CMD ["--help"]
