#!/usr/bin/env bash
# Elastic membership (docs/elastic.md): ResNet-20 on Fashion-MNIST with 3 CPU ranks,
# first undisturbed (hddp-run --nproc-per-node 3), then elastic (--nproc-per-node 2:3)
# with slot 2 unplugged at 40% of the undisturbed run's time and back at 70%
# (--emulate-unplug). Prints the total time against the undisturbed run, the time from
# the unplug to the first step after re-forming, the steps trained twice, and both
# test accuracies. Logs and metrics go to OUT_DIR.
#   bench/elastic.sh BUILD_DIR OUT_DIR [EPOCHS [TRAIN_IMAGES]]   (defaults 2, 19200)
set -euo pipefail
BUILD=${1:?usage: bench/elastic.sh BUILD_DIR OUT_DIR [EPOCHS [TRAIN_IMAGES]]}
OUT=${2:?usage: bench/elastic.sh BUILD_DIR OUT_DIR [EPOCHS [TRAIN_IMAGES]]}
EPOCHS=${3:-2}
IMAGES=${4:-19200}
PY=${HDDP_PYTHON:-python3}
RUN="$BUILD/tools/hddp-run/hddp-run"
R="$BUILD/examples/resnet/train_resnet"
mkdir -p "$OUT"
source "$(dirname "$0")/lib/fashion-mnist.sh"
export HDDP_DEVICE=cpu
JOB=(--model resnet20 "${DATA[@]}" --epochs "$EPOCHS" --limit-train "$IMAGES" --global-batch 96
  --lr 0.1 --warmup-epochs 0.1 --no-augment --workers 0 --progress lines --log-every 1)
# Each output line with the seconds since the launch, as it arrives.
stamp() {
  "$PY" -u -c 'import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write("%.3f %s" % (time.time() - t0, line))'
}
echo "undisturbed: 3 ranks, $EPOCHS epoch(s) of $IMAGES images"
"$RUN" --nproc-per-node 3 -- "$R" "${JOB[@]}" --metrics "$OUT/straight.jsonl" 2>&1 |
  stamp >"$OUT/straight.log"
total=$(tail -n 1 "$OUT/straight.log" | cut -d' ' -f1)
at=$("$PY" -c "print(round(0.4 * $total, 1))")
back=$("$PY" -c "print(round(0.7 * $total, 1))")
echo "elastic: slot 2 unplugged at $at s, back from $back s (undisturbed run: $total s)"
rm -f "$OUT"/samples.rank*
HDDP_LOG_SAMPLES="$OUT/samples" "$RUN" --nproc-per-node 2:3 --rejoin-every 1 \
  --emulate-unplug "2@$at:$back" -- "$R" "${JOB[@]}" --metrics "$OUT/elastic.jsonl" 2>&1 |
  stamp >"$OUT/elastic.log"
"$PY" - "$OUT" <<'PY'
import glob, re, sys
out = sys.argv[1]
def lines(name):
    return [l.rstrip("\n") for l in open(f"{out}/{name}")]
def seconds(l):
    return float(l.split(" ", 1)[0])
def accuracy(ls):
    for l in reversed(ls):
        m = re.search(r"test accuracy ([0-9.]+)", l)
        if m:
            return float(m.group(1))
    return float("nan")
straight, elastic = lines("straight.log"), lines("elastic.log")
t_straight, t_elastic = seconds(straight[-1]), seconds(elastic[-1])
unplug = next(seconds(l) for l in elastic if "unplugging slot 2" in l)
gen1 = next(i for i, l in enumerate(elastic) if "generation 1:" in l)
first = next(seconds(l) for l in elastic[gen1:] if re.search(r"\] epoch \d+/\d+ step \d+/", l))
gens = {}
for path in glob.glob(f"{out}/samples.rank*"):
    for l in open(path):
        g, step = l.split()[:2]
        gens.setdefault(int(step), set()).add(int(g))
repeated = sum(1 for s in gens.values() if len(s) > 1)
print(f"total time: elastic {t_elastic:.1f} s, undisturbed {t_straight:.1f} s "
      f"(ratio {t_elastic / t_straight:.2f})")
print(f"unplug to the first step after re-forming: {first - unplug:.1f} s")
print(f"steps trained twice: {repeated} of {len(gens)}")
print(f"test accuracy: elastic {accuracy(elastic):.4f}, undisturbed {accuracy(straight):.4f}")
for l in elastic:
    if "hddp-run:" in l and ("generation" in l or "slot" in l or "commit" in l):
        print("  " + l)
PY
