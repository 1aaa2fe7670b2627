#!/usr/bin/env bash
# On a GPU box with real CosyVoice weights: the model path end to end, then calibration.
#
#   scripts/check_gpu_box.sh MODEL_DIR COSYVOICE_ROOT [PYTHON]
#
# MODEL_DIR       e.g. pretrained_models/Fun-CosyVoice3-0.5B (downloaded beforehand)
# COSYVOICE_ROOT  a checkout of FunAudioLLM/CosyVoice with third_party/Matcha-TTS
# PYTHON          the Python of the CosyVoice environment (default: python3)
#
# It prints what NVML sees, plans, starts 2 instances on 127.0.0.1, sends one request per
# mode (and a streamed one), checks the answers are 24 kHz WAV, reads the GPUs through
# status and the cluster's /metrics, measures the footprint with `calibrate`, and takes
# everything down. Exit status 0 only if every step passed.
set -euo pipefail
MODEL_DIR="$(realpath "${1:?model dir}")"
ROOT="$(realpath "${2:?cosyvoice checkout}")"
PY="${3:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$(mktemp -d /tmp/cvlb-gpu-XXXX)"
PORT=18480 BASE=18400
LB=("$HERE/run.sh")
PROMPT="$ROOT/asset/zero_shot_prompt.wav"
TRANSCRIPT='希望你以后能够做的比我还好呦。'
export COSYVOICE_LB_STATE_DIR="$STATE" COSYVOICE_LB_HOST=127.0.0.1 COSYVOICE_LB_PORT=$PORT \
       COSYVOICE_LB_BASE_PORT=$BASE COSYVOICE_LB_MODEL_DIR="$MODEL_DIR" COSYVOICE_LB_COSYVOICE_ROOT="$ROOT" \
       COSYVOICE_LB_PYTHON="$(command -v "$PY")"
trap '"${LB[@]}" down >/dev/null 2>&1 || true' EXIT

step() { printf '\n== %s\n' "$*"; }
check_wav() {  # file, what
    "$HERE/.venv/bin/python" - "$1" "$2" <<'PYEOF'
import sys, soundfile
info = soundfile.info(sys.argv[1])
assert info.samplerate == 24000 and info.duration > 0.3, (sys.argv[2], info)
print(f"  {sys.argv[2]}: {info.duration:.2f} s at {info.samplerate} Hz")
PYEOF
}

step "NVML inventory and plan"
"${LB[@]}" plan
step "up: 2 instances, staggered"
time "${LB[@]}" up --instances 2 --stagger
"${LB[@]}" status
U="http://127.0.0.1:$PORT/v1/tts"
step "one request per mode"
curl -sf -o "$STATE/zero.wav" -F text='八百标兵奔北坡，北坡炮兵并排跑。' -F mode=zero_shot -F prompt_text="$TRANSCRIPT" -F prompt_audio=@"$PROMPT" "$U"
check_wav "$STATE/zero.wav" zero_shot
curl -sf -o "$STATE/cross.wav" -F text='Hello, this is a cross-lingual test.' -F mode=cross_lingual -F prompt_audio=@"$PROMPT" "$U"
check_wav "$STATE/cross.wav" cross_lingual
curl -sf -o "$STATE/instruct.wav" -F text='今天天气真不错。' -F mode=instruct -F instruct_text='请用广东话表达。' -F prompt_audio=@"$PROMPT" "$U"
check_wav "$STATE/instruct.wav" instruct
curl -sf -o "$STATE/default.wav" -H 'Content-Type: application/json' -d '{"text": "Default voice.", "seed": 1}' "$U"
check_wav "$STATE/default.wav" "json default"
step "streamed: first audio vs total (the answer starts with the first chunk, so the first byte is first audio)"
curl -sf -o "$STATE/stream.wav" -w '  first audio %{time_starttransfer}s, total %{time_total}s\n' \
     -F text='这是一段用来测试流式输出的比较长的句子，应该先听到开头。' -F mode=cross_lingual -F stream=true -F prompt_audio=@"$PROMPT" "$U"
[ "$(stat -c %s "$STATE/stream.wav")" -gt 48044 ] || { echo "streamed answer too short"; exit 1; }
step "per-process GPU memory of the running instances (nvidia-smi)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
step "GPU telemetry: status's GPU columns and the cluster's GPU metrics (NVML)"
"${LB[@]}" status
# (the token from a 0600 file, never on a command line)
(umask 077; printf 'Authorization: Bearer %s\n' "$(cat "$STATE/monitoring/scrape-token")" > "$STATE/scrape.header")
curl -sf -H @"$STATE/scrape.header" "http://127.0.0.1:$PORT/metrics" > "$STATE/cluster.metrics"
grep -E '^cosyvoice_lb_(gpu_|instance_gpu_memory)' "$STATE/cluster.metrics"
for name in cosyvoice_lb_gpu_memory_used_bytes cosyvoice_lb_gpu_memory_total_bytes cosyvoice_lb_instance_gpu_memory_bytes; do
    grep -q "^$name" "$STATE/cluster.metrics" || { echo "no $name in the cluster's /metrics"; exit 1; }
done
curl -sf "http://127.0.0.1:$BASE/metrics" | grep -E '^cosyvoice_(first_package|real_time_factor)_.*_(sum|count)'
"${LB[@]}" down
step "calibrate"
"${LB[@]}" calibrate
"${LB[@]}" plan
echo; echo "all GPU checks passed (state: $STATE)"
