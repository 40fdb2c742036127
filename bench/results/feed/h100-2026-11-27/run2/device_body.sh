#!/bin/bash
# Second device run: after the single-threaded slot copy. Variables from device.sh.
set -u
{ date; nproc; nvidia-smi -L 2>&1; PYTHONPATH=$NEW $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no gpu')"; } > $R/host.txt 2>&1
cat $R/host.txt > $R/summary.txt
$PY .whl/cpu_sampler.py 4 > $R/cpu.txt 2>&1 &
SAMPLER=$!
if [ -z "$QUICK" ]; then
  FEED="--out $R/feed --workers 15,16 --stock-workers 15 --row-timeout 90"
  SCAL="--workers 1,4,8,15,16 --num-images 3000 --min-seconds 3"
else
  FEED="--quick --accelerator cpu_eager --out $R/feed"
  SCAL="--workers 1,2 --num-images 600 --min-seconds 1 --stage-images 50"
fi
echo "== feed $(date +%T)" >> $R/summary.txt
PYTHONPATH=$NEW timeout 260 $PY -m bench.feed $FEED > $R/feed.log 2>&1; echo "feed rc=$?" >> $R/summary.txt
grep -E "^\||goals|data:|GPU|no GPU|cpu_count" $R/feed.log >> $R/summary.txt
echo "== scaling $(date +%T)" >> $R/summary.txt
PYTHONPATH=$NEW timeout 80 $PY -m bench.pipeline --dataset imagenet $SCAL --data /tmp/scal --out $R/scaling > $R/scaling.log 2>&1; echo "scaling rc=$?" >> $R/summary.txt
grep -E "^\||stages|usable" $R/scaling.log | tail -9 >> $R/summary.txt
kill $SAMPLER 2>/dev/null
echo "== done $(date +%T)" >> $R/summary.txt
