#!/usr/bin/env bash
# One device call that re-checks, on the GPU, what a session could change only on the CPU (the batch-invariant
# kernels, the engine's compiled decode), in stages that each stop at their own time limit and write
# $OUT/<stage>.out as they go, so a cut call keeps what ran. Run from the repo root with .whl/ carried:
#   bash benchmarks/gpu_recheck.sh [STAGE ...]     # default: tests sampler decode true_on_policy
# .whl/ (ignored by git) holds what the device's image lacks, for its Python 3.12; build it here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     math-verify latex2sympy2-extended antlr4-python3-runtime==4.13.2 bm25s fastapi starlette pydantic \
#     pydantic-core typing-inspection annotated-types uvicorn
# (the versions of this venv's: `pip list`; pydantic and pydantic-core must be a matching pair).
# A call runs up to 10 minutes: run `tests sampler decode` in one, `true_on_policy tiles attention` in the next.
# Stages:
#   tests           tests/test_invariant.py and the GPU tests of the fast engine and true on-policy (~1.5 min warm,
#                   over 2.5 on a machine just started: Triton compiles; TESTS_LIMIT (s, default 240) changes it)
#   sampler         benchmarks/sampler_compiled.py: eager, compiled and batch-invariant draws, 128 x 151,936
#   decode          benchmarks/engine_decode.py, batch 128 and 512, compiled: as it is and with the decode step's
#                   pointwise work unfused (the engine before the eleventh session); against HF generate (~5 min;
#                   DECODE_ROWS, DECODE_BATCH and DECODE_LIMIT (s, default 400) change them)
#   true_on_policy  benchmarks/determinism_parts.py off, true_on_policy (the default check: stop on a GPU),
#                   true_on_policy_rescore (the engine's scoring pass) (~40 s a configuration at 4 steps, ~5 min
#                   for 2 rounds; TOP_CONFIGS, TOP_STEPS, TOP_REPEATS and
#                   TOP_LIMIT (s, default 300) change them; TOP_PROFILE=1 profiles the first round's step 3, left out
#                   of its mean)
#   profile         the compiled engine's decode at batch 512 under torch's profiler (its top kernels; ~3 min)
#   h200            the decode stage at batch 128 and 512 (fast-compiled only) where the card is an H200, else
#                   nothing: issue 13's open figure, for the front of any call that may be given either card (~1 min)
#   tiles           benchmarks/invariant_tiles.py (~1 min)
#   ab              benchmarks/ab_decode.sh: the engine's decode, the build before a change (this tree with .ab/'s files
#                   over it; carry .ab) against this tree, alternated (AB_ROUNDS x 2 engine_decode.py runs, ~45 s each
#                   warm at batch 512; AB_LIMIT (s, default 400) stops it)
#   attention       benchmarks/decode_attention.py: the decode attention's Triton kernel against SDPA, and at other
#                   launch settings (ATTENTION_LAUNCH, BLOCK:WARPS:STAGES[:REGS] ...), with the bandwidth it reads
#                   at; the engine's rope_and_attend against rope_and_cache + the kernel at each (~1 min)
set -uo pipefail
start=$SECONDS
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests sampler decode true_on_policy)

stage() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name ($((SECONDS - start)) s in)"
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v "Writing model shards" | tee "$out/$name.out" | tail -25
  echo "== $name rc=${PIPESTATUS[0]}"
}

decode() {  # NAME BATCHES ROWS: benchmarks/engine_decode.py, three timed runs a row
  stage "$1" "${DECODE_LIMIT:-400}" python3 benchmarks/engine_decode.py --batch $2 --repeats 3 --rows "$3"
}

for s in "${stages[@]}"; do
  case $s in
    tests) stage tests "${TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_invariant.py tests/test_gpu.py \
             tests/test_advance.py \
             tests/test_engine.py -k "invariant or cuda_graph or fast_path or fast_bf16 or bf16_run or true_on or \
             under_the_mode or decode_attention_kernel or rope_and_attend or fused or torch_ops_leave" ;;
    sampler) stage sampler 60 python3 benchmarks/sampler_compiled.py --batch 128 --draws 5 ;;
    decode) decode decode "${DECODE_BATCH:-128 512}" "${DECODE_ROWS:-fast-compiled,fast-compiled-unfused,hf-generate}" ;;
    true_on_policy) stage true_on_policy "${TOP_LIMIT:-300}" python3 benchmarks/determinism_parts.py \
                      --qwen-shape /tmp/q \
                      --steps "${TOP_STEPS:-4}" --repeats "${TOP_REPEATS:-1}" \
                      --configs "${TOP_CONFIGS:-off,true_on_policy,true_on_policy_rescore}" --rollout-batch-size 8 \
                      --n-samples-per-prompt 8 --rollout-max-response-len 256 --micro-batch-size 8 \
                      ${TOP_PROFILE:+--profile "$out/profiles"} ;;
    profile) stage profile 240 python3 benchmarks/engine_decode.py --batch 512 --repeats 1 --rows fast-compiled \
               --profile 512 --profile-compiled ;;
    h200) card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
          case $card in
            *H200*) decode h200 "128 512" fast-compiled ;;
            *) echo "== h200: skipped, the card is $card" ;;
          esac ;;
    tiles) stage tiles 90 python3 benchmarks/invariant_tiles.py --repeats 5 --calls 20 ;;
    attention) stage attention 90 python3 benchmarks/decode_attention.py --batch 32 128 512 \
                 --launch ${ATTENTION_LAUNCH:-128:4:- 64:8:- 64:4:2 64:4:4 32:4:-} ;;
    ab) stage ab "${AB_LIMIT:-400}" bash benchmarks/ab_decode.sh ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "$((SECONDS - start)) s in all"
