#!/bin/bash
# Session 10, GPU run 4: CUDA checks of the per-column backward at H = 6-8 and the constant-row
# rule, then the tuner over H=8 backward shapes (tl.dot padded to 16 vs per-column sums).
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 170 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_op_trust.py tests/test_trust_round10_op.py \
  -k "cuda or gpu" 2>&1 | tail -4 | tee $OUT/cuda_tests4.txt
cp recfuse/ops/tuned/h100-80gb-hbm3.json $OUT/
timeout 400 python benchmarks/tune_kernels.py --dims 32 48 64 128 160 256 512 --hs 8 --dtypes fp32 bf16 \
  --kinds backward --only unroll_h --save $OUT --merge 2>&1 | grep -v "cfg/s" | tail -20 | tee $OUT/tune_unroll_h8.txt
