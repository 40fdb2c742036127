#!/bin/bash
# The measurements (see device.sh); variables come from it.
set -u
{ date; nproc; nvidia-smi -L 2>&1; lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|MHz|NUMA node0"; free -g | head -2; df -h /dev/shm | tail -1
  PYTHONPATH=$NEW $PY -c "import torch, torchvision, timm, os; print(torch.__version__, torchvision.__version__, timm.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no gpu', len(os.sched_getaffinity(0)))"; } > $R/host.txt 2>&1
cat $R/host.txt > $R/summary.txt

if [ -z "$QUICK" ]; then
  FEED="--out $R/feed --workers 15,8 --stock-workers 15 --row-timeout 100"
  DATA=/tmp/tpustream-feed/13000-images
  OLD_ARGS="epochs=3 accelerator=cuda data=imagenet data.root=$DATA model=resnet50 data.image_size=224 batch_size=256 precision=bf16 accelerator.channels_last=true eval_every=0 data.num_workers=15"
  SCAL="--workers 1,4,8,15,16 --num-images 3000 --min-seconds 3"
  SCALE_W="8 15"; SCALE_N=256
else
  FEED="--quick --accelerator cpu_eager --out $R/feed"
  DATA=/tmp/tpustream-feed/quick
  OLD_ARGS="epochs=2 accelerator=cpu_eager data=imagenet data.root=$DATA model=small_cnn data.image_size=64 batch_size=32 eval_every=0 data.num_workers=1"
  SCAL="--workers 1,2 --num-images 600 --min-seconds 1 --stage-images 50"
  SCALE_W="1"; SCALE_N=32
fi

# Which processes and threads are busy, every 10 s (is a replica's training thread at 100%?).
( while true; do echo "== $(date +%T)"; top -b -H -n 1 -w 160 | head -32; sleep 10; done ) > $R/top.txt 2>&1 &
TOP=$!

# 1. The headline: synthetic, tpustream (this tree) at 15 and 8 workers, stock at 15.
echo "== feed $(date +%T)" >> $R/summary.txt
PYTHONPATH=$NEW timeout 420 $PY -m bench.feed $FEED > $R/feed.log 2>&1; echo "feed rc=$?" >> $R/summary.txt
grep -E "^\||goals|data:|GPU|no GPU|cpu_count" $R/feed.log >> $R/summary.txt

# 2. The same tpustream row from the tree before this session (the code), same data.
echo "== old tree w=15 $(date +%T)" >> $R/summary.txt
(cd old && PYTHONPATH=$OLD timeout 110 $PY train.py $OLD_ARGS output_dir=$R/old-run resume=null hydra.run.dir=$R/old-run > $R/old-run.log 2>&1); echo "old rc=$?" >> $R/summary.txt
PYTHONPATH=$NEW $PY -c "
import json
from bench.ab import steady_rate
rows = [json.loads(l) for l in open('$R/old-run/metrics.jsonl') if l.strip()]
for r in rows: print('old epoch', r.get('epoch'), round(r.get('global_rate', 0)), 'wait', r.get('input_wait_fraction'), 'bound', r.get('input_bound_fraction'))
print('old steady', round(steady_rate(rows)))
" >> $R/summary.txt 2>&1

# 3. Scaling of this tree's loader on this host (bench.pipeline.scaling).
echo "== scaling $(date +%T)" >> $R/summary.txt
PYTHONPATH=$NEW timeout 150 $PY -m bench.pipeline --dataset imagenet $SCAL --data /tmp/scal --out $R/scaling > $R/scaling.log 2>&1; echo "scaling rc=$?" >> $R/summary.txt
grep -E "^\||stages|usable" $R/scaling.log | tail -8 >> $R/summary.txt

# 4. The replica's CPU per batch, old tree and this one, same loader settings (no GPU copy).
echo "== replica cost $(date +%T)" >> $R/summary.txt
for which in old new; do
  src=$ROOT/src; [ $which = old ] && src=$ROOT/old/src
  PYTHONPATH=$src:$ROOT:$SITE SRC=$src ROOT=$DATA/train B=$SCALE_N E=2 timeout 100 $PY .whl/scale.py $SCALE_W 2>&1 | grep "^W=" | sed "s/^/$which /" >> $R/summary.txt
done
kill $TOP 2>/dev/null
echo "== done $(date +%T)" >> $R/summary.txt
