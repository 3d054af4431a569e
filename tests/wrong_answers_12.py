"""Plausible wrong answers to notebook 12's exercises (the bug-hunt labs, solutions/labs/bugs/);
tests/test_exercises.py checks that each check rejects every one of them. Each wrong answer
costs a run of the lab (3-5 s): the bug itself, and other mistakes a learner could make instead.

BUGS holds each lab's defect: the code its exercise region holds in the buggy twin
(labs/bugs/<name>.py); "" when the fix is a line the buggy script simply does not have.
tests/test_clinic.py checks that each buggy twin is its fixed twin with exactly that code,
so the first wrong answer of each exercise is the very bug the notebook shows.
"""
from answers import Lab

BUGS = {
    "no_set_epoch": "",
    "download_race": "downloaded = download_if_missing(source, dest, args.mb_per_s)",
    "no_set_device": "return torch.load(path)",
    "no_barrier": "",
    "rank0_accuracy": "",
    "padded_eval": """
        shard = list(DistributedSampler(range(len(labels)),
                                        shuffle=False))  # DDP: this rank's test images""",
    "unscaled_lr": "lr = args.lr",
    "skipped_collective": """
        if rank == 0:  # DDP: only rank 0 prints the accuracy, so only rank 0 measures it
            accuracy = evaluate(model, test, rank, world_size)
            print(f"test accuracy {accuracy:.4f} after {args.steps} steps", flush=True)""",
    "shape_mismatch": """
        gathered = [torch.zeros_like(wrong) for _ in range(world_size)]
        dist.all_gather(gathered, wrong)  # DDP: every rank's indices""",
}
ORDER = list(BUGS)  # the notebook's order: exercise N fixes ORDER[N - 1]
# What each check must say when the fixed twin still holds the bug: the symptom, in the check's
# words
SAYS = {
    "no_set_epoch": "is not the sampler's order for epoch 1",
    "download_race": "2 downloads: only rank 0 should download",
    "no_set_device": "could not load the checkpoint: "
                     "Attempting to deserialize object on a CUDA device",  # either rank
    "no_barrier": "a rank read before rank 0 had written the file",
    "rank0_accuracy": "rank 0 reports 5,000 images, not 10,000",
    "padded_eval": "10,002 images tested, not 10,000",
    "unscaled_lr": "lr 0.016 for a global batch of 512; the linear rule gives 0.032",
    # the hang, named by dpcourse.lab.explain
    "skipped_collective": "waited its whole timeout and no other rank joined it",
    "shape_mismatch": "doesn't match expected size",  # gloo's own words, from the rank that crashed
}


def the_bug(name: str) -> tuple[Lab, str]:
    return Lab(f"bugs/{name}_fixed.py", "", BUGS[name] or "pass"), SAYS[name]


def fix(name: str, code: str, says: str) -> tuple[Lab, str]:
    return Lab(f"bugs/{name}_fixed.py", "", code), says


OTHER = {
    "no_set_epoch": {
        "a different epoch number on each rank": fix(
            "no_set_epoch", "sampler.set_epoch(epoch + rank)",
            "every rank must call set_epoch with the same number"),
    },
    "download_race": {
        "every rank downloads, then a barrier": fix("download_race", """
            downloaded = download_if_missing(source, dest, args.mb_per_s)
            dist.barrier()""", "2 downloads: only rank 0 should download"),
    },
    "no_set_device": {
        "map_location='cpu' for every rank (what torch's own message suggests)": fix(
            "no_set_device", 'return torch.load(path, map_location="cpu")', "not meta"),
    },
    "no_barrier": {
        "a long enough sleep instead of a barrier (a guess)": fix(
            "no_barrier", "time.sleep(6)", "a pause long enough here is a guess"),
    },
    "rank0_accuracy": {
        "summed, then divided by the world size (a mean of the shards)": fix("rank0_accuracy", """
            totals = torch.tensor([correct, count], dtype=torch.float64)
            dist.all_reduce(totals, op=dist.ReduceOp.SUM)
            correct, count = (totals / world_size).tolist()""",
            "rank 0 reports 5,000 images, not 10,000"),
    },
    "padded_eval": {
        "drop_last: the remainder never tested": fix("padded_eval", """
            shard = list(DistributedSampler(range(len(labels)), shuffle=False, drop_last=True))""",
            "9,999 images tested, not 10,000"),
    },
    "unscaled_lr": {
        "square-root scaling": fix("unscaled_lr",
                                   "lr = args.lr * (global_batch / args.batch_size) ** 0.5",
                                   "lr 0.0226274 for a global batch of 512"),
    },
    "skipped_collective": {  # any other skipped collective hangs the same way as the bug
        "every rank evaluates and prints": fix("skipped_collective", """
            accuracy = evaluate(model, test, rank, world_size)
            print(f"test accuracy {accuracy:.4f} after {args.steps} steps", flush=True)""",
            "and only rank 0 prints"),
        "rank 0 tests its own share, no collective": fix("skipped_collective", """
            if rank == 0:
                x, y = test[torch.arange(0, len(test), world_size)]
                with torch.no_grad():
                    accuracy = (model(x.flatten(1)).argmax(1) == y).double().mean().item()
                print(f"test accuracy {accuracy:.4f} after {args.steps} steps", flush=True)""",
                                                         "is every test image counted once"),
    },
    "shape_mismatch": {
        "padded but never cut": fix("shape_mismatch", """
            padded = torch.cat([wrong, wrong.new_zeros(len(shard) - len(wrong))])
            gathered = [torch.zeros_like(padded) for _ in range(world_size)]
            dist.all_gather(gathered, padded)""", "must be cut off after the gather"),
    },
}

WRONG = {("12_clinic.ipynb", f"exercise {n}"): {"the bug itself": the_bug(name), **OTHER[name]}
         for n, name in enumerate(ORDER, 1)}
