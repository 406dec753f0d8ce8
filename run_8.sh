export TILEPORT_TESTS="tests/test_kda_forms.py tests/test_kda_chunk_flags.py tests/test_kda_errors.py tests/test_kda_chunk_algebra.py tests/test_kda_gluon.py tests/test_kda_gluon_wy.py tests/test_kda_kept_tiles.py tests/test_kda_gluon_solve.py" TILEPORT_TESTS_TIMEOUT=480 TILEPORT_FULL_TIMEOUT=40
bash scripts/gpu-check tests 2>&1 | tail -12
cp $OUT/tests.log $OUT/gate-part-b.log 2>/dev/null
