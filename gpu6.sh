#!/bin/bash
export PYTHONPATH=$PWD:$PWD/benchmarks
cp recfuse/ops/tuned/h100-80gb-hbm3.json $OUT/
timeout 400 python benchmarks/tune_kernels.py --dims 48 96 160 --hs 4 --dtypes fp32 bf16 --kinds forward --rep 8 --save $OUT --merge > $OUT/tune.log 2>&1
tr '\r' '\n' < $OUT/tune.log | grep -v "cfg/s" | tail -12
