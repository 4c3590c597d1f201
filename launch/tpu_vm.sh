#!/usr/bin/env bash
# Train longctx on a Cloud TPU VM slice (one or many hosts): create or reuse the slice, copy this
# checkout to every worker and pip-install it, run the same training command on all workers at
# once, and collect one log per worker.
#
#   launch/tpu_vm.sh --name my-pod --zone us-east5-a --workdir gs://my-bucket/runs/8b-128k \
#       [--project my-project] [--accelerator-type v5p-128] [--runtime-version v2-alpha-tpuv5] \
#       [--config configs/base.py:llama3_8b_128k] [--spot] [--detach] [--dry-run] \
#       [-- --config.train.num_steps=1000 ...more train.py flags]
#
#   --dry-run   print every command (gcloud, tar, the worker script) instead of running it;
#               needs neither gcloud nor a project.
#   --detach    start training in the background on the workers (survives a dropped ssh);
#               fetch logs later with the printed `gcloud storage cp` command.
#   --spot      create the slice as Spot capacity (preemptible; training checkpoints on SIGTERM).
#
# The workdir must be a gs:// path that every worker can write (checkpoints, metrics, logs).
# Each worker reads its process id and the coordinator (worker 0) from the TPU metadata server and
# passes them to longctx as LONGCTX_COORDINATOR / LONGCTX_NUM_PROCESSES / LONGCTX_PROCESS_ID.
set -euo pipefail

PROG="launch/tpu_vm.sh"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NAME=""
ZONE=""
PROJECT=""
ACCELERATOR_TYPE="v5p-128"
RUNTIME_VERSION="v2-alpha-tpuv5"
CONFIG="configs/base.py:llama3_8b_128k"
WORKDIR=""
SPOT=0
DETACH=0
DRY_RUN=0
COORDINATOR_PORT=8476
TRAIN_ARGS=()

die() { echo "$PROG: $*" >&2; exit 2; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

while (($#)); do
  case "$1" in
    --name|--zone|--project|--accelerator-type|--runtime-version|--config|--workdir)
      (($# >= 2)) && [[ "$2" != --* ]] || die "$1 needs a value."
      case "$1" in
        --name) NAME="$2" ;;
        --zone) ZONE="$2" ;;
        --project) PROJECT="$2" ;;
        --accelerator-type) ACCELERATOR_TYPE="$2" ;;
        --runtime-version) RUNTIME_VERSION="$2" ;;
        --config) CONFIG="$2" ;;
        --workdir) WORKDIR="$2" ;;
      esac
      shift 2 ;;
    --name=*) NAME="${1#*=}"; shift ;;
    --zone=*) ZONE="${1#*=}"; shift ;;
    --project=*) PROJECT="${1#*=}"; shift ;;
    --accelerator-type=*) ACCELERATOR_TYPE="${1#*=}"; shift ;;
    --runtime-version=*) RUNTIME_VERSION="${1#*=}"; shift ;;
    --config=*) CONFIG="${1#*=}"; shift ;;
    --workdir=*) WORKDIR="${1#*=}"; shift ;;
    --spot) SPOT=1; shift ;;
    --detach) DETACH=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) die "unknown option $1 (see --help)." ;;
  esac
done

[[ -n "$NAME" ]] || die "--name is required (the TPU VM to create or reuse)."
[[ -n "$ZONE" ]] || die "--zone is required (e.g. us-east5-a)."
[[ -n "$WORKDIR" ]] || die "--workdir is required (a gs:// path every worker can write)."
[[ "$WORKDIR" == gs://?* ]] || die "--workdir $WORKDIR must be a gs:// path: every worker writes checkpoints there."
BUCKET="${WORKDIR#gs://}"
BUCKET="${BUCKET%%/*}"
# Cloud Storage's naming rule (no upper case); the rest of the path is quoted nowhere, so it is kept plain.
[[ "$BUCKET" =~ ^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$ ]] ||
  die "--workdir $WORKDIR: the bucket name $BUCKET must be lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit (Cloud Storage's rule), e.g. gs://my-bucket/runs/x."
[[ "${WORKDIR#gs://"$BUCKET"}" =~ ^(/[-A-Za-z0-9._/=+@]*)?$ ]] ||
  die "--workdir $WORKDIR: the path after gs://$BUCKET may hold only letters, digits and -._/=+@."
[[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name $NAME must be lowercase letters, digits and hyphens."
[[ "$ACCELERATOR_TYPE" =~ ^v[0-9]+[a-z]*-[0-9]+$ ]] ||
  die "--accelerator-type $ACCELERATOR_TYPE is not a TPU accelerator type like v5p-128 or v6e-64."
WORKDIR="${WORKDIR%/}"

GCLOUD_COMMON=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && GCLOUD_COMMON+=(--project "$PROJECT")
TARBALL="${TMPDIR:-/tmp}/longctx-${NAME}.tar.gz"
RUN_SCRIPT="${TMPDIR:-/tmp}/longctx-${NAME}-run.sh"
LOCAL_LOGS="${REPO}/runs/tpu_vm/${NAME}/logs"

# One shell word, quoted only when it needs to be (single quotes, readable in --dry-run output).
shq() {
  if [[ "$1" =~ ^[-A-Za-z0-9_./:=@%+,]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

shline() {
  local out="" word
  for word in "$@"; do out+="${out:+ }$(shq "$word")"; done
  printf '%s\n' "$out"
}

# Prints a command as a copy-pasteable shell line, or runs it.
run() {
  if ((DRY_RUN)); then
    shline "$@"
  else
    "$@"
  fi
}

note() { if ((DRY_RUN)); then echo "# $*"; else echo "[$PROG] $*" >&2; fi; }

# ----------------------------------------------------------------------------- the worker script

TRAIN_CMD=(python3 scripts/train.py "--config=$CONFIG" "--workdir=$WORKDIR" "${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}")
TRAIN_LINE="$(shline "${TRAIN_CMD[@]}")"

worker_script() {
  cat <<EOF
#!/usr/bin/env bash
# Runs on every worker of TPU VM ${NAME} (written by ${PROG}).
set -euo pipefail
md() { curl -sf -H 'Metadata-Flavor: Google' "http://metadata.google.internal/computeMetadata/v1/instance/attributes/\$1"; }
WORKER="\$(md agent-worker-number)"
ENDPOINTS="\$(md worker-network-endpoints)"   # worker 0 first; "name:id:ip" or "host" entries
FIRST="\${ENDPOINTS%%,*}"
export LONGCTX_COORDINATOR="\${FIRST##*:}:${COORDINATOR_PORT}"
export LONGCTX_NUM_PROCESSES="\$(tr ',' '\n' <<<"\$ENDPOINTS" | grep -c .)"
export LONGCTX_PROCESS_ID="\$WORKER"
export PYTHONUNBUFFERED=1
cd "\$HOME/longctx"
mkdir -p logs
LOG="logs/worker-\$WORKER.log"
echo "worker \$WORKER of \$LONGCTX_NUM_PROCESSES, coordinator \$LONGCTX_COORDINATOR" | tee "\$LOG"
set +e
${TRAIN_LINE} 2>&1 | tee -a "\$LOG"
STATUS=\${PIPESTATUS[0]}
set -e
gcloud storage cp "\$LOG" "${WORKDIR}/logs/worker-\$WORKER.log" || echo "could not copy \$LOG to ${WORKDIR}/logs/" >&2
exit "\$STATUS"
EOF
}

# ----------------------------------------------------------------------------- 1. the slice

note "1. Create TPU VM ${NAME} (${ACCELERATOR_TYPE}) unless it exists; an existing one is reused."
CREATE=(gcloud compute tpus tpu-vm create "$NAME" "${GCLOUD_COMMON[@]}" --accelerator-type "$ACCELERATOR_TYPE"
        --version "$RUNTIME_VERSION")
((SPOT)) && CREATE+=(--spot)
DESCRIBE=(gcloud compute tpus tpu-vm describe "$NAME" "${GCLOUD_COMMON[@]}" --format 'value(state)')
if ((DRY_RUN)); then
  echo "# if this prints a state, reuse the slice (start it if STOPPED; delete and recreate it if PREEMPTED),"
  echo "# otherwise create it:"
  run "${DESCRIBE[@]}"
  run "${CREATE[@]}"
else
  command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk/docs/install)."
  if STATE="$("${DESCRIBE[@]}" 2>/dev/null)" && [[ -n "$STATE" ]]; then
    case "$STATE" in
      PREEMPTED|TERMINATED)
        note "TPU VM ${NAME} was ${STATE}; deleting and recreating it (the workdir keeps the checkpoints)."
        run gcloud compute tpus tpu-vm delete "$NAME" "${GCLOUD_COMMON[@]}" --quiet
        run "${CREATE[@]}" ;;
      STOPPED)
        note "starting stopped TPU VM ${NAME}."
        run gcloud compute tpus tpu-vm start "$NAME" "${GCLOUD_COMMON[@]}" ;;
      *)
        note "reusing TPU VM ${NAME} (state ${STATE})." ;;
    esac
  else
    run "${CREATE[@]}"
  fi
fi

# ----------------------------------------------------------------------------- 2. code + install

note "2. Copy this checkout (tracked and untracked, non-ignored files) to every worker and install it."
PACK="git -C $(shq "$REPO") ls-files -z --cached --others --exclude-standard | tar -C $(shq "$REPO") --null --ignore-failed-read -T - -czf $(shq "$TARBALL")"
if ((DRY_RUN)); then
  echo "$PACK"
else
  bash -o pipefail -c "$PACK"
fi
run gcloud compute tpus tpu-vm scp "$TARBALL" "${NAME}:longctx.tar.gz" "${GCLOUD_COMMON[@]}" --worker=all
INSTALL='set -e; rm -rf "$HOME/longctx" && mkdir -p "$HOME/longctx" && tar -xzf "$HOME/longctx.tar.gz" -C "$HOME/longctx" && python3 -m pip install --quiet --upgrade pip && python3 -m pip install --quiet -e "$HOME/longctx[tpu,gcs]"'
run gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_COMMON[@]}" --worker=all --command "$INSTALL"

# ----------------------------------------------------------------------------- 3. train

note "3. Run the same training command on all workers; each writes logs/worker-<i>.log and copies it to ${WORKDIR}/logs/."
if ((DRY_RUN)); then
  echo "cat > $(shq "$RUN_SCRIPT") <<'WORKER_SCRIPT'"
  worker_script
  echo "WORKER_SCRIPT"
else
  worker_script >"$RUN_SCRIPT"
fi
run gcloud compute tpus tpu-vm scp "$RUN_SCRIPT" "${NAME}:longctx_run.sh" "${GCLOUD_COMMON[@]}" --worker=all
if ((DETACH)); then
  run gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_COMMON[@]}" --worker=all \
    --command 'nohup bash "$HOME/longctx_run.sh" >"$HOME/longctx_run.out" 2>&1 </dev/null & echo started'
  note "training runs in the background; follow worker 0 with:"
  note "  gcloud compute tpus tpu-vm ssh ${NAME} ${GCLOUD_COMMON[*]} --worker=0 --command 'tail -f \$HOME/longctx/logs/worker-0.log'"
  note "and collect all logs afterwards with:"
  note "  mkdir -p ${LOCAL_LOGS} && gcloud storage cp '${WORKDIR}/logs/*' ${LOCAL_LOGS}/"
  exit 0
fi
STATUS=0
run gcloud compute tpus tpu-vm ssh "$NAME" "${GCLOUD_COMMON[@]}" --worker=all --command 'bash "$HOME/longctx_run.sh"' || STATUS=$?

# ----------------------------------------------------------------------------- 4. logs

note "4. Collect the per-worker logs into ${LOCAL_LOGS}/."
run mkdir -p "$LOCAL_LOGS"
run gcloud storage cp "${WORKDIR}/logs/*" "$LOCAL_LOGS/" || note "could not collect logs from ${WORKDIR}/logs/."
if ((STATUS)); then
  note "training failed on at least one worker (status ${STATUS}); see ${LOCAL_LOGS}/."
fi
exit "$STATUS"
