#!/usr/bin/env bash
# GPU acceptance check of the real engine (benchmarks/gpu_check.py): random-weight checkpoints of
# Qwen2.5-0.5B and 7B-class shape (no download), prefill 8K/32K/128K, decode batch 1/32/128, TTFT at
# 0% vs 90% prefix hit (32K), KV transfer device-to-device vs host-staged, each next to the device
# profile's roofline. Needs torch with CUDA (or torch_musa); < 5 minutes on an H100/H200-class card.
#
#   scripts/gpu_check.sh                         # CUDA
#   scripts/gpu_check.sh --device musa           # Moore Threads (torch_musa)
#   scripts/gpu_check.sh --quick --device cpu    # tiny shapes on a CPU (checks the script; seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
