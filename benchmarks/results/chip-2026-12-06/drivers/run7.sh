#!/bin/bash
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p $RES
python3 -c "import jax, jaxlib, jax_overlap; print(jax.__version__, jaxlib.__version__, jax.devices())"
F='DeprecationWarning|warnings.warn|hugepages|LayerArgumentOrder'
timeout 400 python3 benchmarks/calibrate.py --measure $RES/calibration --deadline 380 --only pipeline_stage_4_microbatches_kept_seq512_f32 pipeline_stage_4_microbatches_recomputed_seq512_f32 2>&1 | grep -v -E "$F" | tee $RES/calibrate.log
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT
