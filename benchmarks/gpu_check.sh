#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine: the GPU-marked tests, decode-step time against
# context length (FlexAttention beside the gathered path and a CUDA graph's replay), and serving
# benchmarks with decode steps in CUDA graphs and without.
#
#   bash benchmarks/gpu_check.sh SHAPE_DIR [OUT_DIR]
#
# SHAPE_DIR holds a model's config.json and tokenizer files; the benchmarks run a copy with
# random weights (benchmarks/random_model.py), so no weights need to travel. Wheels in .whl/
# (for a machine without a package index) are installed first into /tmp/site. Every result
# lands in OUT_DIR (default: $OUT, else gpu-results/). To fit a shorter run, set CONTEXTS and
# BATCH_SIZES (context_bench.py's lists), CONCURRENCIES and SERVERS (of graphs, eager, gathered
# and sampled: the server's default, every step eager, the gathered attention path, the
# default server with requests sampled at temperature 1 and top-p 0.95) to fewer values, or
# SKIP_TESTS=1 and SKIP_CONTEXTS=1.
set -uo pipefail
shape_dir=${1:?usage: gpu_check.sh SHAPE_DIR [OUT_DIR]}
out=${2:-${OUT:-gpu-results}}
contexts=${CONTEXTS:-128,256,512,1024,2048,4096}
batch_sizes=${BATCH_SIZES:-1,16,64}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/device.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
    # The default model's package is not needed: the parity tests that load it are left out.
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/worker/test_gpu.py \
        -k "not default_model_dir and not tiny_llama_dir" 2>&1 | tee "$out/gpu_tests.log"
fi

python3 benchmarks/random_model.py --shape-from "$shape_dir" --output /tmp/random-model \
    --dtype bfloat16 >/dev/null 2>&1 || exit 1
if [ -z "${SKIP_CONTEXTS:-}" ]; then
    TORCH_LOGS=recompiles timeout 200 python3 benchmarks/context_bench.py \
        --model-path /tmp/random-model --device cuda --dtype bfloat16 --contexts "$contexts" \
        --batch-sizes "$batch_sizes" --output-json "$out/context_cuda.json" 2>&1 \
        | grep -v Warning | tee "$out/context_cuda.log"
fi
declare -A serve_args=(
    [graphs]=""
    [eager]="--max-cudagraph-capture-size 0"
    [gathered]="--attention-backend gathered"
    [sampled]=""
)
declare -A client_args=([sampled]="--temperature 1 --top-p 0.95")
for concurrency in ${CONCURRENCIES:-16 64}; do
    for server in ${SERVERS:-graphs eager gathered sampled}; do
        name="serve_c${concurrency}_$server"
        timeout 150 python3 benchmarks/serve_bench.py --launch --model-path /tmp/random-model \
            --serve-args="${serve_args[$server]}" ${client_args[$server]:-} \
            --concurrency "$concurrency" \
            --num-prompts $((concurrency * 4)) --output-json "$out/$name.json" 2>&1 \
            | tail -25 | tee "$out/$name.log"
    done
done
