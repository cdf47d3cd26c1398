#!/usr/bin/env bash
# One device call: install, then Nsight Compute over benchmarks/sweeps/ncu_conv.py (one launch per case),
# the report's details and SASS-source pages as text, cuobjdump SASS of every conv cubin. All under $OUT.
# NCU_ARGS: more arguments for ncu_conv.py (e.g. --depthwise: MobileNetV2's depthwise convs, fp16 vs int8 out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
[ -d .whl ] && export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl
t0=$(date +%s)
make install > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
echo "install $(( $(date +%s) - t0 ))s"; ncu --version | tail -1
[ -n "${GPU_TESTS:-}" ] && { .venv/bin/python -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 | tail -5; }
timeout "${NCU_LIMIT:-300}" ncu --clock-control none --profile-from-start off --set full -f -o "$OUT/conv" \
  .venv/bin/python benchmarks/sweeps/ncu_conv.py --out "$OUT/ncu_conv.json" --cubins "$OUT/cubins" ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $(( $(date +%s) - t0 ))s"; grep -v "^==PROF==" "$OUT/ncu.log" | tail -30
if [ -f "$OUT/conv.ncu-rep" ]; then
  ncu -i "$OUT/conv.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  ncu -i "$OUT/conv.ncu-rep" --page source --csv --print-source sass > "$OUT/source_sass.csv" 2>&1
  ncu -i "$OUT/conv.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
  grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$OUT/details.txt" | head -150
else
  grep "==PROF==\|ERR" "$OUT/ncu.log" | head; .venv/bin/python benchmarks/sweeps/ncu_conv.py --out "$OUT/ncu_conv.json" --cubins "$OUT/cubins"
fi
for f in "$OUT"/cubins/*.cubin; do cuobjdump --dump-sass "$f" > "${f%.cubin}.sass" 2>&1; done
[ -n "${AFTER:-}" ] && { echo "== $AFTER"; eval "$AFTER"; }
ls -la "$OUT" | head; du -sh "$OUT"
