#!/bin/bash
# Session 10, GPU run 1: the new CUDA tests (the NaN rule as compiled, the per-column small-H
# backward), then the tuner over H=4 backward shapes: heuristic, incumbent and unroll_h candidates.
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_trust_round10_op.py tests/test_op_trust.py \
  -k "gpu_kernels or unrolled_small_h_backward_on_the_gpu" 2>&1 | tail -15 | tee $OUT/cuda_tests.txt
cp recfuse/ops/tuned/h100-80gb-hbm3.json $OUT/ 2>/dev/null
timeout 360 python benchmarks/tune_kernels.py --dims 32 48 64 128 160 256 512 --hs 4 --dtypes fp32 bf16 \
  --kinds backward --only unroll_h --save $OUT --merge 2>&1 | grep -v "^tune:.*it/s\|cfg/s" | tail -40 | tee $OUT/tune_unroll.txt
