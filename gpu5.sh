#!/bin/bash
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 320 python -m pytest -q -p no:cacheprovider -rf tests/test_feature_mlp.py -k "cuda and (D32H4 or D32H64 or B4079D64)" > $OUT/cuda_narrow_rows.txt 2>&1
tail -4 $OUT/cuda_narrow_rows.txt
RECFUSE_CUDA_FUZZ_EXAMPLES=25 timeout 130 python -m pytest -q -p no:cacheprovider -rf tests/test_op_cuda_property.py > $OUT/cuda_property.txt 2>&1
tail -3 $OUT/cuda_property.txt
timeout 100 python benchmarks/host_overhead.py --json $OUT/host_overhead_h100.json > $OUT/host_overhead_h100.txt 2>&1
tail -24 $OUT/host_overhead_h100.txt
