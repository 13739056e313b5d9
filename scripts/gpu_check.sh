#!/bin/bash
# The CUDA checks as one device call (CI has no GPU and never runs them).
#
#   here:   bash scripts/gpu_check.sh prepare    # the wheels of our dependencies the device image lacks, into .whl/,
#                                                # and the built-in GGUF's tokenizer without its tensors
#   there:  the device tool's run, carry [".whl"], command "bash scripts/gpu_check.sh run", timeout_s 480
#
# run: installs .whl/ into /tmp/site; prints the GPU; runs tests/test_cuda.py (one GPU) and
# tests/test_tensor_parallel_cuda.py (its cases need 2-4 GPUs and say so); builds a random Llama of
# SmolLM2's shape there (no model file travels: the GGUF is over the tree's size limit); times the
# Triton quantized matmuls (benchmarks/cuda_quant_matmul.py); writes a random-block Q4_K_M Llama
# (8 layers of TinyLlama's widths, benchmarks/gguf_mixes.py) and runs `pipeserve bench throughput`
# on it kept quantized (Triton; then PyTorch's ops, PIPESERVE_CUDA_QUANT=torch; then one request)
# and dequantized (--quantization none); then the SmolLM2-shaped model in bfloat16 beside
# transformers, in float32, and in bfloat16 over a 2-stage pipeline on the one GPU (--device cuda:0).
# `run quant` stops after the kept Q4_K_M runs and runs only tests/test_cuda.py (TESTS=triton: only its
# Triton test), ~5 minutes there. Before the Q4_K_M benchmarks, benchmarks/cuda_step_profile.py profiles
# that model's steps, kept quantized and dequantized (PROFILE=auto: only kept; BENCH=0 stops there;
# QUANT_MATMUL_ARGS go to the kernel table). Each step has its own time limit, so one that hangs leaves
# the others their time. Everything it prints is also written under $OUT. DEVICE=cpu NUM=4 runs the
# same steps here, to check the script.
set -u
DEVICE=${DEVICE:-cuda}
NUM=${NUM:-64}
STEPS=${2:-all}   # run quant: tests/test_cuda.py, the kernel table, the step profile and the kept Q4_K_M benchmarks
case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    # our dependencies that the device image lacks, at the versions installed here
    for name in gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn llguidance \
            pytest-xdist execnet; do   # pyproject.toml's addopts name -n: the plugin must be there
        version=$(python3 -c "import importlib.metadata as m; print(m.version('$name'))")
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$name==$version" 2>&1 | grep -v '^WARNING'
    done
    PYTHONPATH=$PWD python3 benchmarks/gguf_mixes.py --out .whl --metadata-only
    ls -la .whl
    ;;
run)
    set -o pipefail
    OUT=${OUT:-/tmp/gpu-check}
    mkdir -p "$OUT"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        export PYTHONPATH=$PWD
    fi
    export PYTHONUNBUFFERED=1
    { nvidia-smi -L 2>/dev/null; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } 2>&1 | tee "$OUT/setup.txt"
    if [ "$STEPS" = quant ]; then
        timeout 200 python3 -m pytest -q -rs -n 0 -p no:cacheprovider tests/test_cuda.py ${TESTS:+-k "$TESTS"} 2>&1 \
            | tee "$OUT/tests.txt"
    else
        timeout 200 python3 -m pytest -q -rs -n 0 -p no:cacheprovider tests/test_cuda.py tests/test_tensor_parallel_cuda.py 2>&1 \
            | tee "$OUT/tests.txt"
    fi
    [ "$STEPS" = quant ] || timeout 60 python3 - <<'PY' 2>&1 | tee -a "$OUT/setup.txt"
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.checkpoints import TINY_VOCAB, save_tiny_tokenizer

# SmolLM2-135M's shape, the tests' small vocabulary (the benchmark's prompts are ids of the tokenizer)
cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
out = Path("/tmp/smol-random")
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
save_tiny_tokenizer(out)
print("random SmolLM2-shaped Llama in", out)
PY
    bench() {   # name, time limit, bench arguments
        local name=$1 limit=$2
        shift 2
        echo "== $name: $*" | tee -a "$OUT/bench.txt"   # one file: the device tool returns 8 at most
        timeout "$limit" python3 -m pipeserve.entrypoints.cli bench throughput --temperature 0 --no-progress --num-warmup 1 \
            --input-len 128 --output-len 128 "$@" 2>&1 | tee -a "$OUT/bench.txt"
    }
    if [ "$DEVICE" = cuda ]; then   # the Triton kernels against PyTorch's ops and a dense weight, per row count
        timeout 120 python3 benchmarks/cuda_quant_matmul.py ${QUANT_MATMUL_ARGS:-} 2>&1 \
            | tee "$OUT/quant_matmul.txt"
    fi
    timeout 60 python3 benchmarks/gguf_mixes.py --out /tmp/mixes --random-blocks --types Q4_K_M --layers 8 \
        --source .whl/smollm2-meta.gguf 2>&1 | tee -a "$OUT/setup.txt"
    if [ "$DEVICE" = cuda ]; then   # where a step's time goes, kept quantized and dequantized (torch.profiler)
        for q in ${PROFILE:-auto none}; do
            timeout 100 python3 benchmarks/cuda_step_profile.py --model /tmp/mixes/llama-Q4_K_M.gguf --quantization $q \
                2>&1 | tee -a "$OUT/step_profile.txt"
        done
    fi
    [ "${BENCH:-1}" = 0 ] && exit 0
    bench q4km_auto_1req 60 --model /tmp/mixes/llama-Q4_K_M.gguf --device "$DEVICE" --dtype bfloat16 \
        --quantization auto --backend pipeserve --num-prompts 1
    PIPESERVE_CUDA_QUANT=torch bench q4km_auto_torch_ops_1req 60 --model /tmp/mixes/llama-Q4_K_M.gguf \
        --device "$DEVICE" --dtype bfloat16 --quantization auto --backend pipeserve --num-prompts 1
    bench q4km_auto 90 --model /tmp/mixes/llama-Q4_K_M.gguf --device "$DEVICE" --dtype bfloat16 \
        --quantization auto --backend pipeserve --num-prompts "$NUM"
    [ "$STEPS" = quant ] && exit 0
    bench q4km_none 90 --model /tmp/mixes/llama-Q4_K_M.gguf --device "$DEVICE" --dtype bfloat16 \
        --quantization none --backend pipeserve --num-prompts "$NUM"
    PIPESERVE_CUDA_QUANT=torch bench q4km_auto_torch_ops 90 --model /tmp/mixes/llama-Q4_K_M.gguf --device "$DEVICE" \
        --dtype bfloat16 --quantization auto --backend pipeserve --num-prompts "$NUM"
    bench bf16 90 --model /tmp/smol-random --device "$DEVICE" --dtype bfloat16 --backend pipeserve,hf \
        --num-prompts "$NUM"
    bench fp32 90 --model /tmp/smol-random --device "$DEVICE" --dtype float32 --backend pipeserve \
        --num-prompts "$NUM"
    pp2_device=$DEVICE; [ "$DEVICE" = cuda ] && pp2_device=cuda:0   # both stages on the one GPU
    bench bf16_pp2 90 --model /tmp/smol-random --device "$pp2_device" --dtype bfloat16 \
        --pipeline-parallel-size 2 --backend pipeserve --num-prompts "$NUM"
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh prepare|run [quant]" >&2
    exit 2
    ;;
esac
