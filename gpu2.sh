#!/bin/bash
export PYTHONPATH=$PWD:$PWD/benchmarks
cp recfuse/ops/tuned/h100-80gb-hbm3.json $OUT/
timeout 330 python benchmarks/tune_kernels.py --dims 48 160 --hs 4 16 64 --dtypes fp32 bf16 --rep 8 --save $OUT --merge > $OUT/tune.log 2>&1
cp $OUT/h100-80gb-hbm3.json $OUT/after_a.json
timeout 200 python benchmarks/tune_kernels.py --dims 32 64 128 --hs 64 --dtypes fp32 --rep 8 --save $OUT --merge > $OUT/tune2.log 2>&1
tr '\r' '\n' < $OUT/tune.log | grep -v "cfg/s" | tail -40
tr '\r' '\n' < $OUT/tune2.log | grep -v "cfg/s" | tail -12
