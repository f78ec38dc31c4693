#!/usr/bin/env bash
# The GPU suite in one command, on a CUDA machine without registry access:
#   bash scripts/bench/gpu_suite.sh [gpu_suite.py options]      (from the repository root; OUT=dir for the JSON)
# Wheels carried in $WHEELS (default .whl/: tyro, datasets, trl, ..., fetched beforehand on a machine with registry
# access, e.g. `pip download --no-deps -d .whl tyro datasets trl`) are installed into /tmp/site first (the machine's
# own torch stays); python is whichever of python / python3 exists. docs/performance.md, "On a GPU: the GPU suite".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(command -v python || command -v python3)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  timeout -k 5 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  # A carried pyarrow next to the machine's own pandas/dill broke datasets' fingerprint hashing (PicklingError);
  # random fingerprints avoid it (they only disable datasets' cache).
  cat > /tmp/site/sitecustomize.py <<'PY'
import uuid
try:
    import datasets.fingerprint as _fp, datasets.arrow_dataset as _ad
    _fp.generate_fingerprint = lambda dataset: uuid.uuid4().hex
    _ad.generate_fingerprint = _fp.generate_fingerprint
    _fp.Hasher.hash = classmethod(lambda cls, value: uuid.uuid4().hex)
except Exception as e:
    print("sitecustomize: datasets patch not applied:", e)
PY
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PY" scripts/bench/gpu_suite.py "$@"
