#!/usr/bin/env bash
# The Hopper attention comparison of benchmarks/attention.py in one run (issue 31 point 6), for the lent
# GPU machine (jax 0.11.2 + CUDA 13 plugin, cuDNN, no internet). Expected: ~1.5-2 minutes on one H100
# (mostly compilation: ~30 programs), at most 6 minutes with the per-case limits.
#
#   bash benchmarks/attention_hopper.sh        # JSON and logs into $OUT (else /tmp/attention_hopper)
#
# tokamax and the pure-Python packages it needs that the image lacks travel as wheels in .whl/tokamax
# (git-ignored); they go into a private folder on PYTHONPATH, the image's site-packages stay as they
# are. tokamax's qwix imports flax.nnx: the carried flax 0.12.12 is used only if the image's flax
# cannot import on this jax. Each case has a time limit; its JSON is rewritten after every arm, so a
# case cut short still reports what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/attention_hopper}
site=/tmp/ejax-tokamax-site
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-index --target "$site" .whl/tokamax/*.whl 2>&1 | tail -2
if ! python3 -c "import flax.nnx" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target "$site" .whl/tokamax/flax/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import sys, jax
from ejax.kernels.attention import tokamax_gpu
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, {jax.devices()[0].device_kind}, "
      f"compute capability {getattr(jax.devices()[0], 'compute_capability', '?')}")
print("tokamax:", "importable" if tokamax_gpu.available() else tokamax_gpu.unavailable_reason())
PY
timeout 240 python3 benchmarks/attention.py --rows 8 --row_length 4096 --heads 16 --head_dim 128 --sweep \
    --json "$out/attention_8x4096.json" 2>&1 | grep -v "Autotuning cache miss" | tee "$out/attention_8x4096.log"
timeout 120 python3 benchmarks/attention.py --masks block_causal --json "$out/attention_default.json" 2>&1 \
    | grep -v "Autotuning cache miss" | tee "$out/attention_default.log"
