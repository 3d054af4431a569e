#!/bin/bash
# The clean-up step of env.sh's delete_local_data_at_end, one task per node: wait for the end of job $1,
# then delete its node-local folder $2 here. Slurm sends every step SIGTERM when the job ends (done,
# failed, cancelled, timed out or requeued), then SIGKILL after KillWait.
job=$1 dir=$2
on_term() {
    # A SIGTERM while the job still runs (a preemption's grace time, scancel --signal=TERM JOBID) is not its end.
    [[ $(squeue --noheader --format=%T --jobs="$job" 2>/dev/null) == RUNNING ]] && return
    # Renamed first: a deletion cut short by SIGKILL is never taken for a finished copy (a requeued run
    # of the job, with the same id, on this node). Only a folder of the job's user: one of this name
    # that another user made (the job refused to stage into it) is theirs. mv -T: a folder of the
    # new name that someone made first fails the rename, instead of receiving the job's data.
    if [[ -d $dir && ! -L $dir && -O $dir ]] && mv -T -- "$dir" "$dir.deleting-$$" 2>/dev/null; then
        rm -rf -- "$dir.deleting-$$"
    fi
    exit 0
}
trap on_term TERM INT
# The sleeps end with this script, and hold none of the step's output open: where Slurm tracks a step's
# processes by parentage (proctrack/linuxproc, pgid), a sleep this shell leaves behind is no longer
# found, and its step (and so the job, and the node) would stay COMPLETING until Slurm gave up on it.
# A SIGTERM can end the sleep just before this shell takes it, and the loop then starts another one.
trap 'kill $(jobs -p) 2>/dev/null' EXIT
while :; do sleep 600 >/dev/null 2>&1 & wait $!; done
