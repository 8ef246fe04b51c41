#!/bin/bash
# The second device command: the dependent-permute capture and live
# measure() with the fixed reader; more calibration points; bf16 profiles.
T0=$(date +%s); TOTAL=${1:-300}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$HERE/src:$PYTHONPATH PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
RES=/tmp/res; mkdir -p $RES; LOG=$OUT/log.txt
left() { echo $(( T0 + TOTAL - $(date +%s) )); }
stage() {
  local name=$1 share=$2; shift 2
  local l=$(left); local budget=$(( l * share / 100 ))
  if [ "$budget" -lt 20 ]; then echo "=== $name: skipped, $l s left" | tee -a $LOG; return; fi
  echo "=== $name: budget $budget s ($l s left) at $(date -u +%T)" | tee -a $LOG
  timeout -k 5 $budget "$@" --deadline $(( budget - 30 )) 2>&1 | grep -v -E "DeprecationWarning|warnings.warn|hugepages" | tee -a $LOG
  echo "=== $name: rc ${PIPESTATUS[0]} at $(date -u +%T)" | tee -a $LOG
  sleep 3
}
stage captures 35 python3 $HERE/benchmarks/chip_captures.py --out $RES/captures --measure --only futures scan_ordered scan_dependent
stage calibrate 45 python3 $HERE/benchmarks/calibrate.py --measure $RES/calibration --only matmul_2048x1024x4096_float32 matmul_2048x4096x1024_float32 matmul_2048x1024x4096_bfloat16 attention_scores_f32 attention_scores_bf16 elementwise_bf16_268MB row_sums_f32_537MB transpose_f32_537MB train_step_jit_scan_bf16 train_step_shard_map_scan_bf16 train_step_fsdp_scan_bf16
stage fsdp 100 python3 $HERE/benchmarks/chip_fsdp_vs_scan.py --out $RES/fsdp --profile $RES/fsdp_profiles --profile-dtype bfloat16 --dtypes bfloat16 --variants fsdp_scan "shard_map, lax.scan"
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT | tee -a $LOG
