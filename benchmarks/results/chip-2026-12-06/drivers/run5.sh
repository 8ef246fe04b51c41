#!/bin/bash
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p $RES
git log -1 --format=%h 2>/dev/null; python3 -c "import jax, jaxlib, jax_overlap; print(jax.__version__, jaxlib.__version__, jax.devices())"
F='DeprecationWarning|warnings.warn|hugepages|LayerArgumentOrder'
timeout 300 python3 benchmarks/chip_fsdp_vs_scan.py --out $RES/fsdp --deadline 270 --variants "jit, lax.scan" "shard_map, lax.scan" fsdp_scan "fsdp_scan bucket=False" 2>&1 | grep -v -E "$F" | tee $RES/fsdp.log
timeout 200 python3 benchmarks/calibrate.py --measure $RES/calibration --deadline 180 --only train_step_fsdp_scan_f32 train_step_fsdp_scan_bf16 train_step_shard_map_scan_f32 train_step_shard_map_scan_bf16 pipeline_stage_tick_f32 2>&1 | grep -v -E "$F" | tee $RES/calibrate.log
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT
