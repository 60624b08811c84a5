#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, each step under its own time limit:
#   1. the Triton kernel tests compiled and run on the GPU (tests/kernels/test_triton_pairwise.py), and the
#      losses' training steps under CUDA's sync debug mode (tests/losses/test_device_reads.py);
#   2. python -m bench triton_check: accuracy against float64, opcheck, speed and memory;
#   3. python -m bench gpu_step at batch 900 (ViT-S/16, AMP) against PML's SupCon, once on the torch
#      path and once with --pairwise triton (PML_HYPERBOLIC_TRITON=1, the library's own dispatch).
#
#   bash bench/gpu_checks.sh OUTDIR            # JSON records and logs go to OUTDIR
#   STEPS=10 bash bench/gpu_checks.sh OUTDIR   # fewer timed steps per row
#   ROUNDS=1 bash bench/gpu_checks.sh OUTDIR   # each gpu_step row once (default 2 rounds, interleaved)
#   PROFILE=3 bash bench/gpu_checks.sh OUTDIR  # also profile 3 steps per row (gpu_step --profile)
#   CHECKS="triton_check gpu_step_torch" bash bench/gpu_checks.sh OUTDIR   # some of the steps
#
# Run it from the repository root with the package importable (installed, or PYTHONPATH=.).
set -u
out=${1:?usage: bash bench/gpu_checks.sh OUTDIR}
steps=${STEPS:-20}
rounds=${ROUNDS:-2}
checks=${CHECKS:-kernel_tests device_reads triton_check gpu_step_torch gpu_step_triton}
profile=${PROFILE:+--profile $PROFILE}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run, keep the log, remember a failure, go on
    local name=$1 limit=$2
    shift 2
    case " $checks " in *" $name "*) ;; *) return ;; esac
    echo "=== $name"
    local begin=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - begin)) s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu,driver_version --format=csv
"$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

step kernel_tests 150 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_pairwise.py \
    tests/core/test_poincare_ball.py -k "triton or Triton"
step device_reads 120 "$py" -m pytest -q -p no:cacheprovider tests/losses/test_device_reads.py
step triton_check 150 "$py" -m bench --output "$out/triton_check.json" triton_check --sizes "${TRITON_SIZES:-900,4096}"
step gpu_step_torch 200 "$py" -m bench --output "$out/gpu_step_torch.json" gpu_step --rows hyp_vit,hier \
    --batch-size 900 --steps "$steps" --rounds "$rounds" --pairwise torch $profile
step gpu_step_triton 200 "$py" -m bench --output "$out/gpu_step_triton.json" \
    gpu_step --rows hyp_vit,hier --batch-size 900 --steps "$steps" --rounds "$rounds" --pairwise triton $profile
exit $status
