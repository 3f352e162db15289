#!/usr/bin/env bash
# Drift: build throwaway environments with the newest releases the packages' metadata allows,
# print how each differs from its lock, and run the integration tests there.
#   locks/drift.sh [PYTHON] [WORKDIR]
# Exit 0 when both integration suites pass on the newest releases, 1 otherwise.
set -uo pipefail
PY=${1:-python3} tmp=${2:-/tmp/kvabi-drift}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
mkdir -p "$tmp"
status=0
declare -A result
for env in core vllm; do
  echo "== $env: newest releases into $tmp/$env"
  if ! PY=$PY locks/setup-env.sh "$env" "$tmp/$env" newest > "$tmp/$env-setup.log" 2>&1; then
    echo "   setup failed (log: $tmp/$env-setup.log)"; result[$env]="setup failed"; status=1; continue
  fi
  echo "== $env: differences from locks/$env.txt"
  "$tmp/$env/bin/python" locks/envlock.py diff "locks/$env.txt" | sed 's/^/   /'
  if [ "$env" = core ]; then tests=(integrations/transformers/tests); else tests=(integrations/vllm/tests); fi
  echo "== $env: ${tests[*]} on the newest releases"
  if "$tmp/$env/bin/python" -m pytest -q -x "${tests[@]}" > "$tmp/$env-tests.log" 2>&1; then
    result[$env]="passed"
  else
    result[$env]="FAILED"; status=1
  fi
  tail -n 1 "$tmp/$env-tests.log" | sed 's/^/   /'
  echo "   (log: $tmp/$env-tests.log)"
done
# The transformers range stops below the next minor release: try the newest release beyond it
# too, with kvabi-transformers' version refusal turned into a warning, so that its check of
# transformers' internals names what changed before the range is widened.
newest="untried"
if [ -x "$tmp/core/bin/python" ]; then
  "$tmp/core/bin/python" -m pip install -q --upgrade transformers > "$tmp/tf-newest.log" 2>&1
  tfv=$("$tmp/core/bin/python" -c "import transformers; print(transformers.__version__)")
  echo "== transformers $tfv (newest, beyond the tested range): integrations/transformers/tests"
  if KVABI_TRANSFORMERS_UNTESTED=1 "$tmp/core/bin/python" -m pytest -q -x integrations/transformers/tests \
      > "$tmp/tf-newest-tests.log" 2>&1; then newest="passed"; else newest="FAILED"; fi
  tail -n 1 "$tmp/tf-newest-tests.log" | sed 's/^/   /'
  echo "   (log: $tmp/tf-newest-tests.log)"
  newest="$newest on $tfv"
fi
echo "== drift summary: core (transformers integration) ${result[core]}, vllm ${result[vllm]}," \
     "newest transformers (informative) $newest"
exit $status
