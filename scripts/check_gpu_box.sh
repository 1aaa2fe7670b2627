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
# everything down. Where nvidia-cuda-mps-control is on PATH it then runs the same streamed
# load on 2 instances without and with --mps and prints both side by side (else it says
# why it skipped that). Exit status 0 only if every step passed.
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
step "MPS on/off: 2 instances, the same streamed load without and with --mps (CUDA MPS)"
if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "  skipped: nvidia-cuda-mps-control is not on PATH (NVIDIA driver utilities, e.g. the Debian/Ubuntu"
    echo "  package nvidia-compute-utils-<driver major>), so --mps cannot run on this box"
else
    # A bounded closed loop: 2 clients per instance (none refused at the default --max-queue 2).
    MPS_REQUESTS=32 MPS_CONCURRENCY=4
    for mps in off on; do
        flags=(--instances 2 --stagger)
        if [ "$mps" = on ]; then flags+=(--mps); fi
        "${LB[@]}" up "${flags[@]}"
        # with MPS on, nvidia-cuda-mps-server is what holds the GPU for the instances
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv || true
        echo "  mps $mps: $MPS_REQUESTS streamed requests, $MPS_CONCURRENCY at a time, after $MPS_CONCURRENCY warm-up ones"
        "$HERE/.venv/bin/python" - "$HERE/bench" "http://127.0.0.1:$PORT/v1/tts" "$MPS_CONCURRENCY" \
            "$MPS_REQUESTS" "$STATE/mps-$mps.json" <<'PYEOF'
# bench/load.py's client (127.0.0.1 only, no proxies); each answer streamed to time its first audio
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import httpx
import load
import numpy as np

url, concurrency, total, out = load.loopback_only(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
BODY = {"text": "这是一段用来测试流式输出的比较长的句子，应该先听到开头。", "stream": True, "seed": 1}


async def one(http):
    """(status, seconds to the first audio after the 44-byte WAV header, seconds to the end)"""
    began, first, got, status = time.monotonic(), None, 0, 0
    try:
        async with http.stream("POST", url, json=BODY) as response:
            status = response.status_code
            async for chunk in response.aiter_bytes():
                got += len(chunk)
                if first is None and got > 44:
                    first = time.monotonic() - began
    except httpx.HTTPError:
        status = 0
    return status, first, time.monotonic() - began


async def measure():
    async with load.client(timeout=120.0) as http:
        await asyncio.gather(*(one(http) for _ in range(concurrency)))  # warm-up, not counted
        results, left = [], [total]

        async def worker():
            while left[0] > 0:
                left[0] -= 1
                results.append(await one(http))

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.monotonic() - began


results, seconds = asyncio.run(asyncio.wait_for(measure(), 900))
good = [r for r in results if r[0] == 200 and r[1] is not None]
first = np.array([r[1] for r in good] or [np.nan]) * 1000
whole = np.array([r[2] for r in good] or [np.nan]) * 1000
summary = {"requests": len(results), "ok": len(good), "seconds": seconds, "throughput": len(good) / seconds,
           "first_p50_ms": float(np.percentile(first, 50)), "first_p95_ms": float(np.percentile(first, 95)),
           "total_p50_ms": float(np.percentile(whole, 50)), "total_p95_ms": float(np.percentile(whole, 95))}
with open(out, "w") as f:
    json.dump(summary, f)
print(f"  {len(good)}/{len(results)} answered with audio in {seconds:.1f} s")
sys.exit(0 if len(good) == len(results) else 1)
PYEOF
        "${LB[@]}" down
    done
    "$HERE/.venv/bin/python" - "$STATE/mps-off.json" "$STATE/mps-on.json" <<'PYEOF'
import json, sys
off, on = (json.load(open(path)) for path in sys.argv[1:3])
rows = [("throughput (req/s)", "throughput"), ("first chunk p50 (ms)", "first_p50_ms"),
        ("first chunk p95 (ms)", "first_p95_ms"), ("total p50 (ms)", "total_p50_ms"),
        ("total p95 (ms)", "total_p95_ms")]
print(f"  {'':22}{'mps off':>10}{'mps on':>10}{'on/off':>9}")
for label, key in rows:
    ratio = on[key] / off[key] if off[key] else float("nan")
    print(f"  {label:22}{off[key]:>10.2f}{on[key]:>10.2f}{ratio:>9.2f}")
PYEOF
fi
echo; echo "all GPU checks passed (state: $STATE)"
