#!/bin/bash
# The device command: runs the chip scripts one after another (one process
# holds the chip at a time), each under a deadline, and tars what they wrote.
# Usage: bash .chip/run.sh TOTAL_SECONDS STAGE...
T0=$(date +%s)
TOTAL=${1:-560}; shift
STAGES=${@:-captures calibrate fsdp ring}
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$HERE/src:$PYTHONPATH PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
RES=/tmp/res; mkdir -p $RES
LOG=$OUT/log.txt
left() { echo $(( T0 + TOTAL - $(date +%s) )); }
stage() {  # stage NAME SHARE_OF_WHAT_IS_LEFT(percent) CMD...
  local name=$1 share=$2; shift 2
  local l=$(left); local budget=$(( l * share / 100 ))
  if [ "$budget" -lt 20 ]; then echo "=== $name: skipped, $l s left" | tee -a $LOG; return; fi
  echo "=== $name: budget $budget s ($l s left) at $(date -u +%T)" | tee -a $LOG
  timeout -k 5 $budget "$@" --deadline $(( budget - 45 )) 2>&1 | grep -v -E "DeprecationWarning|warnings.warn" | tee -a $LOG
  echo "=== $name: rc ${PIPESTATUS[0]} at $(date -u +%T)" | tee -a $LOG
  sleep 3
}
{ python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; python3 -c "import platform; print(platform.libc_ver())"; pip list 2>/dev/null | grep -i -E "libtpu|jax"; } 2>&1 | tee -a $LOG
for s in $STAGES; do
  case $s in
    captures) stage captures 30 python3 $HERE/benchmarks/chip_captures.py --out $RES/captures --measure ;;
    calibrate) stage calibrate 45 python3 $HERE/benchmarks/calibrate.py --measure $RES/calibration ;;
    fsdp) stage fsdp 70 python3 $HERE/benchmarks/chip_fsdp_vs_scan.py --out $RES/fsdp --profile $RES/fsdp_profiles ;;
    ring) stage ring 100 python3 $HERE/benchmarks/chip_ring_vs_flash.py --out $RES/ring ;;
    *) echo "unknown stage $s" | tee -a $LOG ;;
  esac
done
cd /tmp && tar czf $OUT/results.tar.gz res && ls -la $OUT | tee -a $LOG
find /tmp/res -type f -size +100k -exec ls -la {} \; | tee -a $LOG
