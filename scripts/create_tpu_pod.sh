#!/usr/bin/env bash
# Create a Cloud TPU VM pod ready for tpustream: a thin wrapper around `tpustream-pod create`,
# kept for its old command line. The pod is asked for as a queued resource (it waits for
# capacity), every host installs python3-venv at boot, and how it was made is recorded on
# this machine for `tpustream-pod --recreate` (see docs/pods.md).
#
#   scripts/create_tpu_pod.sh NAME ZONE [ACCELERATOR_TYPE] [RUNTIME_VERSION] [--project P]
#                             [--spot | --preemptible | --reserved] [--dry-run]
#
# The launcher needs only the standard library, so any python3 runs it from this checkout.
set -euo pipefail

usage() {
  cat >&2 <<'USAGE'
usage: scripts/create_tpu_pod.sh NAME ZONE [ACCELERATOR_TYPE=v3-32] [RUNTIME_VERSION=the one for the type]
                                 [--project P] [--spot | --preemptible | --reserved] [--dry-run]
  --spot         cheaper, may be taken away at any time (tpustream-pod --recreate asks for it again)
  --preemptible  the older kind of revocable TPU VM (no queued resource)
  --dry-run      print the gcloud command and the start-up script, create nothing
USAGE
  exit "${1:-2}"
}

options=()
positional=()
while [ $# -gt 0 ]; do
  case $1 in
    --project) [ $# -ge 2 ] || usage; options+=(--project "$2"); shift 2 ;;
    --project=*) options+=(--project "${1#*=}"); shift ;;
    --spot|--preemptible|--reserved|--dry-run) options+=("$1"); shift ;;
    -h|--help) usage 0 ;;
    -*) echo "create_tpu_pod.sh: unknown option $1" >&2; usage ;;
    *) positional+=("$1"); shift ;;
  esac
done
if [ ${#positional[@]} -lt 2 ] || [ ${#positional[@]} -gt 4 ] || [ -z "${positional[0]}" ] || [ -z "${positional[1]}" ]; then
  usage
fi
if [ ${#positional[@]} -eq 4 ]; then
  options+=(--runtime-version "${positional[3]}")
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m tpustream.pod create \
  "${positional[0]}" --zone "${positional[1]}" --type "${positional[2]:-v3-32}" ${options[@]+"${options[@]}"}
