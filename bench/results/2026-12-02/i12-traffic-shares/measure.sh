#!/bin/bash
# Interleaved trainings of the wide MLP at dp=4 with the old and the new LP shares.
cd /work/wt-traffic
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for round in 1 2 3; do
  for which in old new; do
    if [ $which = old ]; then S="[181,181,90,60]"; else S="[192,191,83,46]"; fi
    m=/tmp/i12t/runs/$which-$round.jsonl
    l0=$(cut -d' ' -f1 /proc/loadavg)
    ./build/meshtrain train --config configs/mlp_fashion.toml --nproc 4 --set train.steps=30 --set train.eval=false --set train.threads=1 --set train.log_every=1 --set train.precision=f32 --set 'train.checkpoint=""' --set train.batch_size=512 --set model.hidden=[2048,2048] --set parallel.dp=4 --set parallel.tp=1 --set parallel.pp=1 --set dist.zero_stage=2 --set dist.slowdown=[1,1,2,3] --set dist.batch_shares=$S --metrics $m > /tmp/i12t/runs/$which-$round.log 2>&1
    l1=$(cut -d' ' -f1 /proc/loadavg)
    echo "$which $round rc=$? load $l0 -> $l1 $(date -u +%H:%M:%S)"
  done
done
