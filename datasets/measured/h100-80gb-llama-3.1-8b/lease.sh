#!/usr/bin/env bash
# One GPU lease of this workplace's device tool: the lean profile, then its validation (README.md, "Next GPU lease").
# A call carries at most 64 MiB and the machine goes back after 30 s idle, so: stage vLLM with
# carry_vllm.sh, move the large tracked files out of the tree, carry the three parts in three calls
# back to back, then start the job in its own session and poll it with calls of up to 10 minutes.
#
#   bash lease.sh stash | unstash   here: move tracked files over 300 kB to /tmp/lease-stash and back
#   bash lease.sh copy DIR          there: copy DIR/part.* (the carried parts) to /tmp/parts
#   bash lease.sh start DIR         there: copy, join and check the parts (DIR/site.sha), unpack vLLM to
#                                   /tmp/site, start `job` in its own session
#   bash lease.sh job               there (started by `start`): a lean profile, then its validation, under
#                                   /tmp/gpuwork, both stopping (exit 5) before a step past the deadline
#   bash lease.sh wait SECONDS      there: wait for the job (or SECONDS), print its progress and the
#                                   engines' key log lines, pack /tmp/gpuwork (no adapters) into $OUT
#
# job settings: BUDGET_S (default 600) seconds from the job's start to its deadline; RESUME (default 1) starts
# from this folder's lean/profile and lean/validation, what the last lease finished (0: fresh work dirs, with
# raw/kv-nolora.json, the same engine without LoRA, taken in: one start fewer); CASES (default 10) validation
# workloads on ENGINES (default 2) engines; then KV_CASES (default 4; 0: none) workloads limited by KV memory on
# one engine with a KV_BYTES (default 2 GiB) KV cache; CALIBRATION (default 0) calibration cases of `planner
# profile`. After a lease, copy the archive's profile/, validation/ and validation-kv/ over lean/ so the next
# one resumes from them.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
W=/tmp/gpuwork
case "${1:-}" in
stash | unstash)
  cd "$repo"
  list=/tmp/lease-stash.txt
  if [ "$1" = stash ]; then
    [ -e $list ] && { echo "already stashed ($list): unstash first"; exit 1; }
    git ls-files -z | xargs -0 du -b | awk -F '\t' '$1 > 300000 {print $2}' > $list
    while read -r f; do mkdir -p "/tmp/lease-stash/$(dirname "$f")" && mv "$f" "/tmp/lease-stash/$f"; done < $list
  else
    failed=0
    while read -r f; do mv "/tmp/lease-stash/$f" "$f" || failed=1; done < $list
    [ $failed = 0 ] && rm $list
  fi
  git status --short | head; { git ls-files -z | xargs -0 du -bc 2>/dev/null || true; } | tail -n 1 ;;
copy)
  mkdir -p /tmp/parts && cp "$2"/part.* /tmp/parts/ && ls -la /tmp/parts ;;
start)
  sha=$(realpath "$2")/site.sha
  bash "$0" copy "$2" || exit 1
  (cd /tmp/parts && cat part.* > site.tar.xz && sha256sum -c "$sha") || exit 1
  xz -T0 -dc /tmp/parts/site.tar.xz | tar -x -C /tmp && du -sh /tmp/site && mkdir -p $W
  setsid nohup bash "$0" job > $W/job.log 2>&1 < /dev/null &
  sleep 2; echo started ;;
job)
  cd "$repo"
  export PYTHONPATH=/tmp/site:$repo PYTHONUNBUFFERED=1
  deadline=$(( $(date +%s) + ${BUDGET_S:-600} ))
  mkdir -p $W/profile/raw
  if [ ! -e $W/profile/spec.json ]; then
    if [ "${RESUME:-1}" = 1 ] && [ -d "$here"/lean/profile ]; then cp -r "$here"/lean/profile "$here"/lean/validation* $W/
    else cp "$here"/raw/kv-nolora.json $W/profile/raw/; fi
  fi
  date; nvidia-smi -L
  [ -f /tmp/l8/model/config.json ] || python3 -m planner.cli synth --out /tmp/l8 --shape llama-3.1-8b --config-only \
    --adapters-per-rank 0
  python3 -m planner.cli profile --engine cuda --gpu 0 --model /tmp/l8/model --load-format dummy --lean \
    --gpu-memory-utilization 0.9 --ranks 16,32 --a-max-points 8,32,64,128,192,256 --max-num-batched-tokens 2048 \
    --max-num-seqs 512 --max-model-len 8192 --calibration-cases "${CALIBRATION:-0}" --deadline $deadline \
    --id h100-80gb-llama-3.1-8b --out $W/h100-80gb-llama-3.1-8b.json --work-dir $W/profile
  rc=$?; echo "PROFILE_RC=$rc"; date
  if [ $rc = 0 ]; then
    python3 -m planner.cli validate --profile $W/h100-80gb-llama-3.1-8b.json --cases "${CASES:-10}" \
      --engines "${ENGINES:-2}" --deadline $deadline --work-dir $W/validation --out-dir $W/validation-out
    rc=$?
    if [ $rc = 0 ] && [ "${KV_CASES:-4}" -gt 0 ]; then  # then workloads limited by KV memory, on one engine
      # the same synthetic adapters (names and seeds): about a minute of writing them spared
      [ -e $W/validation-kv/adapters ] || { mkdir -p $W/validation-kv $W/validation/adapters && ln -s $W/validation/adapters $W/validation-kv/adapters; }
      python3 -m planner.cli validate --profile $W/h100-80gb-llama-3.1-8b.json --cases "${KV_CASES:-4}" \
        --engines 1 --seed 2025 --kv-cache-memory-bytes "${KV_BYTES:-2147483648}" --deadline $deadline \
        --work-dir $W/validation-kv --out-dir $W/validation-kv-out
      rc=$?
    fi
    echo "VALIDATE_RC=$rc"
  else
    echo "VALIDATE_RC=not run (the profile is not finished: exit 5 means rerun in the next lease)"
  fi
  date ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && ! grep -q VALIDATE_RC $W/job.log 2>/dev/null; do sleep 5; done
  tr '\r' '\n' < $W/job.log | grep -v '^\s*$' | tail -n 40
  ls -la $W/profile/raw $W/validation/cases $W/validation-kv/cases 2>/dev/null
  for f in $W/profile/logs/*.log $W/validation*/logs/*.log; do
    [ -f "$f" ] && echo "== $f" && grep -E "KV cache size|Model loading took|init engine|Graph capturing finished|ERROR|Error" "$f" | tail -n 6
  done
  tar -C $W --exclude=adapters -cJf "$OUT/gpuwork.tar.xz" . && ls -la "$OUT" ;;
*)
  sed -n 2,17p "$0"; exit 2 ;;
esac
