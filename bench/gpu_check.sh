#!/usr/bin/env bash
# The GPU check (docs/gpu.md): bench/gpu_check.sh OUTDIR [--dry-run]
#
# Installs the wheels carried in .whl/ (if any) that the machine lacks, then runs
# bench/gpu_check.py, which measures attention kernels, the trainer's step and the PyTorch peer
# under per-part time caps (~7.5 min in all) and writes OUTDIR/gpu_check.json (also printed).
# --dry-run: the same script on CPU with tiny shapes, in well under a minute.
set -u
out=${1:?usage: bench/gpu_check.sh OUTDIR [--dry-run]}
shift
cd "$(dirname "$0")/.." || exit 1
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gattn-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gattn-site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
exec timeout 480 "$py" bench/gpu_check.py --out "$out" "$@"
