for r in 1 2; do for t in /work/main /tmp/base2; do
  echo "== $t round $r $(date +%T)"
  (cd $t && PYTHONPATH=$t timeout 600 /work/main/.venv/bin/python benchmarks/capture_overhead.py --variants plain,capture --batch-sizes 4,16 --repeats 2 --no-hf 2>&1 | grep -A3 "^in-flight  plain")
done; done
echo DONE
