export TILEPORT_TESTS="tests/test_kda_parity.py tests/test_kda_kept_tiles.py tests/test_kda_gluon_stage9.py tests/test_kda_gluon_solve.py" TILEPORT_TESTS_TIMEOUT=420 TILEPORT_FULL_TIMEOUT=60
bash scripts/gpu-check tests 2>&1 | tail -12
cp $OUT/tests.log $OUT/gate-part-a.log 2>/dev/null
grep -E "passed|failed" $OUT/tests.log | tail -2
