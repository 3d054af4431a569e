"""Plausible wrong launch lines for notebook 09's exercise (labs/first_job.sbatch);
tests/test_exercises.py checks that the notebook's check rejects each one."""
from answers import Lab

HINT = "followed by: --nnodes="
RDZV = '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"'
LAB = '"$LAB" "${LAB_ARGS[@]}" "$@"'

WRONG = {
    ("09_cluster.ipynb", "exercise 1"): {
        "--nnodes=1: each torchrun thinks it is alone": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes=1 \
                --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} {LAB}"""),
            "torchrun --nnodes=1, but srun starts 2 torchrun(s)"),
        "the numbers typed in (2 nodes, 2 GPUs)": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes=2 --nproc-per-node=2 \
                {RDZV} {LAB}"""),
            "torchrun --nnodes=2, but srun starts 4 torchrun(s)"),
        "--standalone on every node": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --standalone \
                --nproc-per-node="$SLURM_GPUS_ON_NODE" {LAB}"""),
            "2 separate jobs that never meet"),
        "no srun: torchrun on the first node only": (Lab("first_job.sbatch", HINT, f"""
            "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" \
                {RDZV} {LAB}"""),
            "torchrun without srun runs on the job's first node only"),
        "one process per node (the tasks, not the GPUs)": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
                --nproc-per-node="$SLURM_NTASKS_PER_NODE" {RDZV} {LAB}"""),
            "1 process(es) per node for 2 GPUs"),
        "no rendezvous": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
                --nproc-per-node="$SLURM_GPUS_ON_NODE" {LAB}"""),
            "without --rdzv-endpoint"),
        "srun python: one process per node, no torchrun": (Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{PY[@]}}" {LAB}"""),
            "the lab is started by python, not by torchrun"),
    },
}
WRONG[("09_cluster.ipynb", "exercise 1")].update({
    "no --rdzv-backend: the static rendezvous, node rank 0 everywhere": (Lab(
        "first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
            --nproc-per-node="$SLURM_GPUS_ON_NODE" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
            --rdzv-id="$SLURM_JOB_ID" {LAB}"""),
        "with --rdzv-backend=static (the default)"),
    "the rendezvous on localhost": (Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
            --nproc-per-node="$SLURM_GPUS_ON_NODE" --rdzv-backend=c10d \
            --rdzv-endpoint=localhost:29500 --rdzv-id="$SLURM_JOB_ID" {LAB}"""),
        "is each node's own loopback address"),
    'without "$@": the options given to the job are lost': (Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
            --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} "$LAB" "${{LAB_ARGS[@]}}" """),
        "do not reach the lab: end the launch line with \"$@\""),
    'without "${LAB_ARGS[@]}": no node-local data, checkpoints or log': (Lab(
        "first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" \
            --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} "$LAB" "$@" """),
        "the lab does not get env.sh's options"),
})
