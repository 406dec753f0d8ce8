set -u
mkdir -p $OUT/ab $OUT/t
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=0 KDA_AB_SECTIONS=forward,backward KDA_AB_ONLY="chunk 4w BV64,chunk+cumsum3 4w BV64,chunk+g32 4w BV64,chunk+cumsum3+g32 4w BV64,chunk whole,chunk+cumsum3 whole,chunk+g32 whole,chunk+cumsum3+g32 whole" timeout 540 python3 scripts/kda_ab.py > $OUT/ab/kda_ab.log 2>&1; echo "ab rc=$?" >> $OUT/ab/kda_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout -s INT 520 python3 -m pytest -q -ra -p no:cacheprovider -n 15 --tb=short -W ignore tests/test_kda_forms.py tests/test_gdn_parity.py -k "stage3 or sums or T330" > $OUT/t/tests.log 2>&1; echo "tests rc=$?" >> $OUT/t/tests.log ) &
wait
tail -5 $OUT/t/tests.log; cat $OUT/ab/kda_ab.log | tail -30
