"""Plausible wrong launch lines for notebook 09's exercise (labs/first_job.sbatch);
tests/test_exercises.py checks that the notebook's check rejects each one."""
from answers import Lab

HINT = "followed by: --nnodes="
RDZV = '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"'
LAB = '"$LAB" "${LAB_ARGS[@]}" "$@"'

WRONG = {
    ("09_cluster.ipynb", "exercise 1"): {
        "--nnodes=1: each torchrun thinks it is alone": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes=1 --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} {LAB}"""),
        "the numbers typed in (2 nodes, 2 GPUs)": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes=2 --nproc-per-node=2 {RDZV} {LAB}"""),
        "--standalone on every node": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --standalone --nproc-per-node="$SLURM_GPUS_ON_NODE" {LAB}"""),
        "no srun: torchrun on the first node only": Lab("first_job.sbatch", HINT, f"""
            "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} {LAB}"""),
        "one process per node (the tasks, not the GPUs)": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_NTASKS_PER_NODE" {RDZV} {LAB}"""),
        "no rendezvous": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" {LAB}"""),
        "srun python: one process per node, no torchrun": Lab("first_job.sbatch", HINT, f"""
            srun --kill-on-bad-exit=1 "${{PY[@]}}" {LAB}"""),
    },
}
WRONG[("09_cluster.ipynb", "exercise 1")].update({
    "no --rdzv-backend: the static rendezvous, node rank 0 everywhere": Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" {LAB}"""),
    "the rendezvous on localhost": Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" --rdzv-backend=c10d --rdzv-endpoint=localhost:29500 --rdzv-id="$SLURM_JOB_ID" {LAB}"""),
    'without "$@": the options given to the job are lost': Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} "$LAB" "${{LAB_ARGS[@]}}" """),
    'without "${LAB_ARGS[@]}": no node-local data, checkpoints or log': Lab("first_job.sbatch", HINT, f"""
        srun --kill-on-bad-exit=1 "${{TORCHRUN[@]}}" --nnodes="$SLURM_NNODES" --nproc-per-node="$SLURM_GPUS_ON_NODE" {RDZV} "$LAB" "$@" """),
})
