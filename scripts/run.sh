#!/usr/bin/env bash
# The main job: build qmoed, start it on the CPU backend with a generated demo
# bank, and walk through a client session: status, models, a budgeted session's
# residency plan, inference, the plan again (what is resident now), telemetry;
# then a tiny transformers model generating with its experts in qmoed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export PATH="$here/.venv/bin:$PATH"

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
bin="$here/build"
qmoectl="$bin/clients/qmoectl"

demo="$here/demo"
mkdir -p "$demo"
bank="$demo/demo-bank.safetensors"
# A small GPT-OSS-shaped model: 4 MoE layers, 16 experts, top-2, int4 block 32,
# SwiGLU interleaved, with router weights so inference needs no logits.
if [ ! -f "$bank" ]; then
  "$bin/tools/qmoe-bank/qmoe-bank" create --out "$bank" --layers 4 --experts 16 \
    --hidden 512 --inter 1024 --k 2 --bits 4 --block-size 32 --activation swiglu \
    --swiglu-fusion 1 --alpha 1.702 --beta 1 --limit 7 --router --seed 7 --quiet
fi

sock="$demo/qmoed.sock"
rm -f "$sock"
"$bin/daemon/qmoed" --socket "$sock" --backend cpu --model demo="$bank" \
  --state-dir "$demo/state" --log-level warning $( [ "$(id -u)" = 0 ] && echo --allow-root ) &
daemon=$!
trap 'kill $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done

q() { echo; echo "\$ qmoectl $*"; "$qmoectl" --socket "$sock" "$@"; }

q status
q models
echo; echo "\$ qmoectl create demo --policy lru --budget 50%"
session=$("$qmoectl" --socket "$sock" create demo --policy lru --budget 50% | head -n1)
echo "$session"
q plan "$session"

python3 - "$demo" <<'PY'
import sys, numpy as np
rng = np.random.default_rng(2026)
for i in range(4):
    np.save(f"{sys.argv[1]}/x{i}.npy", rng.standard_normal((8, 512), dtype=np.float32))
PY
for layer in 0 1 2 3; do
  q infer "$session" --layer "$layer" --hidden "$demo/x$layer.npy" --out "$demo/y$layer.npy"
done
q infer "$session" --layer 0 --hidden "$demo/x0.npy" --out "$demo/y0.npy" --routing
q plan "$session"
q telemetry "$session"
q sessions

# A transformers model generating through qmoed: the tiny Qwen3-MoE fixture,
# loaded without its routed experts (qmoe_client.transformers.from_pretrained),
# its experts imported as a bank and served by this qmoed under next_use at half
# their bytes; it prints the tokens, the hit rate and both processes' memory.
torch_py=""
for d in "${QMOE_TORCH_VENV:-}" /var/cache/qmoed/venv-torch "$HOME/.cache/qmoed/venv-torch"; do
  if [ -n "$d" ] && [ -x "$d/bin/python" ]; then torch_py="$d/bin/python"; break; fi
done
if [ -n "$torch_py" ]; then
  fixture="$here/tests/import/fixtures/qwen3_moe"
  echo; echo "\$ python examples/generate.py --model tests/import/fixtures/qwen3_moe --policy next_use --budget 50% --prompt-ids 1,5,9,2,7 --max-new-tokens 16"
  if ! TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 \
      "$torch_py" examples/generate.py --model "$fixture" --bank "$demo/qwen3_moe.bank" \
      --name qwen3_moe --socket "$sock" --qmoe-bank "$bin/tools/qmoe-bank/qmoe-bank" \
      --policy next_use --budget 50% --prompt-ids 1,5,9,2,7 --max-new-tokens 16 \
      2>"$demo/generate.log"; then
    cat "$demo/generate.log" >&2
    exit 1
  fi
else
  echo; echo "(no torch environment: scripts/setup.sh installs one unless QMOE_SKIP_TORCH=1;"
  echo " skipping the transformers generation)"
fi
q sessions
q shutdown
wait $daemon
trap - EXIT
echo; echo "qmoed exited cleanly; the demo bank and outputs are in $demo"
