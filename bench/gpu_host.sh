#!/bin/bash
# What a session that is lent a GPU host runs, as it is (docs/gpus.md: "When a GPU is lent").
#
# Here, first (this machine reaches PyPI; the GPU host does not):
#   bash bench/gpu_host.sh wheels .whl
# then on the GPU host (one NVIDIA H100/H200, 16 vCPUs, Python 3.12 with torch), from the
# repository root, with .whl carried over, in one device call of at most 600 s:
#   bash bench/gpu_host.sh run "$OUT" .whl
# Each step runs under its own timeout (seconds; STEP_SECONDS=name=s,... to change one) and
# writes under OUT/<step>/; OUT/summary.txt says how each ended. STEPS=a,b picks steps.
# DRY_RUN=1 prints the plan and runs nothing (tests/test_bench_gpu_host.py reads it).
#
# The steps, in order (what the GPU has not yet measured comes first):
#   cuda_check  the native path's correctness on the GPU: bitwise stop and resume (bench.cuda_check --quick)
#   feed        ResNet-50 at 224 fed by host decoding (15 workers) and nvJPEG (data.decode=device,
#               4 workers), with two steps traced to say where the GPU's idle time went (bench.feed)
#   decode      the loader alone decoding on the GPU, 1 to 4 workers (bench.pipeline --decode device)
#   limit       the synthetic-real pair for the same config: how much of the gap is input (bench.limit)
set -u

usage() {
    echo "usage: bash bench/gpu_host.sh wheels DIR | run OUT [WHEELS_DIR]" >&2
    exit 2
}

# The packages the GPU host lacks (it has torch, torchvision, numpy and pillow), as wheels.
PACKAGES="hydra-core omegaconf antlr4-python3-runtime==4.9.3 webdataset braceexpand simplejpeg
google-cloud-storage google-api-core google-auth google-cloud-core google-resumable-media
google-crc32c googleapis-common-protos protobuf proto-plus requests urllib3 certifi idna
charset-normalizer cachetools pyasn1 pyasn1-modules rsa PyYAML"

pinned() {  # each package at the version .venv holds (what the suite passed with), where it has it
    local name version
    for name in $(echo "$PACKAGES" | tr ' ' '\n' | grep -v antlr4); do
        version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
            "$name" 2>/dev/null)
        echo "$name${version:+==$version}"
    done
}

wheels() {
    local dir=$1
    mkdir -p "$dir"
    # cp312 manylinux wheels where a package has compiled parts; antlr4 has an sdist only.
    python3 -m pip download --quiet --dest "$dir" --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        $(pinned) || exit 1
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$dir" antlr4-python3-runtime==4.9.3 || exit 1
    ls "$dir"
}

DATA=/tmp/tpustream-gpu-host-data  # bench.feed's ImageNet-like shards, reused by limit

plan() {
    local out=$1
    cat <<EOF
cuda_check 120 python -m bench.cuda_check $out/cuda_check --quick
feed 270 python -m bench.feed --out $out/feed --data $DATA --workers 15 --device-workers 4 --stock-workers 15 --trace-steps 30,32 --row-timeout 70
decode 60 python -m bench.pipeline --dataset imagenet --workers 1,2,4 --decode device --num-images 2000 --min-seconds 2 --data /tmp/tpustream-gpu-host-decode --out $out/decode
limit 90 python -m bench.limit --epochs 2 --out $out/limit -- accelerator=cuda data=imagenet data.root=$DATA model=resnet50 precision=bf16 batch_size=256 data.num_workers=15
EOF
}

seconds_for() {  # STEP_SECONDS=feed=300,limit=60 overrides a step's default
    local name=$1 default=$2 pair
    for pair in $(echo "${STEP_SECONDS:-}" | tr ',' ' '); do
        [ "${pair%%=*}" = "$name" ] && { echo "${pair#*=}"; return; }
    done
    echo "$default"
}

run() {
    local out=$1 wheels_dir=${2:-}
    mkdir -p "$out"
    local site=
    if [ -n "$wheels_dir" ] && [ -z "${DRY_RUN:-}" ]; then
        site=/tmp/tpustream-site
        python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$wheels_dir"/*.whl \
            > "$out/wheels.log" 2>&1 || { echo "wheels: failed (wheels.log)" >> "$out/summary.txt"; exit 1; }
    fi
    export PYTHONPATH="$PWD/src:$PWD${site:+:$site}" PYTHONUNBUFFERED=1
    if [ -z "${DRY_RUN:-}" ]; then
        { date; nproc; nvidia-smi -L 2>&1; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"; } \
            > "$out/host.txt" 2>&1
        cat "$out/host.txt" > "$out/summary.txt"
    fi
    local name limit command
    while read -r name limit command; do
        if [ -n "${STEPS:-}" ] && ! echo ",$STEPS," | grep -q ",$name,"; then
            continue
        fi
        limit=$(seconds_for "$name" "$limit")
        if [ -n "${DRY_RUN:-}" ]; then
            echo "$name $limit $command"
            continue
        fi
        mkdir -p "$out/$name"
        echo "== $name (limit ${limit}s) $(date +%T): $command" >> "$out/summary.txt"
        # shellcheck disable=SC2086  # the command's words, as planned
        timeout "$limit" python3 ${command#python } > "$out/$name/log.txt" 2>&1
        echo "$name: exit $?" >> "$out/summary.txt"
        tail -n 15 "$out/$name/log.txt" >> "$out/summary.txt"
    done < <(plan "$out")
}

case "${1:-}" in
    wheels) [ $# -eq 2 ] || usage; wheels "$2" ;;
    run) [ $# -ge 2 ] || usage; run "$2" "${3:-}" ;;
    *) usage ;;
esac
