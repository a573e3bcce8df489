#!/usr/bin/env bash
# The engine's decode, the build before a change against this tree, alternated round by round on one machine (the
# way BENCHMARKS.md's A/B figures are made: compare only runs of one machine). Run from the repo root:
#   mkdir -p .ab/miles/utils && git show REV:miles/utils/invariant.py > .ab/miles/utils/invariant.py   # each file
#   bash benchmarks/ab_decode.sh          # or `bash benchmarks/gpu_recheck.sh ab` in a device call, carrying .ab
# .ab/ (ignored by git: add `/.ab/` to .git/info/exclude) holds the changed files as they were before, at their
# paths; the build before is this tree with them copied over, in /tmp/before. AB_ROUNDS (default 2), AB_BATCH
# (default 512), AB_ROWS (default fast-compiled) and AB_ARGS (more engine_decode.py arguments, e.g.
# "--device cpu --shape smol --new-tokens 16") change it.
set -uo pipefail
[ -d .ab ] || { echo "error: no .ab/ folder: put the files of the build before there, at their paths" >&2; exit 2; }
here=$PWD before=/tmp/before
rm -rf "$before" && mkdir -p "$before" && cp -r miles benchmarks "$before"/ && cp -r .ab/. "$before"/ || exit 1
echo "before = this tree with: $(cd .ab && find . -type f | sed 's|^\./||' | tr '\n' ' ')"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for build in before this; do
    root=$here
    [ "$build" = before ] && root=$before
    echo "round $round, $build"
    (cd "$root" && PYTHONPATH="/tmp/site:$root" python3 benchmarks/engine_decode.py --batch ${AB_BATCH:-512} \
       --repeats 3 --rows "${AB_ROWS:-fast-compiled}" ${AB_ARGS:-}) 2>&1 | grep -E "^batch|bandwidth|rror"
  done
done
