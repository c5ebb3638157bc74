#!/usr/bin/env bash
# All GPU benchmarks in one device call (two H200s). From the project root, after
# `bash ../shared/gpu/prepare-wheels.sh` filled .whl/ here:
#   run(command="bash benchmarks/run_gpu.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Each benchmark prints a table last; outputs (<name>.txt, profile.json, ppo-run/) are packed into
# $OUT/results.tgz (./out without $OUT). Every call starts from a fresh scratch folder, so running
# it twice never meets the first call's run directories; results.tgz is replaced by the newer one.
# Scripts with an --out write their files into <out>/run-NNN/ (benchmarks/run_dirs.py), here
# always run-001 with `latest` linking to it: peer/run-001/peer_bench.txt,
# fidelity/run-001/fidelity.json, plan_vs_symmetric/run-001/results.json.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Results are written to a scratch folder and packed into one archive at the end ($OUT/results.tgz):
# the device call returns at most 8 files.
final=${OUT:-out}; out=$(mktemp -d); mkdir -p "$final"
nvidia-smi -L | tee "$out/gpus.txt"
# The GPUs' clocks, power and clock-event reasons every 200 ms (benchmarks/gpu_clocks.py sums them
# up at the end, per call of every run directory written here).
query=$(python3 -c "from benchmarks.gpu_clocks import NVIDIA_SMI_QUERY; print(NVIDIA_SMI_QUERY)")
nvidia-smi --help-query-gpu | grep -q clocks_event_reasons.active || query=${query/clocks_event/clocks_throttle}
nvidia-smi --query-gpu="$query" --format=csv,noheader,nounits -lms 200 >"$out/gpu_clocks.csv" 2>&1 & sampler=$!
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-150}" "$@" >"$out/$name.txt" 2>&1; echo "rc=$?" >>"$out/$name.txt"; tail -12 "$out/$name.txt"; }
only=${ONLY:-engine,generate,gentp2,realloc,copy,ppo,profile}
# The bf16 matmul rate held for 30 s against its first second (power cap; gpu_clocks.txt beside it).
[[ $only == *sustained* ]] && run sustained_gemm python3 benchmarks/sustained_gemm.py --seconds ${GEMM_SECONDS:-30}
# A host-bound small model (issue 27, tenth step): the 0.5B fidelity shape's calls in 24 and in 12
# micro-batches, with the profile's GPU idle report (where the host's time goes). SMALL_MICRO picks
# the counts, SMALL_PROFILE= (empty) drops the profile, e.g. SMALL_MICRO="24 12 6" SMALL_PROFILE=.
[[ $only == *small* ]] && for n in ${SMALL_MICRO:-24 12}; do run small_model_mb$n python3 benchmarks/engine_bench.py \
  --model qwen2.5-0.5b --grpo-shape 64,8,256,512 --n-micro $n --tp 1 --steps 2 --warmup 1 ${SMALL_PROFILE---profile}; done
[[ $only == *engine* ]] && run engine python3 benchmarks/engine_bench.py ${ENGINE_ARGS:-}
[[ $only == *generate* ]] && run generate python3 benchmarks/generate_bench.py ${GEN_ARGS:-}
[[ $only == *gentp2* ]] && run generate_tp2 python3 benchmarks/generate_bench.py --tp 2 ${GEN_TP2_ARGS:---modes graph,graph+compile}
[[ $only == *realloc* ]] && run realloc python3 benchmarks/realloc_bench.py
[[ $only == *copy* ]] && run segment_copy python3 benchmarks/segment_copy_bench.py
# Multi-turn rollouts (issue 27, twenty-first step; one GPU, ~2 minutes): fixed-length turns against
# single-turn generation, finished trajectories dropped, and EOS-ended turns at read lags 0 and 2.
[[ $only == *multiturn* ]] && LIMIT=${MULTITURN_LIMIT:-300} run multiturn python3 benchmarks/multiturn_bench.py \
  ${MULTITURN_ARGS:---spread --read-lags 0,2 --mean-turn-len 64}
# The gpu test tier (pytest comes from .whl: prepare-wheels.sh pytest pluggy iniconfig pytest-timeout).
[[ $only == *gputests* ]] && run gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests
# FP8 rollouts (issue 27, thirteenth step; one H200, ~4 minutes): their gpu tests (the _scaled_mm
# product, the Triton kernels on an e4m3 cache, generation under graph and compile), then the peer
# bench's decode in bf16 and with each setting. For the whole step, ONLY=peer with
# PEER_ARGS="--also fp8:sampling.fp8=true,sampling.kv_cache_dtype=fp8" adds an FP8 row of ours
# beside the bf16 one and TRL's (one more run of ours, ~1 minute).
[[ $only == *fp8* ]] && LIMIT=${FP8_TEST_LIMIT:-150} run fp8_tests python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/actors/generation/test_fp8_weights.py tests/actors/kernels/test_decode_attention.py
[[ $only == *fp8* ]] && LIMIT=${FP8_LIMIT:-240} run generate_fp8 python3 benchmarks/generate_bench.py --grpo-step \
  --modes ${FP8_MODES:-graph+compile,graph+compile+fp8,graph+compile+fp8kv,graph+compile+fp8+fp8kv}
# The decode attention kernel's launch configs on the peer bench's decode, for an e4m3 and a bf16
# cache (one H200, ~2 minutes): which configs an e4m3 cache wants (it read at ~60% of HBM with
# the bf16-tuned candidates, fifteenth step of issue 27).
[[ $only == *kvsweep* ]] && for c in fp8 bf16; do LIMIT=${KVSWEEP_LIMIT:-200} run kv_sweep_$c python3 \
  benchmarks/decode_attention_bench.py --sweep --cache-dtype $c; done
# Training attention of one peer-bench micro-batch by kernel (FlashAttention 2 cascade, whole rows,
# cuDNN varlen and dense; seconds): is there a faster kernel for the step's 421 ms of attention?
[[ $only == *trainattn* ]] && run train_attention python3 benchmarks/train_attention_bench.py ${TRAINATTN_ARGS:-}
# Optional second reallocation run with other settings, e.g. REALLOC_ARGS="--pull off".
[[ $only == *realloc* && -n ${REALLOC_ARGS:-} ]] && run realloc_b python3 benchmarks/realloc_bench.py $REALLOC_ARGS
# Measured hardware + cost-model efficiencies for plan.profile (python -m app profile, 2 ranks on 2 GPUs).
[[ $only == *profile* ]] && run profile python3 -m app profile --out "$out/profile.json"
# PPO on two H200s; Ray without its dashboard on this machine (cluster/resources.py honours it).
# With the profile just measured, the plan's per-call estimates use the measured efficiencies.
# PPO_ARGS: more dotted overrides, e.g. a manual plan (docs/benchmarks.md has the one used).
# GRPO against TRL's GRPOTrainer on ONE GPU (kind nvidia-h200), about 6 minutes: ONLY=peer, with trl's
# wheels in .whl/ (benchmarks/peer_bench.py says how); the 2.5 GB model it builds stays out of $OUT.
[[ $only == *peer* ]] && LIMIT=${PEER_LIMIT:-540} run peer python3 benchmarks/peer_bench.py --out "$out/peer" \
  --inputs /tmp/peer-inputs ${PEER_ARGS:-}
profile_arg=(); [[ -f $out/profile.json ]] && profile_arg=(plan.profile="$out/profile.json")
[[ $only == *ppo* ]] && LIMIT=${PPO_LIMIT:-400} run ppo python3 -m app train examples/ppo-1b-h200x2.yaml \
  run.iterations=${PPO_ITERS:-5} tracking.wandb=false cluster.dashboard=false run.dir="$out/ppo-run" "${profile_arg[@]}" \
  ${PPO_ARGS:-}
# Searched against symmetric plans, every case this host's GPUs hold (issue 18; PVS_ARGS e.g. --staleness 0,1).
[[ $only == *pvs* ]] && LIMIT=${PVS_LIMIT:-580} run plan_vs_symmetric python3 benchmarks/plan_vs_symmetric.py \
  --out "$out" ${PVS_ARGS:-}
# Issue 12, on ONE H200 (the first GPU): estimated vs measured time and peak memory per call for
# PPO and GRPO over 6 shapes, before and after self-calibration, and the "Why" GRPO run
# (5 iterations). Not in the default set: alone it takes ~8 minutes, e.g. on `nvidia-h200`:
#   run(command="ONLY=fidelity bash benchmarks/run_gpu.sh", carry=[".whl"], kind="nvidia-h200")
# Issue 27: FIDELITY_ARGS="--sizes --iterations 2" (0.5B-8B actors, first plans only, ~8 minutes);
# FIDELITY_ARGS="--steady 4 --only size-0.5b-grpo-64x8x256+512-mb4" keeps the first plan for 5
# iterations and compares it with the median of iterations 1-4 (a host-bound call's one iteration
# varies up to 2.5x);
# benchmarks/fit_efficiency.py then fits the preset's factors to the results on any machine.
[[ $only == *fidelity* ]] && LIMIT=${FIDELITY_LIMIT:-540} CUDA_VISIBLE_DEVICES=${FIDELITY_GPU:-0} \
  run fidelity python3 benchmarks/fidelity_bench.py --out "$out/fidelity" ${FIDELITY_ARGS:-}
kill "$sampler" 2>/dev/null
python3 benchmarks/gpu_clocks.py "$out/gpu_clocks.csv" "$out" >"$out/gpu_clocks.txt" 2>&1; tail -40 "$out/gpu_clocks.txt"
tar czf "$final/results.tgz" -C "$out" . && rm -rf "$out"
exit 0
