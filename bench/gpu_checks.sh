#!/usr/bin/env bash
# The GPU checks in one prepared run (e.g. on a lent H100/H200, from the repository root):
# the compiled Pallas kernel tests (the classes that CPU runs skip), then bench/kernels_gpu.py
# (low-bit matmuls, the WUSH W4A4 layer, the grammar mask kernel against its jnp path).
# Logs and JSON go to $OUT (default runs/gpu_checks). Needs jax with a GPU backend, flax,
# optax, chex, pytest and numpy; nothing is installed and jaxlm is imported from the tree.
set -uo pipefail
OUT=${OUT:-runs/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # tests/conftest.py defaults to cpu
PY=${PYTHON:-python3}
"$PY" -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee "$OUT/devices.txt"
"$PY" -m pytest -q -p no:cacheprovider -k "not Interpret" \
    tests/quant/test_kernels.py tests/quant/test_transformed_kernels.py tests/inference/test_grammar_mask_kernel.py \
    2>&1 | tee "$OUT/pytest_compiled.txt"
tests_rc=${PIPESTATUS[0]}
"$PY" bench/kernels_gpu.py 2>&1 | tee "$OUT/kernels_gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "compiled kernel tests rc=$tests_rc, kernels_gpu rc=$bench_rc" | tee -a "$OUT/devices.txt"
exit $(( tests_rc || bench_rc ))
