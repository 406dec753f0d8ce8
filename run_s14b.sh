set -u
mkdir -p $OUT/loop $OUT/prof
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=0 OUT=$OUT/loop TILEPORT_LOOP_OP=kda TILEPORT_LOOP_PART=gate TILEPORT_TEST_WORKERS=15 TILEPORT_LOOP_TIMEOUT=560 TILEPORT_LOOP_TEXT="KDA gate with CUMSUM_FORM stage-3 and GATE_SUMS_16BIT fp32 the defaults (rows 12, 13; their gate forms passed on the H200 at 217fafc). Prediction: all pass" bash scripts/gpu-check loop > $OUT/loop/gpu-check.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1; KDA_AB_SECTIONS=profile,profile-backward timeout 170 python3 scripts/kda_ab.py > $OUT/prof/kda_profile.log 2>&1; echo "profile rc=$?" >> $OUT/prof/kda_profile.log
  OUT=$OUT/prof TILEPORT_BENCH_OPS=kda TILEPORT_BENCH_TIMEOUT=390 bash scripts/gpu-check bench > $OUT/prof/gpu-check.log 2>&1 ) &
wait
tail -4 $OUT/loop/gpu-check.log; grep -A14 "== kda" $OUT/prof/kda_profile.log | cut -c1-170; tail -25 $OUT/prof/gpu-check.log
