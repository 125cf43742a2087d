#!/bin/bash
# The GPU tier of remote-drafter, in one call on an H200 machine (see the README):
#   device run: bash packages/remote-drafter/benchmarks/gpu.sh   (carry: .whl, and .exl3ext where
#   an earlier call packed exllamav3's build: tools/exl3-ext.sh)
# No registry there: tools/gpu-env.sh installs the carried wheels (.whl/, python 3.12; another
# folder: GPU_WHEELS=<it>) and builds the C helpers. Writes JSON under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/remote-drafter-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/gpu-env.sh "${GPU_WHEELS:-.whl}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The package's whole test suite (every tier, exllamav3's build included: longer than a device
# call allows beside a measurement) comes first in the full GPU tier alone. An ONLY_* mode
# below is one measurement; those that time our kernels run the kernels' GPU tests themselves
# (ONLY_DSV41, =tests, =moe-before-after, =bf16-before-after, =before-after, =plan).
# SKIP_TESTS=1: no suite even in the full tier; ALL_TESTS=1: the suite before a mode too.
only=${ONLY_DSV41:-}${ONLY_DRAFTER_ROUND:-}${ONLY_EXL3_DRAFTER:-}${ONLY_EXL3:-}
if [[ -z ${SKIP_TESTS:-} && ( -z $only || -n ${ALL_TESTS:-} ) ]]; then
  echo "== remote-drafter tests under this torch (CPU tiers + the GPU tests)"
  python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests 2>&1 | tail -5 | tee "$OUT/pytest.txt"
fi
if [[ -n ${ONLY_DSV41:-} ]]; then  # ONLY_DSV41=1: only DeepSeek-V4.1's drafter (below), after its kernels' tests
  python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_dsv41_kernels.py 2>&1 | tail -3 \
    | tee "$OUT/dsv41-kernels-pytest.txt"
  python3 packages/remote-drafter/benchmarks/dsv41_gpu.py --out "$OUT/dsv41-gpu.json"
  exit
fi
if [[ -n ${ONLY_DRAFTER_ROUND:-} ]]; then  # DeepSeek's drafter's round at the Flash width
  # (drafter_round.py), EXL3 with exllamav3's fused experts and bf16, after the fused experts'
  # GPU tests; =tests or =bench runs one half (exllamav3's build, ~5 min, comes with the first),
  # =profile the kernel profile alone, =phases the bf16 round's host share, =decode EXL3's decode
  # rate, =gemv an EXL3 linear through our own kernel, =moe an EXL3 MoE layer through our own kernel,
  # =ab the EXL3 round on exllamav3's experts against the kernels chosen at start-up, =kernels
  # both =moe and =ab in one call, =worker the worker's own cost by phase, =upstream one MoE
  # layer against exllamav3's BlockSparseMLP, =before-after a change to the round (below), =plan
  # the experts' plan kernel against torch's sort (below),
  # =link-before-after the worker's own cost around the stub drafter before and after (below),
  # =moe-before-after one MoE layer on our expert kernels before and after, =bf16-before-after
  # the bf16 round before and after (below), =attention the attention kernel's variants (below)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
  if [[ $ONLY_DRAFTER_ROUND == phases ]]; then  # =phases: the bf16 round's host share, its small
    # arrays in one copy against one each and one blocking each, replays on the caller's stream
    # against the owned one (after the GPU tests of the
    # round's inputs: drafts as the CPU's, graphed, one card and the pair), and torch's grouped
    # GEMM at the experts' shapes (round_phases.py; no exllamav3)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_drafter_gpu.py \
      packages/remote-drafter/tests/test_dsv41_drafter.py packages/drafter-tp2-nvlink/tests/test_tp2_gpu.py \
      2>&1 | tail -3 | tee "$OUT/drafter-gpu-pytest.txt" || echo "== tests failed (above); the timing goes on"
    python3 packages/remote-drafter/benchmarks/round_phases.py --host-ab --grouped-mm \
      --host-profile "$OUT/round-host-profile.txt" --out "$OUT/round-phases.json" 2>&1 | tail -12
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == worker ]]; then  # =worker: the worker's own cost by phase on this
    # host, the stub drafter's (no GPU work) beside the Flash-width bf16 drafter's in CUDA graphs
    # (worker_cost.py; no exllamav3)
    python3 packages/remote-drafter/benchmarks/worker_cost.py --batches 16 --rounds 60 \
      --out "$OUT/worker-cost-stub.json" 2>&1 | tee "$OUT/worker-cost-stub.log" | tail -8 \
      || echo "== the stub's run failed (above); the Flash drafter's goes on"
    python3 packages/remote-drafter/benchmarks/worker_cost.py --drafter flash --rounds 60 \
      --out "$OUT/worker-cost-flash.json" 2>&1 | tee "$OUT/worker-cost-flash.log" | tail -12
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == decode ]]; then  # =decode: how fast any kernel can decode EXL3's
    # 4-bit trellis on this GPU against its read rate (exl3_decode_rate.py, after its tests with
    # the inline-PTX decodes compiled; no exllamav3 needed)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_decode_rate.py \
      2>&1 | tail -3 | tee "$OUT/exl3-decode-rate-pytest.txt"
    python3 packages/remote-drafter/benchmarks/exl3_decode_rate.py --out "$OUT/exl3-decode-rate.json"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == gemv ]]; then  # =gemv: an EXL3 linear through a kernel of our own
    # against exllamav3's (exl3_gemv.py, after the EXL3 format's and the kernel's tests compiled;
    # exllamav3's build, ~5 min, comes with it)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_gemv.py \
      packages/remote-drafter/tests/test_exl3_format.py 2>&1 | tail -3 | tee "$OUT/exl3-gemv-pytest.txt"
    python3 packages/remote-drafter/benchmarks/exl3_gemv.py --out "$OUT/exl3-gemv.json"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == plan ]]; then  # =plan: the experts' and the round kernels' GPU
    # tests, then our EXL3 MoE layer with its plan's kernel against torch's sort (exl3_moe_layer.py;
    # no exllamav3 wanted: on a fresh machine carry a wheel folder without it, GPU_WHEELS=<it>;
    # a warm machine keeps what an earlier call installed, exllamav3 too, and then builds it)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_triton_experts.py \
      packages/remote-drafter/tests/test_dsv41_kernels.py 2>&1 | tail -8 | tee "$OUT/plan-pytest.txt" \
      || echo "== tests failed (above); the timing goes on"
    python3 packages/remote-drafter/benchmarks/exl3_moe_layer.py --out "$OUT/exl3-moe-layer-plan.json"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == moe || $ONLY_DRAFTER_ROUND == kernels ]]; then  # =moe: an EXL3 MoE
    # layer through our own kernels against exllamav3's fused kernels (exl3_moe_layer.py, after
    # our kernels' tests compiled and, with exllamav3, the fused experts' GPU tests; exllamav3's
    # build, ~5 min, comes with it when its wheels are carried, else ours is timed alone);
    # =kernels: that, then the round's A/B below (=ab) without its tests again: one build, near
    # a device call's 10 minutes (cut short, rerun drafter_round.py --experts-ab on the warm machine)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_triton_experts.py \
      packages/remote-drafter/tests/test_exl3_gemv.py packages/remote-drafter/tests/test_exl3_experts_gpu.py \
      2>&1 | tail -5 | tee "$OUT/exl3-moe-pytest.txt" || echo "== tests failed (above); the timing goes on"
    python3 packages/remote-drafter/benchmarks/exl3_moe_layer.py --out "$OUT/exl3-moe-layer.json" \
      --profile "$OUT/exl3-moe-layer-profile.txt"
    [[ $ONLY_DRAFTER_ROUND == moe ]] && exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == *before-after ]]; then
    if [[ ! -f ${BEFORE:-}/packages/remote-drafter/src/remote_drafter/__init__.py ]]; then
      echo "BEFORE=${BEFORE:-} holds no packages/remote-drafter/src: the earlier sources (see below)"; exit 2
    fi
    for so in packages/*/src/*/_*_cffi*.so; do
      [[ -d $BEFORE/$(dirname "$so") ]] && cp "$so" "$BEFORE/$so"
    done
    side_path() {  # the PYTHONPATH of a side: BEFORE's package sources first for "before"
      if [[ $1 == before ]]; then printf '%s:' "$BEFORE"/packages/*/src; fi; printf '%s' "$PYTHONPATH"
    }
  fi
  if [[ $ONLY_DRAFTER_ROUND == moe-before-after ]]; then  # =moe-before-after: a change to our
    # expert kernels: their GPU tests, then one MoE layer on them (exl3_moe_layer.py, tuned as a
    # worker tunes it) by BEFORE's sources (below) and this tree's, each twice, alternated, each in a
    # process of its own (no exllamav3 wanted: GPU_WHEELS=.whl-small, as for =plan)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_triton_experts.py \
      packages/remote-drafter/tests/test_exl3_gemv.py packages/remote-drafter/tests/test_dsv41_kernels.py \
      2>&1 | tail -8 | tee "$OUT/moe-pytest.txt" || echo "== tests failed (above); the timing goes on"
    for pass in 1 2; do
      for side in before after; do
        path=$(side_path "$side")
        PYTHONPATH="$path" python3 packages/remote-drafter/benchmarks/exl3_moe_layer.py \
          --out "$OUT/exl3-moe-layer-$side-$pass.json" 2>&1 | grep '^{' | cut -c1-300 | sed "s/^/$side, pass $pass: /" \
          || echo "== the $side run failed"
      done
    done
    python3 packages/remote-drafter/benchmarks/exl3_moe_layer.py --compare \
      "$OUT/exl3-moe-layer-before-1.json,$OUT/exl3-moe-layer-before-2.json" \
      "$OUT/exl3-moe-layer-after-1.json,$OUT/exl3-moe-layer-after-2.json" \
      --out "$OUT/exl3-moe-layer-before-after.json" || echo "== no comparison (above)"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == bf16-before-after ]]; then  # =bf16-before-after: a change to the
    # round's own kernels or modules (not the EXL3 experts'): their GPU tests, then the bf16 round
    # (drafter_round.py --variants bf16) by this tree's code and BEFORE's (below), each in a
    # process of its own, --compare (no exllamav3 wanted: GPU_WHEELS=.whl-small)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_dsv41_kernels.py \
      2>&1 | tail -3 | tee "$OUT/bf16-pytest.txt" || echo "== tests failed (above); the timing goes on"
    for side in after before; do
      echo "== the bf16 round, $side, at $SECONDS s"
      PYTHONPATH=$(side_path "$side") python3 packages/remote-drafter/benchmarks/drafter_round.py --variants bf16 \
        --out "$OUT/bf16-$side.json" 2>&1 | tee "$OUT/bf16-$side.log" | grep "batch\|==" | head -8 \
        || echo "== the $side run failed (above)"
    done
    python3 packages/remote-drafter/benchmarks/drafter_round.py --compare "$OUT/bf16-before.json" \
      "$OUT/bf16-after.json" --compare-mode bf16 --out "$OUT/bf16-before-after.json" || echo "== no comparison (above)"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == attention ]]; then  # =attention: the window's attention kernel's
    # GPU tests, then every form a round may run (keys split, the weighted sum on the tensor
    # cores) timed in CUDA graphs at the Flash shapes against its defaults (no exllamav3 wanted)
    python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_dsv41_kernels.py \
      2>&1 | tail -3 | tee "$OUT/attention-pytest.txt" || echo "== tests failed (above); the timing goes on"
    python3 packages/remote-drafter/benchmarks/attention_variants.py --out "$OUT/attention-variants.json"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == link-before-after ]]; then  # =link-before-after: the worker's own
    # cost at batch 16 around the stub drafter (no GPU work: this host's Python and system calls
    # alone), by BEFORE's sources (below) and this tree's, and this tree's with every wait of the
    # link spinning first (--spin-us: is it the wake-ups that cost here?), each three times,
    # alternated (worker_cost.py, bf16 rows and requests in service only; compare the own cost:
    # its "receive messages" phase times recv_payload alone, and a small frame's bytes now come
    # with its header's receive)
    for pass in 1 2 3; do
      for side in before after spin; do
        path=$(side_path "$side")
        spin=0; [[ $side == spin ]] && spin=20000
        PYTHONPATH="$path" python3 packages/remote-drafter/benchmarks/worker_cost.py --batches 16 --rounds 60 \
          --row-dtypes bfloat16 --ages in_service --spin-us $spin --out "$OUT/worker-cost-stub-$side-$pass.json" 2>&1 | grep "^bfloat16 rows.*in_service" \
          | sed "s/^/$side, pass $pass: /" || echo "== the $side run failed"
      done
    done
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == before-after ]]; then  # =before-after: a change to the round timed
    # against the code before it in one call. BEFORE: a folder holding the earlier commit's
    # package sources (mkdir -p .before && git archive <commit> packages/remote-drafter/src
    # packages/ofl-transport/src | tar -x -C .before; BEFORE=.before; carry .before): its
    # packages/*/src come first on the path of the run before, the C helpers built here copied
    # in. exllamav3's build first and alone (~5 min: beside other work it took twice as long),
    # then the EXL3 round as served (drafter_round.py --experts-ab --modes auto: the round, and
    # the worker over tcp) by the code after the change and before it, each in a process of its
    # own, --compare; then, while the call's 10 minutes allow, one MoE layer against
    # BlockSparseMLP and the round's GPU tests
    python3 -c "from remote_drafter.models import exl3; exl3.load_exllamav3(print)" 2>&1 | tail -1 \
      || echo "== exllamav3 did not load (above)"
    for side in after before; do
      path=$(side_path "$side")
      echo "== the round as served, $side, at $SECONDS s"
      PYTHONPATH="$path" python3 packages/remote-drafter/benchmarks/drafter_round.py --experts-ab \
        --modes auto --out "$OUT/served-$side.json" 2>&1 | tee "$OUT/served-$side.log" | grep -v "^  batch" \
        || echo "== the $side run failed (above)"
    done
    python3 packages/remote-drafter/benchmarks/drafter_round.py --compare "$OUT/served-before.json" \
      "$OUT/served-after.json" --out "$OUT/served-before-after.json" || echo "== no comparison (above)"
    if (( SECONDS < 450 )); then
      python3 packages/remote-drafter/benchmarks/drafter_round.py --moe-layers \
        --out "$OUT/moe-layer-vs-blocksparse.json" 2>&1 | tail -8 || echo "== the MoE layers failed (above)"
    fi
    if (( SECONDS < 530 )); then
      timeout $((570 - SECONDS)) python3 -m pytest -q -p no:cacheprovider \
        packages/remote-drafter/tests/test_exl3_triton_experts.py packages/remote-drafter/tests/test_dsv41_kernels.py \
        > "$OUT/round-gpu-pytest.txt" 2>&1 || echo "== tests failed or ran out of time (below)"
      tail -4 "$OUT/round-gpu-pytest.txt"
    fi
    echo "== done at $SECONDS s"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == ab || $ONLY_DRAFTER_ROUND == kernels ]]; then  # =ab: the fused
    # experts' GPU tests (exllamav3's build, ~5 min, comes with them), then the EXL3 round as
    # served, exllamav3's fused experts against the kernels chosen at start-up
    # (drafter_round.py --experts-ab): one build for both
    if [[ $ONLY_DRAFTER_ROUND == ab ]]; then
      python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_exl3_experts_gpu.py \
        2>&1 | tail -5 | tee "$OUT/exl3-experts-pytest.txt" || echo "== tests failed (above); the timing goes on"
    fi
    python3 packages/remote-drafter/benchmarks/drafter_round.py --experts-ab \
      --out "$OUT/drafter-round-experts-ab.json" 2>&1 | tee "$OUT/drafter-round-experts-ab.log"
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == upstream ]]; then  # =upstream: one MoE layer alone, ours against
    # exllamav3's own BlockSparseMLP, in a CUDA graph and eager (drafter_round.py --moe-layers;
    # exllamav3's build, ~5 min, comes with it)
    python3 packages/remote-drafter/benchmarks/drafter_round.py --moe-layers \
      --out "$OUT/moe-layer-vs-blocksparse.json" 2>&1 | tee "$OUT/moe-layer-vs-blocksparse.log" | tail -8
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND == profile ]]; then  # =profile: where a round's device time goes, by
    # kernel; PROFILE_VARIANT=bf16 profiles the bf16 round (no exllamav3 needed)
    python3 packages/remote-drafter/benchmarks/drafter_round.py --batches 1,16 \
      --variants "${PROFILE_VARIANT:-exl3_4}" --profile "$OUT/drafter-round-profile.txt" 2>&1 | tail -60
    exit
  fi
  if [[ $ONLY_DRAFTER_ROUND != bench ]]; then
    python3 -m pytest -q -p no:cacheprovider -s packages/remote-drafter/tests/test_exl3_experts_gpu.py \
      packages/remote-drafter/tests/test_dsv41_kernels.py \
      2>&1 | tail -30 | tee "$OUT/exl3-experts-pytest.txt"
  fi
  if [[ $ONLY_DRAFTER_ROUND != tests ]]; then
    python3 packages/remote-drafter/benchmarks/drafter_round.py --out "$OUT/drafter-round.json" \
      2>&1 | tee "$OUT/drafter-round.log"
  fi
  exit
fi
if [[ -n ${ONLY_EXL3_DRAFTER:-}${ONLY_EXL3:-} ]]; then  # exllamav3 (its wheel and missing deps
  # carried in .whl; its CUDA extension builds on first import, ~5 min, and again if its sources
  # are reinstalled: run both below in one call of this script)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
  if [[ -n ${ONLY_EXL3_DRAFTER:-} ]]; then  # ONLY_EXL3_DRAFTER=1: EXL3 drafting (exl3_gpu.py;
    # carry .exl3taps from `exl3_gpu.py --prepare .exl3taps`)
    REMOTE_DRAFTER_CUDA_GRAPHS=0 python3 packages/remote-drafter/benchmarks/exl3_gpu.py \
      --gpu .exl3taps --out "$OUT" --steps ${EXL3_STEPS:-smollm2,tiny_dsv41,worker} 2>&1 | tee "$OUT/exl3-gpu.log"
  fi
  if [[ -n ${ONLY_EXL3:-} ]]; then  # ONLY_EXL3=1: DeepSeek-V4's drafter against exllamav3's own
    python3 packages/remote-drafter/benchmarks/dsv4_exl3_check.py --out "$OUT/dsv4-exl3.json" \
      --budget-s "${EXL3_BUDGET_S:-$((570 - SECONDS))}" --skip "${EXL3_SKIP:-}" \
      2>&1 | tee -a "$OUT/exl3-gpu.log"
  fi
  exit
fi
echo "== benchmark, CUDA float32 then bfloat16 drafter weights"
python3 -m remote_drafter.bench --device cuda --width smollm2 --verify-ms 60 --tokens 96 --json \
  --out "$OUT/bench-cuda-f32.json" > /dev/null
python3 -m remote_drafter.bench --device cuda --width smollm2 --dtype bfloat16 --skip spec_cache \
  --out "$OUT/bench-cuda-bf16.json" | tee "$OUT/bench-cuda-bf16.txt"
python3 -c "import json,sys; sys.path.insert(0,'packages/remote-drafter/src'); from remote_drafter.bench import print_table; print_table(json.load(open('$OUT/bench-cuda-f32.json')))"
echo "== CPU/GPU agreement, device timing, decoding on the GPU"
python3 packages/remote-drafter/benchmarks/gpu_check.py --out "$OUT/gpu-check.json"
echo "== DeepSeek-V4.1's drafter: tiny checkpoint CPU vs CUDA, estimated Flash width in bf16"
python3 packages/remote-drafter/benchmarks/dsv41_gpu.py --out "$OUT/dsv41-gpu.json"
