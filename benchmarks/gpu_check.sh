#!/usr/bin/env bash
# On a lent GPU machine, one command: the CUDA tests, the Accelerate FSDP2 check and the training-loop benchmark
# (bench_gpu.py), each under its own timeout, the whole in under 6 minutes.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # OUT_DIR: default $OUT when set, else ./gpu-check-out
#
# Writes to OUT_DIR: machine.txt (GPU, PCIe link, CPUs, memory, the disk, /dev/shm), imports.txt, tests.log,
# fsdp2.log, bench_gpu.log and bench_gpu.md (the table for the docs). Prints a summary; exits non-zero when a part
# failed, timed out or could not run.
#
# The machine has no network, so nothing is installed from an index. First it checks the imports the package,
# the tests and the benchmark need beyond torch (with CUDA) and what torch brings; wheels found in $WHEELS
# (default ./wheels) are installed with `pip install --no-index --no-deps --target .gpu-deps` and put on
# PYTHONPATH. What is still missing is listed with the exact `pip download --only-binary=:all:` command to run
# on a machine with network for this machine's Python; the parts that need it are skipped.
#
# Environment: PYTHON (default python3), WHEELS, BENCH_ARGS (extra bench_gpu.py options, e.g. --quick or
# "--saves 3"), BUDGET_S (default 350: the bench gets what the other parts left of it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-$ROOT/gpu-check-out}}
WHEELS=${WHEELS:-$ROOT/wheels}
BUDGET_S=${BUDGET_S:-350}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS
declare -a summary=()
status=0

note() { printf '%s\n' "$*" | tee -a "$OUT_DIR/summary.txt"; }
: > "$OUT_DIR/summary.txt"

# ---- 1. imports (and wheels brought along)
check_imports() {  # prints "group<TAB>module<TAB>wheels" for each missing module; the last line: python tag + arch
  timeout 60 "$PY" - <<'PY'
import importlib, platform, sys
core = ["crc32c==2.9.post0", "numpy>=1.26"]
tests = ["pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "packaging==26.4", "pygments==2.21.0",
         "pytest-timeout==2.4.0"] + (["exceptiongroup", "tomli"] if sys.version_info < (3, 11) else [])
lightning = ["lightning==2.6.6", "lightning-utilities==0.15.3", "torchmetrics==1.9.0", "packaging==26.4",
             "pyyaml==6.0.4", "tqdm==4.70.1"]
accelerate = ["accelerate==1.16.0", "safetensors==0.8.0", "psutil==7.2.2", "pyyaml==6.0.4", "packaging==26.4"]
# (the part that needs it, the module, the wheels: the module's distribution and what it needs that torch lacks)
needs = [("core", "torch", ["torch (with CUDA: not carried, the machine's own)"]), ("core", "crc32c", core[:1]),
         ("core", "numpy", core[1:]), ("tests", "pytest", tests[:5] + tests[6:]), ("tests", "pytest_timeout", tests[5:6]),
         ("lightning", "lightning.pytorch.plugins.io", lightning), ("accelerate", "accelerate", accelerate)]
for group, module, wheels in needs:
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install
        print(f"{group}\t{module}\t{' '.join(wheels)}\t{type(e).__name__}: {e}")
print(f"PYTHON\t{sys.version_info.major}{sys.version_info.minor}\t{platform.machine()}")
PY
}

[ -d "$ROOT/.gpu-deps" ] && export PYTHONPATH="$ROOT/.gpu-deps:$PYTHONPATH"  # installed by an earlier run
missing=$(check_imports 2>&1)
if printf '%s\n' "$missing" | grep -qv '^PYTHON' && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  note "installing the wheels in $WHEELS into $ROOT/.gpu-deps (no index, no deps)"
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$ROOT/.gpu-deps" "$WHEELS"/*.whl >"$OUT_DIR/wheels.log" 2>&1; then
    note "  pip could not install them (see wheels.log); unpacking them instead"
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$ROOT/.gpu-deps" "$WHEELS"/*.whl >>"$OUT_DIR/wheels.log" 2>&1
  fi
  case ":$PYTHONPATH:" in *":$ROOT/.gpu-deps:"*) ;; *) export PYTHONPATH="$ROOT/.gpu-deps:$PYTHONPATH" ;; esac
  missing=$(check_imports 2>&1)
fi
printf '%s\n' "$missing" > "$OUT_DIR/imports.txt"
pytag=$(printf '%s\n' "$missing" | awk -F'\t' '$1 == "PYTHON" {print $2}')
arch=$(printf '%s\n' "$missing" | awk -F'\t' '$1 == "PYTHON" {print $3}')
missing=$(printf '%s\n' "$missing" | grep -v '^PYTHON' || true)
lacks() { printf '%s\n' "$missing" | grep -q "^$1	"; }
if [ -n "$missing" ]; then
  note "MISSING imports (this machine has no network):"
  printf '%s\n' "$missing" | awk -F'\t' '{printf "  %-10s %-30s %s\n", $1, $2, $4}' | tee -a "$OUT_DIR/summary.txt"
  wheels=$(printf '%s\n' "$missing" | grep -v '^core	torch	' | cut -f3 | tr ' ' '\n' | sort -u | sed "s/.*/'&'/" | tr '\n' ' ')
  if [ -n "$wheels" ]; then
    note "Bring these wheels: on a machine with network (any OS), for this machine's Python (cp$pytag, $arch):"
    note "  pip download --only-binary=:all: --no-deps --python-version ${pytag:0:1}.${pytag:1} --implementation cp \\"
    note "    --abi cp$pytag --platform manylinux_2_28_$arch --platform manylinux_2_17_$arch --platform manylinux2014_$arch \\"
    note "    -d wheels $wheels"
    note "then copy wheels/ to $WHEELS here and run this script again: it installs them with"
    note "  $PY -m pip install --no-index --no-deps --target .gpu-deps wheels/*.whl   (and puts .gpu-deps on PYTHONPATH)"
  fi
fi
[ -z "$missing" ] && note "imports: everything the package, the tests and the benchmarks need is here"
if lacks core; then
  note "cannot run: the package itself does not import (see above)"
  exit 2
fi

# ---- 2. the machine
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "kernel: $(uname -srm)"
  "$PY" - <<'PY' 2>&1
import os, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else '-'}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
              f"{p.multi_processor_count} SMs")
else:
    print("GPU: torch sees no CUDA device")
print(f"CPUs: {os.cpu_count()} (this process may use {len(os.sched_getaffinity(0))})")
PY
  if command -v nvidia-smi >/dev/null; then
    echo "nvidia-smi:"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,clocks.max.sm,power.limit --format=csv 2>&1
    nvidia-smi topo -m 2>/dev/null | head -20
  else
    echo "nvidia-smi: not found (the PCIe link unknown)"
  fi
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //')"
  command -v lscpu >/dev/null && lscpu | grep -E '^(Socket|NUMA node\(s\)|Thread|Core)' 2>/dev/null
  echo "memory:"; free -g 2>/dev/null || grep -E 'MemTotal|MemAvailable' /proc/meminfo
  echo "the disk (where the checkpoints go, $ROOT):"
  df -hT "$ROOT" 2>&1
  command -v findmnt >/dev/null && findmnt -no SOURCE,FSTYPE,OPTIONS -T "$ROOT" 2>&1
  command -v lsblk >/dev/null && lsblk -dno NAME,MODEL,SIZE,ROTA,TRAN 2>/dev/null
  echo "/dev/shm:"; df -h /dev/shm 2>&1
} > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  note "WARNING: no CUDA device: the CUDA tests skip and the benchmark runs on the CPU"
  status=1
fi

# ---- 3. the parts, each under its own timeout; the benchmark gets what is left of the budget
run_part() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc
  shift 3
  echo "== $name (timeout ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    summary+=("$name: ok in $((SECONDS - t0)) s")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    summary+=("$name: TIMED OUT after ${limit} s (see $log)"); status=1
  else
    summary+=("$name: FAILED, exit $rc (see $log)"); status=1
  fi
}

if lacks tests; then
  summary+=("CUDA tests: NOT RUN (pytest missing)"); status=1
else
  run_part "CUDA tests" 60 tests.log "$PY" -m pytest -q -p no:cacheprovider -rs -m cuda tests/unit/test_cuda.py
  if grep -q "skipped" "$OUT_DIR/tests.log"; then
    summary+=("CUDA tests: some SKIPPED (see tests.log)"); status=1
  fi
fi
if lacks accelerate; then
  summary+=("Accelerate FSDP2 check: NOT RUN (accelerate missing)"); status=1
else
  run_part "Accelerate FSDP2 check" 45 fsdp2.log "$PY" benchmarks/accelerate_fsdp2_check.py
fi
bench_args=()
if lacks lightning; then
  bench_args+=(--methods unguarded,guarded,continuous,dcp,dcp-stager,torch-save)
  summary+=("bench_gpu.py: without the Lightning row (lightning missing)"); status=1
fi
left=$((BUDGET_S - (SECONDS - started) - 5))
if [ "$left" -lt 60 ]; then
  summary+=("bench_gpu.py: NOT RUN (${left} s left of ${BUDGET_S})"); status=1
else
  # shellcheck disable=SC2086
  run_part "bench_gpu.py" "$left" bench_gpu.log "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} ${bench_args[@]+"${bench_args[@]}"} \
    --markdown "$OUT_DIR/bench_gpu.md"
fi

echo
note "== summary ($((SECONDS - started)) s in all; results in $OUT_DIR)"
for line in ${summary[@]+"${summary[@]}"}; do note "  $line"; done
[ -f "$OUT_DIR/bench_gpu.md" ] && note "  the table for the docs: $OUT_DIR/bench_gpu.md"
exit $status
