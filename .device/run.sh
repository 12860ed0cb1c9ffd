#!/usr/bin/env bash
# One lease of a GPU machine (BENCHMARKS.md, "Accelerator goals"): where an SDXL step's time goes, and
# what the variants of `python -m sdxl.bench.variants` win back. SDXL base 1.0's configs with random
# fp16 weights written by `write-checkpoint`, 1024x1024, 20 steps (the goal's), bfloat16, in order:
#   1. the benchmark at batch 4 (--quick --no-progress), then in the same process a profile of 3 warm
#      steps of that batch (bench --profile: a jax.profiler trace, its top ops in profile.md);
#   2. the weights modes (issue 55): the model loaded again with fp8_e4m3fn weights, with them and fp8
#      compute (fp8_e4m3fn_compute: the H200's fp8 tensor cores), and with int8 weights (`bench
#      --compare-weights`), each mode's batch 4 timed in turn with bfloat16 weights', in one process;
#   3. the same as 1 at batch 1, without the profile;
#   4. each variant at batch 4, while the budget lasts; those it cannot fit are printed as skipped.
# Beside the checkpoint's writing, preflight.py checks our attention kernels (PREFLIGHT=0 skips it);
# if cuDNN's fails, everything runs with XLA's attention.
#
# Budget (the default 540 s), from an H200's times (BENCHMARKS.md): writing the checkpoint 66 s; a run
# about 90 s (71.9 s from its start to the first image, the cold compile 53.7 s of it, then the FLOP
# count on the host and 3 timed batches of 2.4 s); the profile about 10 s more; the weights modes three
# more loads and cold compiles, about 300 s. So batch 4 and the weights modes, then batch 1 and the variants as far as a larger SECONDS allows. Every run is a process of its own with a cold compile; they share XLA's
# autotuning results (--xla_gpu_per_fusion_autotune_cache_dir), so a variant retunes only what it changed.
#
# The machine has its own jax, torch and transformers but neither diffusers nor our flax pin; they
# travel as wheels, fetched here first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       diffusers==0.42.1 flax==0.12.8 importlib_metadata==8.7.0
# then run `bash .device/run.sh SECONDS` there with .whl carried (without .whl the Python packages are
# the machine's own). CONFIG, SIZE and STEPS (tiny, 256, 2) try the script on a CPU.
#
# $OUT gets five files (a lease brings back at most 8): run.log (all that was printed), results.md (a row
# per run, its overrides in the Model column), results.json (each run's bench JSON by name), profile.md
# and trace.tgz: the trace, for XProf or TensorBoard's profile plugin, with the program's HLO text, from
# which `python -m sdxl.bench.profile DIR TITLE` summarises it again without a GPU.
set -u
budget=${1:-540}
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
export PYTHONUNBUFFERED=1
work=/tmp/sdxl-lease

# An XLA flag this jaxlib does not know stops XLA when it starts: try each on the CPU backend, in seconds.
known() { XLA_FLAGS="$1" JAX_PLATFORMS=cpu python3 -c "import jax; jax.devices()" > /dev/null 2>&1; }
collect() {  # every run's JSON into results.json, with one line per run against the baseline's time
  python3 - $work "$OUT/results.json" <<'EOF'
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"), key=lambda p: p.stat().st_mtime)}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1) + "\n")
base = runs.get("b4", {}).get("s_per_image")
for name, r in runs.items():
    mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.1%}"
    against = f", {base / r['s_per_image']:.3f}x b4's speed" if base and r["batch"] == 4 else ""
    print(f"{name}: batch {r['batch']}, {r['s_per_image']:.4f} s/image, {r['images_per_s']:.3f} images/s{mfu}{against}")
    for key in [k for k in r if k.startswith("weights_") and k.endswith("_cost")]:
        print(f"  {key[len('weights_'):-len('_cost')]} weights: {r['s_per_image'] * r[key]:.4f} s/image, "
              f"{r[key]:.3f}x the time of the run's own {r['dtype']} weights")
EOF
}
run() {  # NAME BATCH SECONDS [VAR=value] [bench options]: a run, when SECONDS fit in what is left
  local name=$1 batch=$2 need=$3 setting=${4:-}; shift 4
  if [ "$(left)" -lt "$need" ]; then echo "skipped $name: $(left) s left, it needs about $need s"; return; fi
  echo "== $name (batch $batch${setting:+, $setting}), $(left) s left"
  env XLA_FLAGS="${XLA_FLAGS:-} $common" ${setting:+"$setting"} timeout $(( $(left) - 5 )) python3 -m sdxl bench \
    --model $model --height $size --width $size --steps $steps --batch $batch --runs 3 --quick --no-progress \
    --json $work/$name.json --markdown $OUT/results.md "$@" < /dev/null 2>&1 | grep -v "^W0\|Loading weights"
  collect
}
main() {
  rm -rf $work && mkdir -p $work/autotune
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; free -g | head -2
  python3 -c "import jax, flax; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__)" 2>&1 | grep -v "^W0"

  common=--xla_gpu_per_fusion_autotune_cache_dir=$work/autotune
  known "$common" || { echo "no shared autotuning: this jaxlib lacks $common"; common=; }

  config=${CONFIG:-sdxl-base-1.0} size=${SIZE:-1024} steps=${STEPS:-20}
  model=$work/$config-random-fp16
  ( start=$(date +%s); python3 -m sdxl write-checkpoint --config $config --dtype float16 --out $model > $work/write.log 2>&1
    echo "write rc $? in $(( $(date +%s) - start )) s" >> $work/write.log ) &
  writer=$!
  if [ "${PREFLIGHT:-1}" = 1 ]; then
    timeout 150 python3 .device/preflight.py 2>&1 | grep -v "^W0" | tee $work/preflight.log
    grep -q "cudnn ok" $work/preflight.log || { echo "cuDNN attention not ok: running with XLA's"; export SDXL_ATTENTION=xla; }
  fi
  wait $writer; cat $work/write.log
  echo "left after writing: $(left) s"

  run b4 4 120 "" --profile $work/trace
  cp $work/trace/profile.md $OUT/
  tar czf $OUT/trace.tgz -C $work trace && du -h $OUT/trace.tgz
  run weights 4 300 "" --compare-weights fp8_e4m3fn,fp8_e4m3fn_compute,int8
  run b1 1 90 ""
  while IFS=$'\t' read -r name variable value; do
    if [ "$variable" = XLA_FLAGS ]; then
      known "$value" || { echo "skipped $name: this jaxlib does not know $value"; continue; }
      setting="XLA_FLAGS=${XLA_FLAGS:-} $common $value"
    elif [ "${!variable:-}" = "$value" ]; then
      echo "skipped $name: the baseline ran with $variable=$value"; continue
    else
      setting="$variable=$value"
    fi
    run "$name" 4 90 "$setting"
  done < <(python3 -m sdxl.bench.variants)
  ls -l $OUT
  echo "done, left: $(left) s"
}

main 2>&1 | tee $OUT/run.log
