#!/bin/bash
bash scripts/gpu-check none > $OUT/check.log 2>&1
export PYTHONPATH="$PWD/src:$PWD/tests:/tmp/site" PYTHONUNBUFFERED=1
cat $OUT/machine.txt
timeout -s INT 300 python3 -m pytest -q -n 15 -p no:cacheprovider tests/test_kda_gluon.py tests/test_kda_gluon_dv_local.py tests/test_kda_gluon_stage9.py tests/test_kda_gluon_wy.py > $OUT/tests.log 2>&1; echo rc=$? $SECONDS s
grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -30 | cut -c1-300
left=$((430 - SECONDS))
if [ $left -gt 120 ]; then
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $left compute-sanitizer --tool racecheck --kernel-name kns=_tf32_recurrence_kernel --print-limit 20 python3 scripts/sanitize_kda.py quick first > $OUT/racecheck-recurrence.log 2>&1; echo "racecheck rc=$? $SECONDS s"
tail -4 $OUT/racecheck-recurrence.log
fi
