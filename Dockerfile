# tpustream on a Cloud TPU VM (or the XLA CPU device).
#   docker build -t tpustream .                       # TPU image (torch_xla[tpu] with libtpu)
#   docker build -t tpustream-cpu --build-arg EXTRAS=dev .
#   docker run --privileged --net host tpustream python train.py accelerator=tpu data=cifar10 \
#       data.root=gs://BUCKET/cifar10 output_dir=gs://BUCKET/runs/r18 model=resnet18
FROM python:3.11-slim

ARG EXTRAS=tpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/tpustream

# Dependencies first, from pyproject.toml alone, so this ~7 GB layer is cached
# until the dependencies change, not on every source edit.
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
CMD ["python", "train.py", "--help"]
