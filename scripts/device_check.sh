#!/bin/bash
# The checks for a lent machine (16 cores and an NVIDIA GPU, no network; the device tool), in one call: the CPU's ISA
# levels side by side (AVX2, AVX-VNNI, AVX-512 without BF16, the best it has: scripts/bench_isa.py on random-weight
# GGUFs of real shapes), the CUDA tests and the engine on the GPU, then the kernel tests on every level the CPU has.
# What it reports goes to $OUT. Prepared here first, in the ignored folder .devcarry (carried to the machine):
#   .devcarry/whl/     wheels for Python 3.12 of what the machine's image lacks (pydantic, pydantic-settings,
#                      python-dotenv, gguf, llguidance, ... : docs/testing.md)
#   .devcarry/models/  GGUF headers (scripts/gguf_random.py header): smollm2-135m-q4_1.header, llama-3.2-1b-Q4_K_M.header
export PYTHONUNBUFFERED=1 PEREGRINE_CACHE_DIR=${PEREGRINE_CACHE_DIR:-/tmp/pcache} MAX_JOBS=${MAX_JOBS:-16} HF_HUB_OFFLINE=1
PY=${PY:-python3}
S=$SECONDS
say() { echo "=== [$((SECONDS-S)) s] $*" | tee -a $OUT/progress.txt; }
left() { local v=$(( ${1} - (SECONDS-S) )); [ $v -lt 20 ] && v=20; echo $v; }  # seconds until mark $1, at least 20
say start
{ lscpu; lscpu -e; nproc; free -g; nvidia-smi -L; $PY -V; $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > $OUT/machine.txt 2>&1
grep -E "Model name|^Flags|^CPU\(s\)|torch" $OUT/machine.txt | cut -c1-600
if [ -z "$SKIP_PIP" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
$PY -c "import main, engine.llm_engine, models.loader; print('imports ok')" 2>&1 | tail -3
# every level that is a build of its own (avx2, avx_vnni, avx512, avx512_bf16: those the CPU has)
LEVELS=$($PY -c "import sys; sys.path.insert(0, 'scripts'); import bench_isa; print(','.join(bench_isa.kernel_levels()))")
say "levels: $LEVELS"
$PY scripts/build_kernels.py "$LEVELS" > $OUT/build.log 2>&1 &
BUILD=$!
$PY scripts/gguf_random.py fill .devcarry/models/smollm2-135m-q4_1.header /tmp/smollm2-rand.gguf
$PY scripts/gguf_random.py fill .devcarry/models/llama-3.2-1b-Q4_K_M.header /tmp/llama1b-rand.gguf
( timeout 200 $PY -m pytest tests/engine/test_cuda.py tests/unit/test_sampler.py tests/unit/test_loader.py -k "cuda or gpu" -q -p no:cacheprovider -rs > $OUT/cuda_tests.log 2>&1
  timeout 150 $PY scripts/bench_engine.py --device cuda --gguf /tmp/llama1b-rand.gguf --dtype bfloat16 --hf-requests 0 --concurrency 1 16 64 --output-len 128 > $OUT/gpu_bench.log 2>&1 ) &
GPU=$!
wait $BUILD; say "built"; grep -E "built|FAILED|rror" $OUT/build.log | head -20
wait $GPU; say "cuda tests and gpu bench done"; tail -3 $OUT/cuda_tests.log; grep -v "^INFO" $OUT/gpu_bench.log | tail -9
timeout $(left 330) $PY scripts/bench_isa.py --threads 2 --levels ${SMALL_LEVELS:-$LEVELS} --gguf /tmp/smollm2-rand.gguf --output-len 128 --json $OUT/isa_135m_t2.json --log $OUT/isa_135m_t2.log 2>&1 | grep -v '^{' | tail -8
say "bench 135M 2 threads done"
timeout $(left 430) $PY scripts/bench_isa.py --threads 16 --levels ${BIG_LEVELS:-avx2,avx512} --gguf /tmp/llama1b-rand.gguf --output-len 64 --batch1-repeats 2 --json $OUT/isa_llama1b_t16.json --log $OUT/isa_llama1b_t16.log 2>&1 | grep -v '^{' | tail -8
say "bench llama 1B 16 threads done"
timeout $(left 540) $PY -m pytest tests/engine/test_qdot.py tests/engine/test_quant_kernels.py tests/engine/test_cpu_kernels.py tests/engine/test_cpu_kernels_paths.py -q -p no:cacheprovider ${XDIST--n 8} -rs > $OUT/kernel_tests.log 2>&1
say "kernel tests rc $?"; tail -6 $OUT/kernel_tests.log
