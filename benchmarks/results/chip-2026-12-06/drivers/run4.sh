#!/bin/bash
set -u
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p $RES
python3 -c "import jax, jax_overlap; print(jax.__version__, jax.devices(), jax_overlap.__file__)"
timeout 330 python3 benchmarks/calibrate.py --measure $RES/calibration --deadline 300 --only train_step_fsdp_scan_f32 train_step_fsdp_scan_bf16 train_step_shard_map_scan_f32 train_step_shard_map_scan_bf16 ring_attention_8k_bf16 pipeline_stage_tick_f32 train_step_jit_scan_f32 2>&1 | grep -v -E "DeprecationWarning|warnings.warn|hugepages"
timeout 150 python3 .chip/capture_more.py $RES/captures pipeline_stage_tick_f32 train_step_fsdp_scan_bf16 ring_attention_8k_bf16 2>&1 | grep -v -E "DeprecationWarning|warnings.warn|hugepages"
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT
