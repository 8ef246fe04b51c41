#!/bin/bash
# The third device command: calibration and fsdp-vs-scan again, with the
# device's own time of each program (profiler) beside the wall time.
T0=$(date +%s); TOTAL=${1:-400}
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
stage calibrate 62 python3 $HERE/benchmarks/calibrate.py --measure $RES/calibration
stage fsdp 100 python3 $HERE/benchmarks/chip_fsdp_vs_scan.py --out $RES/fsdp --variants "jit, lax.scan" "shard_map, lax.scan" fsdp_scan "fsdp_scan bucket=False"
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT | tee -a $LOG
