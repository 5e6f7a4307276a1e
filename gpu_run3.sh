#!/bin/bash
# Session 10, GPU run 3: CUDA checks after the constant-row fix (the op's edge cases, the NaN rule,
# the tables' small-H path, chains), the grid's BFD per-feature H=1 points (the fix sits in the row
# kernels' statistics), then the host-overhead benchmark with rounds.
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 230 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_op_trust.py tests/test_trust_round10_op.py \
  tests/test_op_cuda_property.py tests/test_launch_binding.py -k "cuda or gpu or Cuda or CUDA" 2>&1 | tail -6 | tee $OUT/cuda_tests3.txt
cp benchmarks/results/grid_h100.json $OUT/
timeout 150 python benchmarks/grid.py --hs 1 --layouts BFD --affine per_feature --save $OUT --merge --max-seconds 130 2>&1 \
  | grep -v "it/s\]" > $OUT/grid_h1.log; grep " 1 " $OUT/grid_h1.log | head -20
timeout 180 python benchmarks/host_overhead.py --rounds 3 --json $OUT/host_overhead_h100.json > $OUT/host_overhead_h100.txt 2>&1; tail -32 $OUT/host_overhead_h100.txt
