#!/bin/bash
# Session 10, GPU run 5: the tuner over H=4 and H=16 forward shapes: heuristic, incumbent and the
# per-column forward (`ForwardConfig.unroll_h`).
export PYTHONPATH=$PWD:$PWD/benchmarks
cp recfuse/ops/tuned/h100-80gb-hbm3.json $OUT/
timeout 560 python benchmarks/tune_kernels.py --dims 32 48 64 128 160 256 512 --hs 4 16 --dtypes fp32 bf16 \
  --kinds forward --only unroll_h --save $OUT --merge 2>&1 | grep -v "cfg/s" | tail -34 | tee $OUT/tune_unroll_fwd.txt
