#!/usr/bin/env bash
# The GPU work in as few calls as possible, on a machine with an NVIDIA GPU and its own
# Python (torch and triton installed; no network), from the repository root:
#
#     tools/gpu_session.sh tests            the machine and versions, then pytest tests/gpu
#                                           on CUDA: the oracle tests, the fuzz, determinism,
#                                           batch invariance and 64-bit offsets at full size
#     tools/gpu_session.sh bench [DTYPE]..  layernorm bench --device cuda for each dtype
#                                           (default bfloat16 float32), resumed from the rows
#                                           that .gpu-run/gpu-results.json already has
#     tools/gpu_session.sh variants ARG..   tools/gpu_variants.py ARG.. (this package's kernels
#                                           under settings of their tuning constants)
#     tools/gpu_session.sh quant            tools/gpu_quant.py: the quantized norm against
#                                           norm-then-quantize (eager, compiled) and a copy
#     tools/gpu_session.sh all              tests, then bench
#     tools/gpu_session.sh quick            the one call of a short lease (about 8 minutes):
#                                           the CUDA tests only a GPU can show, in three
#                                           steps (each norm and mode against the oracle in
#                                           bfloat16 and float32; bit-identical reruns and
#                                           batch invariance; one problem past 2**31
#                                           elements), then the bench of the core grid
#                                           (RMSNorm and LayerNorm, bfloat16, N = 1K to 128K,
#                                           every peer; torch.compile at 4K and 32K), then
#                                           the decode sizes (tools/gpu_decode.py)
#     tools/gpu_session.sh quick-rest       the second call (about 3 minutes), at once on
#                                           the same machine, carrying .whl-2/: QuACK's
#                                           second half unpacked, the bench's rows the first
#                                           call lacks (QuACK's, and any it did not reach),
#                                           then the decode sizes again with QuACK
#
# Each step stops in time for the call to end within CALL_LIMIT seconds (default 570, for a
# 10-minute call), and a benchmark stopped there goes on at the next call where it stopped.
# The peers (tools/gpu_wheels.sh) are installed to /tmp/layernorm-site first: Liger-Kernel's
# wheel from .whl/, and QuACK's packed site once both of its halves, .whl/ and .whl-2/, have
# arrived. Logs, the results file and env.txt go to
# $OUT (default .gpu-run/out); the last thing printed is the table of the results so far.
# quick writes each step's results to $OUT as they come: tests.jsonl (a line per test and per
# step) and pytest.log, bench.json (a row per measurement) and bench.log, decode.json (a row
# per measurement), beside env.txt and session.log: at most 8 files come back from a call.
# The package's CPU engine is never built there (LAYERNORM_NO_CPP=1): the GPU paths need none.
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-all}
shift || true
case "$step" in
    tests | bench | variants | quant | all | quick | quick-rest) ;;
    *) echo "usage: tools/gpu_session.sh tests|bench [DTYPE]...|variants ARG...|quant|all|quick|quick-rest" >&2
       exit 2 ;;
esac

[ "$step" = quick ] && CALL_LIMIT=${CALL_LIMIT:-500}
[ "$step" = quick-rest ] && CALL_LIMIT=${CALL_LIMIT:-170}
CALL_LIMIT=${CALL_LIMIT:-570}
OUT=${OUT:-.gpu-run/out}
RESULTS=.gpu-run/gpu-results.json
SITE=/tmp/layernorm-site
PY=${PYTHON:-python3}
mkdir -p "$OUT" .gpu-run
export PYTHONUNBUFFERED=1
export LAYERNORM_NO_CPP=1
export PYTHONPATH="$PWD/src:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"

STATUS=0  # 1 if a step failed (a benchmark stopped at the time limit has not failed)
left() { echo $((CALL_LIMIT - SECONDS)); }
check() {  # check STATUS_OF_A_STEP NAME: a failure sets STATUS; the time limit is said
    if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then
        echo "$2: stopped at the time limit, unfinished"
        STATUS=1
    elif [ "$1" -ne 0 ]; then
        STATUS=1
    fi
}

bench_ended() {  # bench_ended STATUS WHAT_THEN: the log's end; a stop at the time limit (the
    # rows measured are kept) is said, any other failure sets STATUS
    tail -3 "$OUT/bench.log"
    if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then
        echo "bench: stopped at the time limit; $2"
    elif [ "$1" -ne 0 ]; then
        STATUS=1
    fi
}

install_wheels() {
    # Installs each thing once per machine ($SITE/.installed lists those already there, so a
    # later call of the same machine skips them): the wheels in .whl/ with pip, and QuACK's
    # packed site (tools/gpu_wheels.sh) once both of its halves, .whl/ and .whl-2/, are here
    # (the second call brings the second; .whl/, ignored by git, stays on the warm machine).
    [ -d .whl ] || [ -d .whl-2 ] || {
        echo "no .whl/: the peers are measured only where installed already"; return; }
    local done=$SITE/.installed wheels=() w part0 part1 name
    installed() { grep -qxF "$1" "$done" 2>/dev/null; }
    mkdir -p "$SITE"
    for w in .whl/*.whl; do [ -f "$w" ] && ! installed "$(basename "$w")" && wheels+=("$w"); done
    if [ ${#wheels[@]} -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}" 2>&1 | grep -v "^WARNING: Target directory" | tail -5
        [ "${PIPESTATUS[0]}" -eq 0 ] && printf '%s\n' "${wheels[@]##*/}" >> "$done"
    fi
    part0=$(ls .whl/*.tar.xz.part00 2>/dev/null | head -1)
    if [ -z "$part0" ]; then
        [ -d .whl-2 ] && echo "the second half of QuACK's site is here but not the first (a" \
            "fresh machine: the call before was not on this one): QuACK will not import"
        return 0
    fi
    name=$(basename "${part0%.part00}")
    installed "$name" && return 0
    part1=.whl-2/$name.part01
    if [ ! -f "$part1" ]; then
        echo "only the first half of $name is here: QuACK will not import until the second call"
        return 0
    fi
    "$PY" tools/gpu_unpack.py "$part0" "$part1" ".whl/$name.sha256" "$SITE" \
        && echo "$name" >> "$done"
}

environment() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
        --format=csv 2>&1
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "numpy", "liger_kernel", "quack", "cutlass", "pytest",
             "hypothesis", "ml_dtypes", "mpmath"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '(no version)')}")
    except Exception as exc:  # a peer may fail in any way
        print(f"{name}: does not import ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}: {p.multi_processor_count} SMs, L2 {p.L2_cache_size / 2**20:.0f} MiB,"
          f" {p.total_memory / 2**30:.0f} GiB, cuda {torch.version.cuda}")
else:
    print("no CUDA device")
EOF
}

run_tests() {
    local budget
    local workers=()
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n 8)  # pytest-xdist, where installed
    budget=$(($(left) - 30))
    echo "== pytest tests/gpu (all but the large ones; ${workers[*]:-one process}), at most ${budget}s"
    timeout "$budget" "$PY" -m pytest tests/gpu -q -p no:cacheprovider "${workers[@]}" \
        --ignore tests/gpu/test_gpu_scale.py --junitxml "$OUT/pytest.xml" 2>&1 \
        | tee "$OUT/pytest.log" | tail -15
    check "${PIPESTATUS[0]}" "pytest tests/gpu"
    budget=$(($(left) - 20))
    echo "== pytest tests/gpu/test_gpu_scale.py (one process: ~40 GB a test), at most ${budget}s"
    timeout "$budget" "$PY" -m pytest tests/gpu/test_gpu_scale.py -q -p no:cacheprovider \
        --durations=5 --junitxml "$OUT/pytest-scale.xml" 2>&1 \
        | tee "$OUT/pytest-scale.log" | tail -15
    check "${PIPESTATUS[0]}" "pytest tests/gpu/test_gpu_scale.py"
}

run_bench() {
    local dtypes=("$@") args=() budget
    [ ${#dtypes[@]} -gt 0 ] || dtypes=(bfloat16 float32)
    for d in "${dtypes[@]}"; do args+=(--dtype "$d"); done
    budget=$(($(left) - 25))
    echo "== layernorm bench --device cuda ${args[*]} --resume, at most ${budget}s"
    timeout "$budget" "$PY" -m layernorm bench --device cuda "${args[@]}" --resume \
        --out "$RESULTS" >> "$OUT/bench.log" 2>&1
    bench_ended $? "the next call goes on where it stopped"
}

run_variants() {
    local budget
    budget=$(($(left) - 20))
    echo "== tools/gpu_variants.py $*, at most ${budget}s"
    timeout "$budget" "$PY" tools/gpu_variants.py "$@" --out "$OUT/variants.json" 2>&1 \
        | tee "$OUT/variants.log" | tail -40
    check "${PIPESTATUS[0]}" "tools/gpu_variants.py"
}

run_quant() {
    local budget
    budget=$(($(left) - 20))
    echo "== tools/gpu_quant.py, at most ${budget}s"
    timeout "$budget" "$PY" tools/gpu_quant.py --out "$OUT/gpu-quant.json" 2>&1 \
        | tee "$OUT/quant.log" | tail -20
    check "${PIPESTATUS[0]}" "tools/gpu_quant.py"
}

# quick: each step's budget in seconds; each also ends in time for the call (CALL_LIMIT, 500 s
# by default for quick: a 540 s call)
QUICK_TESTS=(gpu_oracle:110 gpu_invariance:45 gpu_scale:30)
QUICK_BENCH=300
QUICK_DECODE=45
QUICK_NS="1024, 4096, 8192, 32768, 131072"
QUICK_COMPILE_NS=(4096 32768)
QUICK_KEPT=.gpu-run/quick-bench.json  # the bench's rows, for a second call on the same machine

budget_of() {  # budget_of SECONDS RESERVE: SECONDS, or what is left less RESERVE if less;
    # 0 when under 10 s are left for the step (it is skipped: timeout 0 would set no limit)
    local most=$(($(left) - $2)) budget
    budget=$(($1 < most ? $1 : most))
    echo $((budget < 10 ? 0 : budget))
}

step_line() {  # step_line NAME STATUS SECONDS: the step's own line in tests.jsonl
    printf '{"step": "%s", "exit": %s, "seconds": %s}\n' "$1" "$2" "$3" >> "$OUT/tests.jsonl"
}

run_quick_tests() {
    local item step budget rc start workers=() cores
    cores=$(nproc)
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n $((cores < 8 ? cores : 8)))
    for item in "${QUICK_TESTS[@]}"; do
        step=${item%%:*}
        budget=$(budget_of "${item##*:}" 20)
        [ "$step" = gpu_scale ] && workers=()  # one process: about 40 GB a test
        if [ "$budget" -eq 0 ]; then
            echo "== $step: no time left"; step_line "$step" 124 0; STATUS=1; continue
        fi
        echo "== pytest tests/gpu -m $step (${workers[*]:-one process}), at most ${budget}s"
        start=$SECONDS
        LAYERNORM_TEST_LOG="$OUT/tests.jsonl" timeout -k 10 "$budget" "$PY" -m pytest tests/gpu \
            -q -p no:cacheprovider "${workers[@]}" -m "$step" 2>&1 | tee -a "$OUT/pytest.log" \
            | tail -8
        rc=${PIPESTATUS[0]}
        step_line "$step" "$rc" $((SECONDS - start))
        check "$rc" "pytest -m $step"
    done
}

run_quick_bench() {
    local budget rc shapes compile=() n
    shapes=$("$PY" -c "from layernorm.bench.gpu import rows_for
print(' '.join(f'--shape {rows_for(n)}x{n}' for n in ($QUICK_NS)))")
    for n in "${QUICK_COMPILE_NS[@]}"; do compile+=(--compile-n "$n"); done
    [ -f "$OUT/bench.json" ] || cp "$QUICK_KEPT" "$OUT/bench.json" 2>/dev/null
    budget=$(budget_of "$QUICK_BENCH" "$QUICK_DECODE")
    [ "$budget" -gt 0 ] || { echo "== bench: no time left"; STATUS=1; return; }
    echo "== layernorm bench --device cuda: RMSNorm and LayerNorm, bfloat16, at most ${budget}s"
    # shellcheck disable=SC2086  # $shapes is the words of the --shape options
    timeout -k 10 "$budget" "$PY" -m layernorm bench --device cuda --dtype bfloat16 --norm rms_norm \
        --norm layer_norm $shapes "${compile[@]}" --out "$OUT/bench.json" --resume \
        > "$OUT/bench.log" 2>&1
    rc=$?
    cp "$OUT/bench.json" "$QUICK_KEPT" 2>/dev/null
    bench_ended $rc "its rows so far are in bench.json"
}

run_decode() {
    local budget
    budget=$(budget_of "$QUICK_DECODE" 5)
    [ "$budget" -gt 0 ] || { echo "== decode: no time left"; STATUS=1; return; }
    echo "== tools/gpu_decode.py, at most ${budget}s"
    timeout -k 5 "$budget" "$PY" tools/gpu_decode.py --out "$OUT/decode.json"
    check $? "tools/gpu_decode.py"
}

show() {  # show [FILE]: the table of a results file (default $RESULTS, copied to $OUT)
    local file=${1:-$RESULTS}
    [ -f "$file" ] || return 0
    [ "$file" = "$RESULTS" ] && cp "$RESULTS" "$OUT/"
    "$PY" - "$file" <<'EOF'
import sys
from layernorm.bench import gpu
rows = gpu.load_results(sys.argv[1])
failed = sum(r["ms"] is None for r in rows)
print(f"\n{len(rows)} rows in {sys.argv[1]} ({failed} failed)")
print(gpu.format_table(rows))
EOF
}

case "$step" in quick*) exec > >(tee -a "$OUT/session.log") 2>&1 ;; esac
start=$SECONDS
install_wheels
echo "wheels: $((SECONDS - start)) s"
environment | tee "$OUT/env.txt"
case "$step" in
    tests) run_tests ;;
    bench) run_bench "$@" ;;
    variants) run_variants "$@" ;;
    quant) run_quant ;;
    all) run_tests; run_bench "$@" ;;
    quick) run_quick_tests; run_quick_bench; run_decode ;;
    quick-rest)
        [ -f "$QUICK_KEPT" ] || echo "no rows of a first call on this machine: measuring all"
        run_quick_bench; run_decode ;;
esac
case "$step" in quick*) show "$OUT/bench.json" ;; *) show ;; esac
exit $STATUS
