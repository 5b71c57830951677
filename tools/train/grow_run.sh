#!/usr/bin/env bash
# The depth-growth experiment on one GPU (device machine, from the repo root), in the background so
# that it outlasts one 10-minute call:
#   phase A: train.py's two-hop continuation (answers and questions in the loss, the two-hop drill in
#            the mix; the recipe that took two-hop 57 -> 70 in attempt 10) from models/default twice,
#            side by side: as shipped (control) and grown by copies of layers GROW (default 4-7: a
#            16-layer model in Qwen3.5's 3:1 pattern, starting as the shipped one; hybrid.grow_layers;
#            GROW="4-7 6-7" races more growths, the first goes on to phase B)
#   phase B: the PIC-aware fine-tune (attempt 11's one loop) on the grown A, which phase A's
#            full-recompute-only steps take out of pic mode
# usage:
#   tools/train/grow_run.sh start [SECS]      launch, then wait up to SECS (default 560) or a traceback
#   tools/train/grow_run.sh fetchA [N] [SECS] wait for A, copy both A exports to $OUT, wait up to SECS for B
#   tools/train/grow_run.sh fetchB [N]        wait for B, copy its model to $OUT
# Model folders come back as $OUT/NAME/st.partK (15 MiB parts of model.safetensors), their other
# files and the logs in $OUT/small_A.tar / small_B.tar (small/NAME/): `cat st.part* > model.safetensors`
# beside them. Knobs: ASECS, BSECS, GROW, NEW_LR_MULT (lr multiplier of the new layers, 2), SEED,
# CONTROL (0: no control run; the pair needs ~80 GB, an H200), A_FROM (an absolute folder: phase B alone, from it).
set -u
R=/tmp/grow_run; mkdir -p $R
TT=$(cd "$(dirname "$0")" && pwd)
A_ARGS="--start-stage 2 --max-stage 3 --min-stage-steps 1000 --seconds ${ASECS:-470} --decay-seconds 120 --lr 1e-3 \
 --warmup 50 --doc-loss-frac 0 --eval-every 200 --eval-n 40 \
 --task-mix lookup=0.2,bind=0.05,twohop=0.3,twohop_drill=0.3,aggregate=0.15 --seed ${SEED:-45}"
pipeline() {
  cd "$TT"
  local g=(${GROW:-4-7}) w
  local c=${CONTROL:-1}  # CONTROL=0: the grown runs alone (two 65536-token runs overflow an H100)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  local a=${A_FROM:-$R/A_grow}  # A_FROM=FOLDER: phase B alone, from that (e.g. a carried A export)
  [ -n "${A_FROM:-}" ] && g=() c=0
  w=$((14 / (${#g[@]} + c > 0 ? ${#g[@]} + c : 1)))  # data workers per run: 16 cores in all
  [ $c = 1 ] && PYTHONUNBUFFERED=1 python3 train.py --work $R/ctl --out $R/ctl/out --init-from-model ../../models/default $A_ARGS \
    --workers $w --export $R/A_ctl > $R/ctl.log 2>&1 &
  [ ${#g[@]} -gt 0 ] && PYTHONUNBUFFERED=1 python3 train.py --work $R/grow --out $R/grow/out --init-from-model \
    ../../models/default --grow ${g[0]} --new-lr-mult ${NEW_LR_MULT:-2} $A_ARGS --workers $w --export $R/A_grow \
    > $R/grow.log 2>&1 &
  for x in "${g[@]:1}"; do  # further growths, A only
    PYTHONUNBUFFERED=1 python3 train.py --work $R/grow$x --out $R/grow$x/out --init-from-model ../../models/default \
      --grow $x --new-lr-mult ${NEW_LR_MULT:-2} $A_ARGS --workers $w --export $R/A_grow$x > $R/grow$x.log 2>&1 &
  done
  wait
  touch $R/A.done
  # micro 16 needs more than an H100's 80 GB on the 16-layer model (out of memory at step 15)
  local mib micro=16 lmicro=2
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  [ "${mib:-0}" -lt 100000 ] && micro=8 lmicro=1
  PYTHONUNBUFFERED=1 python3 pic_finetune.py --model $a --out $R/B --seconds ${BSECS:-480} --decay-seconds 150 \
    --micro $micro --accum 32 --lr 4e-4 --warmup 10 --pic-frac 0.85 --task-mix lookup=0.15,twohop=0.35,aggregate=0.5 \
    --long-frac 0.3 --long-micro $lmicro --full-rows 65536 --full-rows-stage 3 --full-rows-workers 12 \
    --full-rows-mix lookup=0.2,bind=0.05,twohop=0.3,twohop_drill=0.3,aggregate=0.15 \
    --eval-every 100000 --eval-n 20 --eval-long-n 0 --seed ${SEED:-45} --save-every 0 > $R/B.log 2>&1
  touch $R/B.done
}
pack() {  # model folder $1 -> $OUT/$2/st.partK (under the 16 MiB a returned file may have); the
  # folder's other files go to $R/small/$2, returned in one tar (a call returns 8 files at most)
  mkdir -p $OUT/$2 $R/small/$2
  split -b 15M -d -a 1 $1/model.safetensors $OUT/$2/st.part
  (cd $1 && cp $(ls | grep -v '^model.safetensors$') $R/small/$2/)
}
case "${1:-}" in
start)
  pkill -f "grow_run.sh pipeline"; pkill -f train.py; pkill -f pic_finetune.py; rm -rf $R; mkdir -p $R
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  setsid nohup bash "$0" pipeline > $R/pipeline.log 2>&1 < /dev/null &
  end=$((SECONDS + ${2:-560}))
  while [ $SECONDS -lt $end ]; do sleep 5; grep -l Traceback $R/*.log && break; done
  tail -n 4 $R/ctl.log $R/grow.log
  grep -h "held-out\|grown\|parameters" $R/ctl.log $R/grow.log | cut -c1-400
  tail -n 3 $R/B.log 2>/dev/null ;;
pipeline) pipeline ;;
fetchA)
  for _ in $(seq 1 ${2:-120}); do [ -f $R/A.done ] && break; sleep 5; done
  tail -n 4 $R/ctl.log $R/grow.log
  [ -d $R/A_ctl ] && pack $R/A_ctl ctl
  [ -d $R/A_grow ] && pack $R/A_grow grow
  for d in $R/A_grow?*; do [ -d $d ] && pack $d ${d#$R/A_}; done  # further growths (files back: 8 at most)
  (cd $R && tar cf $OUT/small_A.tar *.log */train_log.jsonl small)
  end=$((SECONDS + ${3:-400}))
  while [ $SECONDS -lt $end ] && [ ! -f $R/B.done ]; do sleep 5; done
  tail -n 3 $R/B.log ;;
fetchB)
  for _ in $(seq 1 ${2:-100}); do [ -f $R/B.done ] && break; sleep 5; done
  tail -n 4 $R/B.log
  [ -d $R/B/model ] && pack $R/B/model B
  (cd $R && tar cf $OUT/small_B.tar B.log B/log.jsonl pipeline.log small/B) ;;
*) echo "usage: $0 start|fetchA|fetchB" >&2; exit 2 ;;
esac
ls -la $OUT $OUT/* 2>/dev/null | head -30
