#!/bin/bash
# One device run for issue 35: headline (bench.feed), the old tree's tpustream row, scaling, replica cost old/new.
# Usage on the device, from the repo root: bash .whl/device.sh [quick]
set -u
QUICK=${1:-}
ROOT=$PWD
R=/tmp/res; rm -rf $R; mkdir -p $R
OUTDIR=${OUT:-/tmp/out}; mkdir -p $OUTDIR
if [ -z "$QUICK" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site; PY=python3; ACC=cuda
else
  SITE=; PY=$ROOT/.venv/bin/python; ACC=cpu_eager
fi
export PYTHONUNBUFFERED=1
NEW=$ROOT/src:$ROOT:$SITE
OLD=$ROOT/old/src:$ROOT:$SITE
finish() {
  (cd /tmp && tar czf $OUTDIR/res.tgz --exclude='*.pt' res)
  cp $R/summary.txt $OUTDIR/summary.txt 2>/dev/null
  ls -la $OUTDIR
}
export R QUICK ROOT PY ACC NEW OLD SITE
timeout ${BUDGET:-540} bash .whl/${BODY:-device_body.sh}; echo "body rc=$?" >> $R/summary.txt
finish
