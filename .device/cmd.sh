set -x
cuda_ops_test --gtest_brief=1 2>&1 | tail -8
cuda_model_test --gtest_brief=1 2>&1 | tail -3
cfg=bench/configs/qwen3_5_35b_a3b.json
HYPIC_GDN_CHAIN_PROF=1 HYPIC_CUDA_PROFILE=2 hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --segments 16 --segment-tokens 2048 --requests 5 --modes pic > $OUT/profile.txt 2>&1
grep -v "^gdn chain" $OUT/profile.txt | tail -34; grep "^gdn chain" $OUT/profile.txt | tail -1
hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --segments 16 --segment-tokens 2048 --requests 5 --modes pic --json > $OUT/ttft.jsonl 2>&1; tail -3 $OUT/ttft.jsonl
hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --sweep-segments 1,4,16,64 --segment-tokens 1024 --requests 3 --modes pic --cache-budget-mib 32768 --json > $OUT/sweep.jsonl 2>$OUT/sweep.err
grep -o '"ttft_ms_median":[0-9.]*' $OUT/sweep.jsonl
