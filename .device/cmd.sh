set -x
cuda_ops_test --gtest_brief=1 --gtest_filter='*Attention*:*Chain*:*Matmul*' 2>&1 | tail -5
hypic bench prefill --backend cuda --config bench/configs/qwen3_5_0_8b.json --random-weights --lengths 4096,32768 --repeats 2 2>&1 | tail -4
cfg=bench/configs/qwen3_5_35b_a3b.json
HYPIC_GDN_CHAIN_PROF=1 HYPIC_CUDA_PROFILE=2 hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --segments 16 --segment-tokens 2048 --requests 5 --modes pic > $OUT/profile.txt 2>&1
grep -v "^gdn chain" $OUT/profile.txt | tail -75; grep "^gdn chain" $OUT/profile.txt | tail -2
hypic bench ttft --backend cuda --config $cfg --random-weights --query-tokens 64 --prefix-tokens 32 --segments 16 --segment-tokens 2048 --requests 5 --modes pic 2>&1 | tail -3
