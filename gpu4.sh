#!/bin/bash
export PYTHONPATH=$PWD:$PWD/benchmarks
cp benchmarks/results/grid_h100.* $OUT/
RECFUSE_CUDA_FUZZ_EXAMPLES=100 timeout 300 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_op_cuda_property.py tests/test_op_trust.py > $OUT/cuda_property.txt 2>&1
tail -3 $OUT/cuda_property.txt
for i in 1 2; do
python benchmarks/grid.py --hs 1 --dims 64 128 160 --dtypes fp32 --affine per_feature --peer-every 0 > $OUT/h1_repeat_$i.log 2>&1
grep -E "^ +layer_norm" $OUT/h1_repeat_$i.log
done
python benchmarks/grid.py --hs 4 16 64 --peer-every 0 --save $OUT --merge --max-seconds 170 > $OUT/grid_c.log 2>&1
tr '\r' '\n' < $OUT/grid_c.log | grep -v "it/s\]\|s/it\]" | tail -4
