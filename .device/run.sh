#!/usr/bin/env bash
# One lease of a GPU machine (BENCHMARKS.md, "Accelerator goals"): check the attention kernels there,
# then the benchmark at full size (SDXL base 1.0's configs with random fp16 weights, 1024x1024, 25
# steps) at batch 4 with --quick, and at batch 1 if time is left. Everything lands in $OUT.
#
# The machine has its own jax, torch and transformers but neither diffusers nor our flax pin; they
# travel as wheels, fetched here first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       diffusers==0.42.1 flax==0.12.8 importlib_metadata==8.7.0
# then run `bash .device/run.sh SECONDS` there with .whl carried. PREFLIGHT=0 skips the kernel check;
# CONFIG, SIZE and STEPS (tiny, 256, 2) try the script on a CPU.
set -u
budget=${1:-540}
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; free -g | head -2;
  python3 -c "import jax, flax, diffusers, torch, transformers, huggingface_hub as h; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'diffusers', diffusers.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'hub', h.__version__)"; } 2>&1 | tee $OUT/env.txt
config=${CONFIG:-sdxl-base-1.0} size=${SIZE:-1024} steps=${STEPS:-25}
model=/tmp/$config-random-fp16
( start=$(date +%s); python3 -m sdxl write-checkpoint --config $config --dtype float16 --out $model > $OUT/write.log 2>&1
  echo "write rc $? in $(( $(date +%s) - start )) s" >> $OUT/write.log ) &
writer=$!
if [ "${PREFLIGHT:-1}" = 1 ]; then
  timeout 150 python3 .device/preflight.py 2>&1 | grep -v "^W0" | tee $OUT/preflight.log
  grep -q "cudnn ok" $OUT/preflight.log || { echo "cuDNN attention not ok: benchmarking with XLA's"; export SDXL_ATTENTION=xla; }
fi
wait $writer; cat $OUT/write.log
echo "left after writing: $(left) s"
bench() {  # batch, runs
  python3 -m sdxl bench --model $model --height $size --width $size --steps $steps --batch $1 --runs $2 --quick \
    --compare diffusers --json $OUT/b$1.json --markdown $OUT/b$1.md 2>&1 | grep -v "^W0\|Loading weights" | tee $OUT/b$1.log
}
bench 4 3
echo "left after batch 4: $(left) s"
if [ "$(left)" -gt 220 ]; then timeout $(( $(left) - 10 )) bash -c "$(declare -f bench); model=$model size=$size steps=$steps OUT=$OUT; bench 1 3"; fi
echo "done, left: $(left) s"
