#!/usr/bin/env bash
# The GPU checks, short enough for one lent machine: `kernels` builds, checks and times the Triton
# kernels and runs the GPU tests; `model GGUF` runs the default model end to end on the GPU.
#
#   tools/gpu_check.sh kernels          # scenarios/triton_kernels.py, the kernel and Triton engine tests
#   tools/gpu_check.sh model FILE.gguf  # the demo, agent_system_prompt in bf16 and in fp32 vs transformers
#
# It runs from the repository root without installing radixkv (the GPU machine's python has torch,
# triton and transformers; pass the gguf wheel on PYTHONPATH for `model`). Logs go to $OUT (default
# out/gpu), the scenarios' JSON and plots into one $OUT/runs.tar (a lent machine returns few
# files). Each stage has its own time limit, so one hang cannot eat the machine's lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
# radixkv.scenarios is scenarios/ mapped by pyproject.toml; without an install, a link does it.
[ -e radixkv/scenarios ] || ln -s ../scenarios radixkv/scenarios

stage() {  # stage SECONDS NAME COMMAND...: run with a limit, log under $OUT, say how it ended
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

case "${1:-}" in
kernels)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    gcc --version | head -1  # the native library plans cascade groups for the Triton backend too
    $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    stage 180 kernel_bench $PY -m radixkv.scenarios.triton_kernels --out "$OUT/kernel_bench.json"
    # Workers compile the kernels' many shapes side by side (xdist is on the GPU machine's image).
    stage 200 gpu_tests $PY -m pytest -q -p no:cacheprovider -rs -n 8 tests/kernels tests/attention/test_triton_engine.py
    # The engine tests (scheduling, cache, sampling, exactness) with their LLMs on cuda. Some hold
    # the CPU backends to CPU-only behaviour or the CPU's transformers to the last bit: read the
    # failures, don't count them.
    RADIXKV_TEST_DEVICE=cuda stage 200 engine_tests_cuda $PY -m pytest -q -p no:cacheprovider -n 8 --maxfail 40 \
        tests/engine
    ;;
model)
    gguf=${2:?usage: tools/gpu_check.sh model FILE.gguf}
    runs=$(mktemp -d)
    stage 90 demo $PY -m radixkv.demo --model "$gguf"
    stage 150 agent_bf16 $PY -m radixkv.scenarios.agent_system_prompt --model "$gguf" --device cuda \
        --peers radixkv,radixkv-nocache,radixkv-noshare,hf-batch --out "$runs/agent_bf16"
    stage 150 agent_fp32 $PY -m radixkv.scenarios.agent_system_prompt --model "$gguf" --device cuda \
        --dtype float32 --num-requests 16 --peers radixkv,radixkv-nocache,hf-generate --out "$runs/agent_fp32"
    # Host-bound or kernel-bound: the device's busy time in a decode step against its wall time.
    stage 90 step_profile $PY -m radixkv.scenarios.step_profile --model "$gguf" --device cuda \
        --num-seqs 64 --context 1024 --out "$runs/step_profile"
    # The same step with torch's ops for the row glue: what the Triton row ops save.
    stage 90 step_profile_torch_ops $PY -m radixkv.scenarios.step_profile --model "$gguf" --device cuda \
        --num-seqs 64 --context 1024 --no-native --out "$runs/step_profile_torch_ops"
    tar -cf "$OUT/runs.tar" -C "$runs" .
    ;;
*)
    echo "usage: tools/gpu_check.sh kernels | model FILE.gguf" >&2
    exit 2
    ;;
esac
