#!/usr/bin/env bash
# One short script for a lent GPU machine: the CUDA tests (pinned buffers, side stream) and the
# GPU section of the save benchmark. Assumes a Python with CUDA torch; installs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[dev]" 2>/dev/null || python -m pip install -q -e . pytest pytest-timeout numpy safetensors
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA here'; print(torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py tests/unit/test_format.py tests/unit/test_engine.py
python benchmarks/bench_save.py --only gpu --gib "${GIB:-2}" --repeat 3
python benchmarks/accelerate_fsdp2_check.py   # the hook's FSDP2 path through a real Accelerator (one GPU)
python benchmarks/bench_sharded.py --gb "${SHARDED_GB:-1}" --repeat 2   # sharded save/load against DCP (gloo ranks)
