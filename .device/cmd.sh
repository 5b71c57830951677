set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
cuda_ops_test --gtest_brief=1 2>&1 | tail -15
cuda_model_test --gtest_brief=1 2>&1 | tail -6
cfg=bench/configs/qwen3_5_35b_a3b.json
HYPIC_CUDA_PROFILE=2 hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --segments 16 --segment-tokens 2048 --requests 5 --modes pic 2>&1 | tail -60 > $OUT/profile.txt
tail -60 $OUT/profile.txt
hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --sweep-segments 1,4,16,64 --segment-tokens 1024 --requests 3 --modes pic --cache-budget-mib 32768 --json > $OUT/sweep.jsonl 2>$OUT/sweep.err
cat $OUT/sweep.jsonl | cut -c1-400
tail -20 $OUT/sweep.err
