#!/bin/bash
# Session 10, GPU run 6 (H200): the grid's H=4 points in the torchrec layout with the H100 table
# (same-architecture pick) after the per-column backward, and a cProfile of transform's forward.
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
cp benchmarks/results/grid_h200.json $OUT/
timeout 330 python benchmarks/grid.py --hs 4 --layouts BFD --save $OUT --merge --max-seconds 300 2>&1 | grep -v "it/s\]" > $OUT/grid_h200_h4.log
grep " 4 \|target\|points" $OUT/grid_h200_h4.log | tail -34
timeout 150 python diag_host_transform.py > $OUT/diag_host_transform.txt 2>&1; grep "==" $OUT/diag_host_transform.txt
