#!/usr/bin/env bash
# Everything a GPU machine must pass, in one go (make test-gpu; a lent GPU's few minutes): install the tree, then the
# suite, the catalogue, the field and the matrix, on the CPU default and with --device cuda, and the GPU bench. Every
# output lands in $OUT (default build/gpu), with one line per step in $OUT/summary.txt: its exit code and seconds.
# Steps run side by side (a GPU machine has cores to spare); the bench runs last, alone on the GPU, within BENCH_LIMIT.
# WHEELS: a folder with a setuptools>=77 wheel, for a machine that cannot fetch one. Every step's output is also packed
# into $OUT/outputs.tar.gz beside summary.txt and machine.txt (each step writes under build/gpu-work), for a machine
# that hands back only a few files.
set -u
cd "$(dirname "$0")/.."
RESULTS=$(realpath -m "${OUT:-build/gpu}")  # what comes back: the summary, the machine, every output packed
OUT=$(realpath -m build/gpu-work)  # each step's own output
PYTHON=${PYTHON:-python3}
case $PYTHON in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac  # the bench runs from bench/
WHEELS=${WHEELS:-build/wheels}
WORKERS=${WORKERS:-10}
LIMIT=${LIMIT:-420}  # seconds each step may take: past that it is stopped and says so (exit 124)
BENCH_LIMIT=${BENCH_LIMIT:-300}
TOTAL=${TOTAL:-0}  # seconds for everything, the bench included (0: no bound): a lent machine's call ends at its limit,
PHASE_END=$((TOTAL > 0 ? TOTAL - BENCH_LIMIT : 0))  # and what it had not packed would be lost
rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
export OMP_NUM_THREADS=1
if [ -d "$WHEELS" ]; then "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" 'setuptools>=77' > "$OUT/install.txt" 2>&1; fi
"$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . >> "$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 2; }
{ nvidia-smi -L; "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"; lscpu | grep -E 'Model name|Flags'; } > "$OUT/machine.txt" 2>&1

step() {  # step NAME COMMAND...: run it, its output in $OUT/NAME.txt, its exit code and time in the summary
    local name=$1; shift
    local started=$SECONDS limit=$LIMIT
    if [ "$PHASE_END" -gt 0 ] && [ $((PHASE_END - SECONDS)) -lt "$limit" ]; then limit=$((PHASE_END - SECONDS)); fi
    if [ "$limit" -le 0 ]; then echo "$name: not run, no time left" >> "$OUT/summary.txt"; return; fi
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - started)) s" >> "$OUT/summary.txt"
}
EC=(env PYTHONWARNINGS=ignore "$PYTHON" -m equivcheck)
: > "$OUT/summary.txt"
step suite "$PYTHON" -m pytest -q -n "$WORKERS" --dist loadfile -p no:randomly -p no:cacheprovider tests &
{ step catalogue "${EC[@]}" catalogue; step catalogue_fp16 "${EC[@]}" catalogue --dtype fp16-autocast;
  step catalogue_cuda "${EC[@]}" catalogue --device cuda --dtype float32 --dtype bf16-autocast; } &
{ step field "${EC[@]}" field; step field_cuda "${EC[@]}" field --device cuda;
  step run "${EC[@]}" run; step run_cuda_float32 "${EC[@]}" run --device cuda --dtype float32;
  step run_cuda_bf16 "${EC[@]}" run --device cuda --dtype bf16-autocast; } &
wait
# The bench measures as users run it: every core, no OMP_NUM_THREADS=1.
(cd bench && PHASE_END=0 LIMIT=$BENCH_LIMIT step bench_gpu env -u OMP_NUM_THREADS "$PYTHON" bench_gpu.py --repeats 2 --json "$OUT/bench_gpu.json")
tar -czf "$RESULTS/outputs.tar.gz" -C "$OUT" .
cp "$OUT/summary.txt" "$OUT/machine.txt" "$RESULTS/"
cat "$OUT/machine.txt" "$OUT/summary.txt"
for name in suite catalogue catalogue_fp16 catalogue_cuda field field_cuda run run_cuda_float32 run_cuda_bf16 bench_gpu; do
    echo "== $name"; tail -n 4 "$OUT/$name.txt" 2>/dev/null
done
