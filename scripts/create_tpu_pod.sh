#!/usr/bin/env bash
# Create a Cloud TPU VM (one host or a pod slice) ready for tpustream.
#
#   scripts/create_tpu_pod.sh NAME ZONE [ACCELERATOR_TYPE] [RUNTIME_VERSION] [--project P] [--preemptible] [--dry-run]
#
# Every host gets a start-up script (it runs as root at every boot) that installs
# python3-venv and python3-pip, which the base image lacks, then writes its exit
# status to /var/lib/tpustream/startup-done. The code arrives afterwards with
#   python -m tpustream.pod --tpu NAME --zone ZONE --sync -- ...
# which creates the workdir (~/tpustream of the ssh user, who does not exist yet
# at first boot) and waits for that marker on a fresh VM.
set -euo pipefail

usage() {
  cat >&2 <<'EOF'
usage: scripts/create_tpu_pod.sh NAME ZONE [ACCELERATOR_TYPE=v3-32] [RUNTIME_VERSION=tpu-ubuntu2204-base]
                                 [--project P] [--preemptible] [--dry-run]
  --preemptible  cheaper, may be taken away at any time (cannot be restarted: recreate it)
  --dry-run      print the gcloud command and the start-up script, create nothing
EOF
  exit "${1:-2}"
}

project=
preemptible=
dry_run=
positional=()
while [ $# -gt 0 ]; do
  case $1 in
    --project) [ $# -ge 2 ] || usage; project=$2; shift 2 ;;
    --project=*) project=${1#*=}; shift ;;
    --preemptible) preemptible=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "create_tpu_pod.sh: unknown option $1" >&2; usage ;;
    *) positional+=("$1"); shift ;;
  esac
done
if [ ${#positional[@]} -lt 2 ] || [ ${#positional[@]} -gt 4 ]; then
  usage
fi
name=${positional[0]}
zone=${positional[1]}
accelerator=${positional[2]:-v3-32}
version=${positional[3]:-tpu-ubuntu2204-base}
if [ -z "$name" ] || [ -z "$zone" ]; then
  usage
fi

startup=$(mktemp "${TMPDIR:-/tmp}/tpustream-startup.XXXXXX")
trap 'rm -f "$startup"' EXIT
cat > "$startup" <<'STARTUP'
#!/bin/bash
# tpustream host set-up (scripts/create_tpu_pod.sh): runs as root at every boot of every host.
set -euo pipefail
marker_dir=/var/lib/tpustream
mkdir -p "$marker_dir"
rm -f "$marker_dir/startup-done"
# The marker (holding this script's exit status) tells `python -m tpustream.pod --sync` to stop waiting.
trap 'echo $? > "$marker_dir/startup-done"' EXIT
# python3 -m venv needs python3-venv (ensurepip), which the base image lacks.
if ! dpkg -s python3-venv python3-pip >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  # Right after boot unattended-upgrades may hold the dpkg lock: wait for it instead of failing.
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q python3-venv python3-pip
fi
STARTUP

cmd=(gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$accelerator"
     --version="$version" --metadata-from-file=startup-script="$startup")
if [ -n "$project" ]; then
  cmd+=(--project="$project")
fi
if [ -n "$preemptible" ]; then
  cmd+=(--preemptible)
fi

if [ -n "$dry_run" ]; then
  printf '%q ' "${cmd[@]}"
  echo
  echo "# start-up script ($startup, deleted on exit):"
  sed 's/^/#   /' "$startup"
  exit 0
fi
"${cmd[@]}"
echo "create_tpu_pod.sh: $name is being set up (python3-venv on every host, a minute or two);" \
  "next: python -m tpustream.pod --tpu $name --zone $zone${project:+ --project $project} --sync -- .venv/bin/python train.py accelerator=tpu ..." >&2
