#!/bin/bash
# Session 10, GPU run 9: the CUDA tests that force kernel configs, now that a forced backward
# config reaches autograd's device thread; the per-column and broadcast-sum paths, the NaN rule,
# the constant 16-bit rows.
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 280 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_trust_round13_kernels.py \
  tests/test_trust_round10_op.py tests/test_feature_mlp.py tests/test_op_trust.py \
  -k "cuda or gpu" 2>&1 | grep -E "passed|failed|FAILED|^E " | head -30
