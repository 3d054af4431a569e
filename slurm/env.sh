# shellcheck shell=bash disable=SC2034  # the variables are the templates' to use
# What every template in slurm/ shares: paths, the Python environment (container or .venv), the
# rendezvous address, the data staged to node-local disk, and the lab's options. Each template
# sources this file; EDIT it once for your cluster, or export any of these variables before
# `sbatch` (what you export wins).

# ---- paths --------------------------------------------------------------------------------------
# The course checkout, on a filesystem that every node sees. Submit from it: `sbatch slurm/x.sbatch`.
COURSE=${COURSE:-${SLURM_SUBMIT_DIR:-$PWD}}
# FashionMNIST's shared, verified copy: DATA, else DPCOURSE_DATA (what `make` and the notebooks
# read), else the checkout's data/ (where `make data` stages it).                               EDIT
DATA=${DATA:-${DPCOURSE_DATA:-$COURSE/data}}
# Node-local disk for one copy of the data per node: $TMPDIR on many clusters.                EDIT
# Each node's copy makes this folder itself, yours alone (mode 0700). Its name is easy to guess, and
# all users share /tmp: one already there is used only if it is yours and no one else can write to
# it; another user's stops the job (they may have put files there for it to read).
LOCAL_DATA=${LOCAL_DATA:-${TMPDIR:-/tmp}/dpcourse-$SLURM_JOB_ID}
# Checkpoints and the JSON log: shared, so that a requeued job finds them.
RUNS=${RUNS:-$COURSE/runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
# The lab: the solution, or your own labs/fashion_ddp.py once its exercises are done.          EDIT
LAB=${LAB:-solutions/labs/fashion_ddp.py}
# The course's container (container/README.md): the path of dpcourse.sif. Empty: $COURSE/.venv.
CONTAINER=${CONTAINER:-}
# How a container runs: Apptainer with NVIDIA's GPUs. Where the engine is SingularityCE, or the GPUs AMD's:
# CONTAINER_ENGINE=singularity, CONTAINER_GPUS=--rocm (export them before sbatch).
CONTAINER_ENGINE=${CONTAINER_ENGINE:-apptainer}
CONTAINER_GPUS=${CONTAINER_GPUS:---nv}
# Inside the container a job sees the folders above; BIND adds others, comma-separated (a dataset on
# a shared file system: imagenet.sbatch adds IMAGENET).
BIND=${BIND:-}
mkdir -p "$RUNS"
cd "$COURSE" || exit 1

# ---- the Python environment ------------------------------------------------------------------
# The site's modules, if the job needs any: those the .venv was built with (its Python; the MPI that
# Horovod was built with), or the container engine. `module purge` first, so that nothing the login
# shell had loaded leaks into the job.                                                           EDIT
# set +u; module purge; module load …; set -u    # (some sites' module functions fail under set -u)
# PY and TORCHRUN are commands (arrays), so that srun can start them on every node.
if [[ -n $CONTAINER ]]; then
    # --nv: the node's GPU driver and devices inside the container (a warning on CPU-only nodes);
    # --bind: the folders the job reads and writes, at the same paths inside.
    IN_CONTAINER=("$CONTAINER_ENGINE" exec "$CONTAINER_GPUS" --bind "$COURSE,$DATA,$RUNS,${LOCAL_DATA%/*}${BIND:+,$BIND}" "$CONTAINER")
    PY=("${IN_CONTAINER[@]}" python)
    TORCHRUN=("${IN_CONTAINER[@]}" torchrun)
else
    PY=("$COURSE/.venv/bin/python")
    TORCHRUN=("$COURSE/.venv/bin/torchrun")
fi
# torchrun --tee=3 tags each line a rank prints "[rankN]:". The variable, not torchrun's
# --log-line-prefix-template flag: PyTorch 2.11 has no such flag, 2.14 reads both. Like MASTER_ADDR,
# it reaches torchrun through srun's and apptainer's environment (not with sbatch --export=NONE or
# apptainer --cleanenv: the lines are then tagged "[default0]:", the local rank, alike on every node).
# shellcheck disable=SC2016  # ${rank} is torchrun's to fill in, not the shell's
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'

# ---- Slurm ----------------------------------------------------------------------------------
# Threads per process for PyTorch's CPU work: torchrun's own default (1), set here so that no
# torchrun warns about it. The templates that know their processes per node set their own.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# srun inherits sbatch's --cpus-per-task (it reads SLURM_CPUS_PER_TASK) before Slurm 22.05 and again
# since 23.11. 22.05 to 23.02 read SRUN_CPUS_PER_TASK instead, exported here; 23.11 and later ignore it.
# Slurm's release notes: https://github.com/SchedMD/slurm/blob/slurm-22-05-0-1/RELEASE_NOTES and
# https://github.com/SchedMD/slurm/blob/slurm-23-11-0-1/RELEASE_NOTES
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# CPU binding, where the site runs Slurm's task/affinity plugin: srun binds each task to CPUs of its
# own (`srun --cpu-bind=verbose` prints the masks), and a process inherits its parent's binding, so a
# torchrun's workers share its CPUs. On nodes with SMT a "CPU" is a hardware thread:
# `sbatch --hint=nomultithread` gives each task one thread per core (not together with --cpu-bind or
# --threads-per-core). https://slurm.schedmd.com/srun.html
# The rendezvous: the job's first node hosts it, on a port derived from the job id, so that two jobs
# sharing a node seldom pick the same one (a requeued job keeps its id, and its port). Job ids 10,000
# apart do: the later job's rank 0 then ends with "Port … is already in use" and how to pick another.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
export MASTER_ADDR MASTER_PORT

# ---- the network: NCCL (GPU jobs) and gloo (CPU jobs) ---------------------------------------------
# NCCL finds InfiniBand by itself, through verbs; NCCL_IB_HCA picks the adapters (mlx5_0,mlx5_1).
# NCCL_SOCKET_IFNAME names the IP interface for NCCL's bootstrap and its socket transport, and
# GLOO_SOCKET_IFNAME gloo's: set them when the automatic choice is wrong (ib0, eth0: ask your admins;
# `python -m dpcourse.cluster.doctor` lists the node's interfaces). NCCL_DEBUG=WARN prints NCCL's warnings and
# errors; for a diagnosis, INFO with NCCL_DEBUG_SUBSYS=INIT,NET says which network each rank chose
# (NET/IB or NET/Socket) and over which interface. https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html,
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/setup.html (bootstrap),
# https://docs.pytorch.org/docs/stable/distributed.html#choosing-the-network-interface-to-use (gloo)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
# export NCCL_IB_HCA="=mlx5_0,mlx5_1"   # a leading '=': these names exactly (mlx5_1 alone also matches mlx5_10...)

# ---- sites: uncomment the lines of yours; each paragraph is from the site's own material ------------
# JSC (JUWELS, JURECA): the first node's name with an `i` appended, "to allow communication over
# InfiniBand cells"; torchrun_jsc (`pip install torchrun_jsc` into the .venv) is JSC's drop-in
# torchrun, which fixes how torchrun picks the node that hosts the rendezvous on these systems.
# https://github.com/HelmholtzAI-FZJ/2025-12-course-Bringing-Deep-Learning-Workloads-to-JSC-supercomputers,
# https://github.com/HelmholtzAI-FZJ/torchrun_jsc. ib0 for NCCL and gloo is from interTwin's JUWELS set-up, not JSC's:
# https://github.com/interTwin-eu/itwinai/blob/main/src/itwinai/slurm/system-base-scripts/juwels_pre_exec.sh
# MASTER_ADDR=${MASTER_ADDR}i
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
# TORCHRUN=("$COURSE/.venv/bin/torchrun_jsc")            # with the .venv; in a container with torchrun_jsc
#                                                         # installed: TORCHRUN=("${IN_CONTAINER[@]}" torchrun_jsc)
#
# LUMI (LUMI-G): 4 AMD MI250X per node, each two GCDs, and Slurm counts each GCD as a GPU:
# --gpus-per-node=8. PyTorch must be a ROCm build, e.g. LUMI's AI containers in /appl/local/laifs/containers/
# (the course's container is NVIDIA's; LUMI runs containers with SingularityCE: export CONTAINER_ENGINE=singularity
# CONTAINER_GPUS=--rocm before sbatch); their bindings module gives a container the Slingshot network.
# RCCL uses Slingshot 11 only through the aws-ofi-rccl plugin: with NCCL_DEBUG=INFO the log says
# "NET/OFI Using aws-ofi-rccl". https://docs.lumi-supercomputer.eu/hardware/lumig/,
# https://docs.lumi-supercomputer.eu/software/packages/pytorch/, https://github.com/Lumi-supercomputer/LUMI-AI-Guide
# module use /appl/local/laifs/modules; module load lumi-aif-singularity-bindings
# export NCCL_SOCKET_IFNAME=hsn
#
# Slingshot (NERSC's Perlmutter, CSCS's Alps): NCCL uses Slingshot only through the aws-ofi-nccl plugin
# (libfabric), else falls back to TCP, much slower. The sites' container engines put it in: on Alps,
# an EDF file with `com.hooks.aws_ofi_nccl.enabled = "true"` (`srun --environment=…`); on Perlmutter,
# `podman-hpc run --gpu --nccl` (which also sets NCCL_SOCKET_IFNAME=hsn), or Shifter's NCCL module
# (`#SBATCH --module=gpu,nccl-2.18` in NERSC's tutorial). CSCS asks for NCCL_NET="AWS Libfabric" always, so
# that a missing plugin stops the job instead of falling back, and for NCCL_NET_GDR_LEVEL=PHB,
# FI_CXI_DISABLE_HOST_REGISTER=1 and FI_MR_CACHE_MONITOR=userfaultfd: its Container Engine sets them, a uenv
# does not. Alps' GPU nodes are Arm (GH200): the course's container is x86-64 only (container/README.md).
# https://docs.cscs.ch/software/communication/nccl/, https://docs.cscs.ch/software/container-engine/resource-hook/,
# https://github.com/NERSC/podman-hpc/blob/main/etc/modules.d/nccl.yaml, https://github.com/NERSC/sc23-dl-tutorial
# export NCCL_NET="AWS Libfabric" NCCL_NET_GDR_LEVEL=PHB FI_CXI_DISABLE_HOST_REGISTER=1 FI_MR_CACHE_MONITOR=userfaultfd
#
# A university cluster (Princeton's Della, as its research computing's DDP guide has it): memory per
# node (#SBATCH --mem=32G; the default is 4 GB per CPU core), GPUs as --gres=gpu:N, Python from a
# module, MASTER_ADDR the job's first node as here: nothing else site-specific.
# https://github.com/PrincetonUniversity/multi_gpu_training/tree/main/02_pytorch_ddp
# module purge; module load anaconda3/2023.9

# ---- what every training job passes to the lab -----------------------------------------------
# The node-local data; rank 0's checkpoints and JSON log in RUNS; --resume auto: a requeued job
# (`#SBATCH --requeue`: preemption, a node failure) goes on from its last checkpoint.
LAB_ARGS=(--data-root "$LOCAL_DATA" --checkpoint-dir "$RUNS" --checkpoint-every 100 --resume auto
          --log-json "$RUNS/log.jsonl")

# ---- the time limit ---------------------------------------------------------------------------
# The training templates ask Slurm for a warning: `#SBATCH --signal=B:USR1@120` sends SIGUSR1 to this
# shell about 120 s before --time (Slurm may send it up to a minute earlier). run_training then has
# Slurm send SIGTERM to every task of the training step (`scancel --signal=TERM JOB.STEP`: srun itself
# would end the step on a SIGTERM); a torchrun passes it on to its workers. Each lab
# finishes its step, the ranks agree to stop after that same step, rank 0 writes the checkpoint, and
# all exit. The job then requeues itself (`scontrol requeue`, which #SBATCH --requeue allows): the next
# run goes on from that checkpoint (--resume auto) and appends to the same log (--open-mode=append).
# Without the warning, the job ends at --time as TIMEOUT and is not requeued: Slurm sends each task SIGTERM,
# then SIGKILL after KillWait (man srun, --time), but srun, which gets a SIGTERM too, passes it on to its tasks
# as SIGKILL (Slurm's src/srun/signals.c), which may come first: count on nothing after the last periodic
# checkpoint (--checkpoint-every); submit the job again to go on from there.
TIME_WARNED=0
STEP_PID=
on_time_warning() {
    if (( TIME_WARNED )); then return; fi  # a second warning: the step is already stopping
    TIME_WARNED=1
    touch "$RUNS/.warned"  # a checkpoint newer than this was written after the warning
    echo "$(date +%T) time-limit warning (SIGUSR1): the lab saves a checkpoint and stops; then the job requeues itself"
    if [[ -n $STEP_PID ]]; then signal_training_step; fi
}

# SIGTERM to the tasks of this job's running steps (the training's srun): a signal only, the step goes on.
signal_training_step() {
    local step name steps tries
    for tries in 1 2 3; do  # a busy controller: ask again
        if steps=$(squeue --noheader --steps --format="%i %j" --jobs="$SLURM_JOB_ID"); then break; fi
        steps=
        sleep 5
    done
    [[ -n $steps ]] || echo "could not list the job's steps (squeue failed $tries times): the lab is not told to stop"
    while read -r step name; do  # the training's steps: not the batch shell's, nor the clean-up step
        case $step in "" | *.batch | *.extern | *.interactive) continue ;; esac
        [[ $name == "$CLEANUP_STEP" ]] || scancel --signal=TERM "$step" || true
    done <<< "$steps"
}
trap on_time_warning USR1

# Run a training step (`run_training srun ... lab ...`): in the background, so that this shell can
# take the warning while it runs; requeue the job once the step has saved and stopped.
run_training() {
    local status
    if (( TIME_WARNED )); then  # warned before training began (while staging): no time to train, no requeue
        echo "the time-limit warning came before training began: ask for a longer --time (sbatch --time=...)"
        return 1
    fi
    "$@" &
    STEP_PID=$!
    while kill -0 "$STEP_PID" 2>/dev/null; do wait "$STEP_PID" || true; done  # a trap ends `wait` early
    wait "$STEP_PID" && status=0 || status=$?
    STEP_PID=
    if (( TIME_WARNED )); then
        requeue_job "$status"
    fi
    return "$status"
}

# The newest complete checkpoint in RUNS: rank 0's last.pt, or the .metadata of a distributed
# checkpoint's step-NNNNNNN/ (fashion_elastic.py: written last, once every rank's part is there).
newest_checkpoint() {
    local newest="" f
    for f in "$RUNS/last.pt" "$RUNS"/step-*/.metadata; do
        if [[ -e $f && ( -z $newest || $f -nt $newest ) ]]; then newest=$f; fi
    done
    echo "$newest"
}

# Requeue only a run that saved after the warning, and at most MAX_REQUEUES times (SLURM_RESTART_COUNT):
# a job that makes no progress must not spend the account's hours in a loop.
MAX_REQUEUES=${MAX_REQUEUES:-3}  # a course's jobs: 3 more runs at most (an account's hours are shared)
requeue_job() {
    local saved
    saved=$(newest_checkpoint)
    if [[ -z $saved || ! $saved -nt $RUNS/.warned ]]; then
        echo "$(date +%T) no checkpoint was written after the warning (exit status $1): not requeued"
        return "$1"
    fi
    if (( ${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES )); then
        echo "$(date +%T) requeued $MAX_REQUEUES times already (MAX_REQUEUES): not again; resubmit to go on"
        return "$1"
    fi
    echo "$(date +%T) scontrol requeue $SLURM_JOB_ID: the next run resumes from ${saved%/.metadata}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0  # Slurm ends this run of the script as it requeues the job
}

# ---- node-local data: deleted when the job ends (best effort) ------------------------------------
# One small step per node (named dpcourse-cleanup, slurm/delete_at_end.sh) waits for the end of the job:
# done, failed, cancelled, timed out or requeued. Slurm then sends SIGTERM to every step, and this one
# deletes LOCAL_DATA on its node: renamed first (a deletion cut short is never taken for a copy), within Slurm's
# KillWait (30 s by default; ImageNet as 1.28 M files may take longer to delete than as ~1,300 shards).
# A SIGTERM while the job still runs (a preemption's grace time, scancel --signal=TERM JOBID) deletes
# nothing. A node that fails, a SIGKILL, or a job that ends before the step starts leaves the copy:
# sites that clean up after every job (Slurm's job_container/tmpfs, a per-job $TMPDIR removed by the
# epilog) cover those too; ask yours. A requeued run copies the data again.
# Only an absolute folder named for this job (…-$SLURM_JOB_ID, the default) outside COURSE, RUNS and
# DATA is deleted: one you named yourself may hold what is not this job's, and is left alone. So is
# one of that name that another user made (the job refused it): delete_at_end.sh deletes only yours.
CLEANUP_STEP=dpcourse-cleanup
delete_local_data_at_end() {
    local dir=${LOCAL_DATA%/}
    if [[ $dir != /*-"$SLURM_JOB_ID" || $dir/ == "$COURSE"/* || $dir/ == "$RUNS"/* || $dir/ == "$DATA"/* ]]; then
        echo "LOCAL_DATA=$LOCAL_DATA is not a node-local folder named for this job (/…-$SLURM_JOB_ID): it is not deleted at the end"
        return 0
    fi
    # Its messages go to RUNS/cleanup.log, not the job's log: Slurm's "STEP … CANCELLED" as it ends the
    # step with the job, which is how it ends, or srun's reason if it refuses the step.
    # The step asks for one CPU and no GPUs (22.05's srun adds the job's GPUs to --gres=none from
    # SLURM_GPUS_PER_NODE), and shares them with the training (--overlap).
    { env -u SLURM_GPUS_PER_NODE -u SLURM_GPUS -u SLURM_GPUS_PER_TASK -u SLURM_TRES_PER_TASK \
        srun --overlap --job-name="$CLEANUP_STEP" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task=1 \
        --gres=none bash "$COURSE/slurm/delete_at_end.sh" "$SLURM_JOB_ID" "$dir" >> "$RUNS/cleanup.log" 2>&1; } &
}

# Copy the shared data to node-local disk, once per node (one task per node), verified; deleted there
# when the job ends. srun's --ntasks defaults to the job's: a step with fewer tasks says how many.
stage_data() {
    delete_local_data_at_end
    srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        "${PY[@]}" -m dpcourse.lab.data fetch --from "$DATA" --data-root "$LOCAL_DATA"
}

# A training job's first line. jupyter.sbatch trains nothing: it sets TRAINS=0 before sourcing this file.
if [[ ${TRAINS:-1} != 0 ]]; then
    echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $MASTER_ADDR:$MASTER_PORT, runs in $RUNS," \
         "${CONTAINER:+container $CONTAINER,}lab $LAB"
fi
