#!/usr/bin/env bash
# GPU smoke check, one rank on one CUDA device, about 5 minutes at most:
#   1. the op-oracle suites (tests/dtensor/test_ops_*.py) and the Llama-step suite
#      (tests/dtensor/test_llama_step.py) with DTensors on CUDA (HP_TEST_DEVICE=cuda,
#      one rank: HP_TEST_WORLD_SIZES=1); values are compared with the one-process CPU oracle;
#   2. stream mode of DTensor random ops on CUDA's generator (its 16-byte state, the fork,
#      the tick and an activation-checkpoint replay);
#   3. the per-op dispatch overhead, ours vs torch DTensor, on CUDA tensors.
# Run from the repository root:  bash bench/gpu_smoke.sh   (exit status: first failure)
set -euo pipefail
cd "$(dirname "$0")/.."

uv run --frozen python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'

export HP_TEST_DEVICE=cuda HP_TEST_WORLD_SIZES=1
echo "== op-oracle and llama-step suites on cuda (1 rank)"
timeout 240 uv run --frozen pytest -q -x -p no:cacheprovider \
    tests/dtensor/test_ops_pointwise.py tests/dtensor/test_ops_matrix.py \
    tests/dtensor/test_ops_views.py tests/dtensor/test_ops_reductions.py \
    tests/dtensor/test_ops_nn.py tests/dtensor/test_llama_step.py

echo "== random ops' stream mode on cuda's generator: fork, tick, checkpoint replay (1 rank)"
timeout 120 uv run --frozen pytest -q -x -p no:cacheprovider tests/dtensor/test_random_stream.py \
    -k "recompute_beyond"

echo "== dispatch overhead on cuda, ours vs torch DTensor (1 rank)"
timeout 120 uv run --frozen python bench/bench_dispatch.py --device cuda --world-size 1 \
    --rounds 10 --calls 100
