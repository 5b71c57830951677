#!/bin/bash
# Train several recipes side by side on one GPU (one step of this small model keeps the H200 about
# 60% busy, so two runs share it at little cost) and bring back only the best one.
#
# usage (device machine, from the repo root):
#   tools/train/race.sh OUT INIT_DIR NAME1 "train.py args" [NAME2 "train.py args" ...]
# INIT_DIR holds the starting point (ckpt.* parts and train_log.jsonl). Every recipe resumes from a
# copy of it in /tmp/race/NAME and exports to /tmp/race/NAME/export. The winner (highest held-out
# moderate lookup exact match at its end, then twohop) comes back as OUT/model.safetensors.partN +
# OUT/bundle.tar (the other files of the export, its train_log.jsonl included); every recipe's
# stdout comes back as OUT/NAME.txt.
set -u
out=$1 init=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
names=()
while [ $# -ge 2 ]; do
  name=$1 args=$2
  shift 2
  names+=("$name")
  w=/tmp/race/$name
  mkdir -p "$w/out"
  cp "$init"/ckpt.* "$init"/train_log.jsonl "$w"/
  (cd "$here" && PYTHONUNBUFFERED=1 python3 train.py --work "$w" --out "$w/out" --export "$w/export" $args \
    >"$out/$name.txt" 2>&1) &
done
wait
best=$(python3 - "${names[@]}" <<'EOF'
import json, sys
best, key = None, None
for n in sys.argv[1:]:
    try:
        recs = [json.loads(l) for l in open(f"/tmp/race/{n}/train_log.jsonl")]
        s = [r["scores"] for r in recs if r.get("heldout") == "moderate"][-1]
        k = (s["lookup"]["em"], s["twohop"]["em"])
    except Exception as e:  # a recipe that crashed loses
        print(f"{n}: {e}", file=sys.stderr)
        continue
    print(f"{n}: moderate lookup {k[0]} twohop {k[1]}", file=sys.stderr)
    if key is None or k > key:
        best, key = n, k
print(best or "")
EOF
)
echo "best: ${best:-none}" | tee "$out/best.txt"
[ -n "$best" ] || exit 1
e=/tmp/race/$best/export
cp /tmp/race/"$best"/train_log.jsonl "$e"/
split -b 15M -d -a 1 "$e"/model.safetensors "$out"/model.safetensors.part
tar cf "$out"/bundle.tar -C "$e" --exclude model.safetensors .
