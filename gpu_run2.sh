#!/bin/bash
# Session 10, GPU run 2: CUDA op checks under the new small-H heuristic and table, then the grid's
# H=4 points re-measured (merged into the committed grid).
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 150 python -m pytest -q -p no:cacheprovider -m "not interpret" tests/test_op_trust.py -k "cuda or gpu" 2>&1 | tail -6 | tee $OUT/cuda_tests2.txt
cp benchmarks/results/grid_h100.json $OUT/
timeout 420 python benchmarks/grid.py --hs 4 --save $OUT --merge --max-seconds 390 2>&1 | grep -v "it/s\]" | tail -70 > $OUT/grid_h4.log
tail -70 $OUT/grid_h4.log | grep -i " 4 \|median\|worst\|skipped" | head -80
