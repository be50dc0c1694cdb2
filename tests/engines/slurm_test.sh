#!/usr/bin/env bash
# examples/cluster/hddp.sbatch on a real Slurm. Starts munged, slurmctld and slurmd on this
# host in a private temporary folder (one node with this host's CPUs, loopback, free
# ports, no cgroups, no accounting), then submits the sbatch file twice with 2 CPU ranks:
#   1. a plain job: it completes with exit code 0, and both ranks trained;
#   2. a job sent USR1 as Slurm does before the time limit (--signal=B:USR1@120): its trap
#      requeues it, and the next run (SLURM_RESTART_COUNT=1) resumes from the last
#      --save-every commit and completes the steps.
# The test stops every daemon and job it started and removes the folder, also when it
# fails or is interrupted. Missing Slurm/MUNGE packages are installed with apt-get. It
# runs as root (slurmd starts jobs as their user). Exit status: 0 passed, 1 failed,
# 77 skipped (Slurm cannot be installed or started here; the message says why).
#
# Usage: slurm_test.sh TRAIN_RESNET [SBATCH_FILE]
set -euo pipefail

readonly SKIP=77
# Every wait is bounded, and all of them together by this budget, well inside ctest's
# TIMEOUT (600 s), so the cleanup below always runs.
readonly deadline=$((SECONDS + ${HDDP_SLURM_TEST_BUDGET:-540}))
train=${1:?usage: slurm_test.sh TRAIN_RESNET [SBATCH_FILE]}
sbatch_file=${2:-$(cd "$(dirname "$0")/../.." && pwd)/examples/cluster/hddp.sbatch}
train=$(cd "$(dirname "$train")" && pwd)/$(basename "$train")
export PATH=$PATH:/usr/sbin:/sbin
# Slurm's clients read SLURM_*, SBATCH_*, SQUEUE_* ... (an outer Slurm job's, say): only
# this test's own cluster counts.
for v in $(compgen -e); do
  case "$v" in
    SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | SQUEUE_* | SINFO_* | SCONTROL_*) unset "$v" ;;
  esac
done

log() { echo "slurm_test: $*"; }
within() {  # within SECONDS: that many, or what is left of the budget if less (>= 1)
  local left=$((deadline - SECONDS))
  [ "$left" -ge 1 ] || left=1
  echo $(($1 < left ? $1 : left))
}
skip() { log "SKIP: $*"; exit "$SKIP"; }
fail() {
  log "FAIL: $*"
  show_logs
  exit 1
}

[ -x "$train" ] || fail "$train is not an executable program"
[ -f "$sbatch_file" ] || fail "$sbatch_file does not exist"

# slurmd starts each job as its user, which needs root.
[ "$(id -u)" = 0 ] || skip "slurmd must run as root to start jobs, and this test runs as $(id -un)"

# --- Slurm and MUNGE, installed with apt when missing (as scripts/setup.sh does) --------
readonly PACKAGES=(slurmctld slurmd slurm-client munge)
need_install=0
for cmd in munged munge unmunge slurmctld slurmd sbatch scontrol sinfo squeue scancel; do
  command -v "$cmd" >/dev/null || need_install=1
done
if [ "$need_install" = 1 ]; then
  command -v apt-get >/dev/null || skip "Slurm/MUNGE are not installed and there is no apt-get"
  log "installing ${PACKAGES[*]} with apt-get"
  if ! { timeout "$(within 120)" env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
    timeout "$(within 240)" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends "${PACKAGES[@]}"; } >/dev/null 2>&1; then
    skip "apt-get install ${PACKAGES[*]} failed (no network or no package source?)"
  fi
  for cmd in munged slurmctld slurmd sbatch; do
    command -v "$cmd" >/dev/null ||
      skip "$cmd is still missing after apt-get install ${PACKAGES[*]}"
  done
fi

# --- the private cluster ----------------------------------------------------------------
# munged wants every folder above its socket searchable by all, hence 755.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/hddp-slurm.XXXXXX")
chmod 755 "$tmp"
export SLURM_CONF=$tmp/slurm.conf
started_pids=()

show_logs() {
  local f
  [ -n "${tmp:-}" ] || return 0
  for f in "$tmp"/slurmctld.log "$tmp"/slurmd.log "$tmp"/munged.log "$tmp"/submit/hddp-*.out; do
    [ -s "$f" ] || continue
    echo "----- last lines of $(basename "$f")"
    tail -n 40 "$f"
  done
}

# The processes Slurm started for our jobs (slurmstepd and the ranks) carry our SLURM_CONF
# in their environment; they are ended by id if scancel left any.
our_job_processes() {
  local p cmd
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] && continue
    cmd=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
    case "$cmd" in slurmstepd* | srun\ * | "$train"*) ;; *) continue ;; esac
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF" && echo "$p"
  done
  return 0
}

stop_pid() {  # stop_pid PID: TERM, up to 10 s, then KILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local status=$? i pid
  set +e
  trap - EXIT INT TERM
  if [ -f "$tmp/slurmctld.started" ]; then
    timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null
    for i in $(seq 1 30); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  # Daemons in reverse order of start: slurmd, slurmctld, munged.
  for ((i = ${#started_pids[@]} - 1; i >= 0; i--)); do
    stop_pid "${started_pids[i]}"
  done
  for pid in $(our_job_processes); do
    log "ending leftover job process $pid"
    kill -KILL "$pid" 2>/dev/null
  done
  rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_free() { ! ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
free_port() {  # a free TCP port in 40000..59999
  local p i
  for i in $(seq 1 100); do
    p=$((40000 + RANDOM % 20000))
    port_free "$p" && { echo "$p"; return 0; }
  done
  fail "found no free TCP port"
}
ctld_port=$(free_port)
slurmd_port=$(free_port)
while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
# hddp's store listens on 20000 + SLURM_JOB_ID % 10000 (docs/launching.md): the job ids
# start where that port and the next two are free (the test submits two jobs).
first_job=0
for i in $(seq 1 100); do
  j=$((1 + RANDOM % 9990))
  if port_free $((20000 + j)) && port_free $((20001 + j)) && port_free $((20002 + j)); then
    first_job=$j
    break
  fi
done
[ "$first_job" != 0 ] || fail "found no free store ports in 20001..29999"

cpus=$(nproc)
[ "$cpus" -ge 2 ] || cpus=2  # two tasks; config_overrides lets a 1-CPU host run them
mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
host=$(hostname -s)

# --- MUNGE: its own key and socket ------------------------------------------------------
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$tmp/munge.key" >/dev/null 2>&1 ||
    skip "mungekey could not create a key in $tmp"
else
  dd if=/dev/urandom of="$tmp/munge.key" bs=1024 count=1 status=none
fi
chmod 600 "$tmp/munge.key"
# --force: a warning, not a refusal, where munged finds a folder above it too open.
munged -F --force --socket="$tmp/munge.socket" --key-file="$tmp/munge.key" \
  --pid-file="$tmp/munged.pid" --log-file="$tmp/munged.log" --seed-file="$tmp/munged.seed" \
  >>"$tmp/munged.log" 2>&1 &
started_pids+=($!)
for i in $(seq 1 50); do
  munge -n -S "$tmp/munge.socket" 2>/dev/null | unmunge -S "$tmp/munge.socket" >/dev/null 2>&1 &&
    break
  kill -0 "${started_pids[0]}" 2>/dev/null || break
  sleep 0.2
done
munge -n -S "$tmp/munge.socket" 2>/dev/null | unmunge -S "$tmp/munge.socket" >/dev/null 2>&1 ||
  skip "munged did not start or does not answer on $tmp/munge.socket:" \
    "$(tail -n 3 "$tmp/munged.log" 2>/dev/null | tr '\n' ' ')"

# --- slurmctld and slurmd ---------------------------------------------------------------
mkdir -p "$tmp/state" "$tmp/spool" "$tmp/submit"
cat >"$SLURM_CONF" <<EOF
# One node on loopback for tests/engines/slurm_test.sh; everything lives in $tmp.
ClusterName=hddptest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge.socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
SlurmctldDebug=info
MailProg=/bin/true
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
FirstJobId=$first_job
NodeName=localhost NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=hddp Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -i >"$tmp/slurmctld.out" 2>&1 &
started_pids+=($!)
touch "$tmp/slurmctld.started"
slurmd -D -N localhost >"$tmp/slurmd.out" 2>&1 &
started_pids+=($!)

node_state=""
end=$((SECONDS + $(within 30)))
while [ "$SECONDS" -lt "$end" ]; do
  node_state=$(timeout 5 sinfo -h -n localhost -o %T 2>/dev/null || true)
  [ "$node_state" = idle ] && break
  for pid in "${started_pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || break 2
  done
  sleep 0.5
done
if [ "$node_state" != idle ]; then
  show_logs
  skip "Slurm did not start here: the node is '${node_state:-unknown}', not idle, after 30 s" \
    "(slurmctld/slurmd logs above; $(tail -n 2 "$tmp/slurmctld.out" "$tmp/slurmd.out" 2>/dev/null |
      grep -v '^==' | tr '\n' ' '))"
fi
log "Slurm $(sinfo -V | awk '{ print $2 }') up: node localhost ($cpus CPUs), controller port" \
  "$ctld_port, first job id $first_job"

# --- helpers for jobs -------------------------------------------------------------------
job_field() {  # job_field JOB NAME: a field of `scontrol show job`
  timeout 10 scontrol -o show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}
wait_job_end() {  # wait_job_end JOB SECONDS: until the job is in a final state
  local job=$1 limit end state
  limit=$(within "$2")
  end=$((SECONDS + limit))
  while [ "$SECONDS" -lt "$end" ]; do
    state=$(job_field "$job" JobState)
    case "$state" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED | \
        BOOT_FAIL | DEADLINE) return 0 ;;
    esac
    sleep 0.5
  done
  fail "job $job did not end within $limit s (state ${state:-unknown})"
}
expect_in() {  # expect_in FILE REGEX WHAT
  grep -Eq -- "$2" "$1" || fail "$3: no line matching '$2' in $(basename "$1")"
  log "ok: $3"
}
# Submitted from $tmp/submit: the job's output (hddp-JOB.out) and its state land there.
# sbatch passes its environment to the job: a clean one, so that no launcher variable
# (RANK, MASTER_ADDR, ...) or HDDP_* setting of the caller reaches the ranks.
submit() {  # submit NAME SBATCH_OPTIONS... -- TRAINER_ARGS...
  local name=$1 opts=() keep=() v
  shift
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  for v in PATH HOME TMPDIR LANG LD_LIBRARY_PATH; do
    [ -n "${!v:-}" ] && keep+=("$v=${!v}")
  done
  (cd "$tmp/submit" && env -i "${keep[@]}" SLURM_CONF="$SLURM_CONF" HDDP_DEVICE=cpu \
    HDDP_SBATCH_PROGRAM="$train" timeout 30 sbatch --parsable --job-name="$name" \
      --nodes=1 --ntasks-per-node=2 --gpus-per-task=0 --cpus-per-task=1 --time=10 \
      "${opts[@]}" "$sbatch_file" "$@")
}
common=(--model resnet9 --dataset synthetic --image-size 16 --global-batch 32 --workers 0
  --threads 1 --limit-test 256 --progress lines --log-every 10)

# --- 1. a plain job: both ranks train, exit code 0 --------------------------------------
job=$(submit hddp-plain -- "${common[@]}" --max-steps 40) || fail "sbatch refused the job"
log "job $job: 2 CPU ranks, 40 steps"
wait_job_end "$job" 120
out=$tmp/submit/hddp-$job.out
state=$(job_field "$job" JobState)
code=$(job_field "$job" ExitCode)
[ "$state" = COMPLETED ] && [ "$code" = 0:0 ] ||
  fail "job $job ended $state with exit code $code, not COMPLETED 0:0"
log "ok: job $job COMPLETED, exit code 0:0"
expect_in "$out" "^hddp\.sbatch: job $job run 1: 2 task\(s\) on localhost" \
  "the sbatch file ran once"
expect_in "$out" "\[rank 0\] .*rank 0/2 \(local 0/2\) from slurm" \
  "rank 0 joined from Slurm's variables"
expect_in "$out" "\[rank 1\] .*rank 1/2 \(local 1/2\) from slurm" \
  "rank 1 joined from Slurm's variables"
expect_in "$out" "\[rank 0\] .*from slurm, .*store 127\.0\.0\.1:$((20000 + job % 10000))\$" \
  "the store is at SLURM_LAUNCH_NODE_IPADDR, port 20000 + job id % 10000"
expect_in "$out" "^train_resnet: resnet9 on synthetic, 2 rank\(s\)" "the trainer ran 2 ranks"
expect_in "$out" "^done: 40 steps in" "40 steps trained"
expect_in "$out" "^step 40 .*\(split \[[1-9][0-9]*, [1-9][0-9]*\] of 32\)" \
  "both ranks had samples in the last step"

# --- 2. requeued by its USR1 trap, resumed from its last commit -------------------------
job=$(submit hddp-requeue -- "${common[@]}" --max-steps 100 --save-every 10) ||
  fail "sbatch refused the job"
out=$tmp/submit/hddp-$job.out
log "job $job: 100 steps, a commit every 10; USR1 after the first commit"
end=$((SECONDS + $(within 90)))
until grep -q "saved step" "$out" 2>/dev/null; do
  [ "$SECONDS" -lt "$end" ] || fail "job $job saved no state within 90 s"
  case "$(job_field "$job" JobState)" in
    PENDING | RUNNING | CONFIGURING) ;;
    *) fail "job $job ended before its first commit" ;;
  esac
  sleep 0.2
done
# What --signal=B:USR1@120 does 120 s before the time limit: USR1 to the batch shell only.
timeout 10 scancel --batch --signal=USR1 "$job" || fail "scancel --batch --signal=USR1 $job failed"
# The requeued job waits for its BeginTime (about 2 minutes in Slurm 22.05); a cluster
# would start it then, the test starts it at once.
end=$((SECONDS + $(within 60)))
until [ "$(job_field "$job" Restarts)" = 1 ] && [ "$(job_field "$job" JobState)" = PENDING ]; do
  [ "$SECONDS" -lt "$end" ] ||
    fail "job $job was not requeued within 60 s of USR1 (state $(job_field "$job" JobState)," \
      "restarts $(job_field "$job" Restarts))"
  sleep 0.2
done
log "ok: job $job requeued by its trap (Restarts=1, PENDING)"
timeout 10 scontrol update JobId="$job" StartTime=now || fail "scontrol update StartTime failed"
wait_job_end "$job" 150
state=$(job_field "$job" JobState)
code=$(job_field "$job" ExitCode)
restarts=$(job_field "$job" Restarts)
[ "$state" = COMPLETED ] && [ "$code" = 0:0 ] && [ "$restarts" = 1 ] ||
  fail "job $job ended $state, exit code $code, restarts $restarts; want COMPLETED 0:0, 1"
log "ok: job $job COMPLETED after one requeue, exit code 0:0"
expect_in "$out" "^hddp\.sbatch: USR1 \(time limit near\): requeueing job $job" \
  "the trap requeued the job"
expect_in "$out" "^hddp\.sbatch: job $job run 2: 2 task\(s\)" "the sbatch file ran again"
expect_in "$out" "\[rank 0\] .*restart 1 by the launcher" \
  "the trainer saw SLURM_RESTART_COUNT=1"
state_files="$tmp/submit/hddp-state/$job/state-[0-9]*\.hddp"
resumed=$(sed -n "s|.*\[rank 0\] .*resumed from $state_files at step \([0-9]*\),.*|\1|p" "$out" |
  head -n 1)
[ -n "$resumed" ] && [ "$resumed" -gt 0 ] && [ "$resumed" -lt 100 ] ||
  fail "the second run did not resume from a commit (resumed at step '${resumed}')"
log "ok: the second run resumed from the commit at step $resumed in hddp-state/$job"
[ "$(grep -c '^done:' "$out")" = 1 ] ||
  fail "the first run of job $job was not cut short by the requeue"
log "ok: the first run was cut short, only the second one finished"
expect_in "$out" "^done: step 100 of the job; this run trained $((100 - resumed)) steps" \
  "the second run trained steps $resumed..100"
log "PASS ($SECONDS s)"
