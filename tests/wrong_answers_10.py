"""Plausible wrong answers to notebook 10's exercises (param_groups and correct_topk in
labs/imagenet_ddp.py); tests/test_exercises.py checks that the notebook's checks reject each one."""
from answers import Lab

GROUPS = "a parameter with one dimension"
TOPK = "logits.topk(max(ks), dim=1)"

WRONG = {
    ("10_imagenet.ipynb", "exercise 1"): {
        "weight decay on everything (one group)": (Lab("imagenet_ddp.py", GROUPS, """
            return [{"params": list(model.parameters()), "weight_decay": weight_decay}]"""),
            "bn1.weight (a BatchNorm scale or shift, shape (64,)) gets weight decay 5e-05, "
            "not 0.0"),
        "BatchNorm found by its name ('bn'): torchvision's downsample.1 is missed": (Lab(
            "imagenet_ddp.py", GROUPS, """
            named = list(model.named_parameters())
            no_decay = [p for n, p in named if "bn" in n or n.endswith("bias")]
            decay = [p for n, p in named if not ("bn" in n or n.endswith("bias"))]
            return [{"params": decay, "weight_decay": weight_decay},
                    {"params": no_decay, "weight_decay": 0.0}]"""),
            "Its name has no 'bn' in it"),
        "only the biases spared, BatchNorm's scale decayed": (Lab("imagenet_ddp.py", GROUPS, """
            named = list(model.named_parameters())
            return [{"params": [p for n, p in named if not n.endswith("bias")],
                     "weight_decay": weight_decay},
                    {"params": [p for n, p in named if n.endswith("bias")],
                     "weight_decay": 0.0}]"""),
            "bn1.weight (a BatchNorm scale or shift, shape (64,)) gets weight decay 5e-05, "
            "not 0.0"),
        "the groups swapped": (Lab("imagenet_ddp.py", GROUPS, """
            decay = [p for p in model.parameters() if p.ndim > 1]
            no_decay = [p for p in model.parameters() if p.ndim <= 1]
            return [{"params": no_decay, "weight_decay": weight_decay},
                    {"params": decay, "weight_decay": 0.0}]"""),
            "conv1.weight (a conv or linear weight, shape (64, 3, 7, 7)) gets weight decay 0.0, "
            "not 5e-05"),
        "the 1-D parameters left out of the optimiser": (Lab("imagenet_ddp.py", GROUPS, """
            return [{"params": [p for p in model.parameters() if p.ndim > 1],
                     "weight_decay": weight_decay}]"""),
            "parameters are in no group"),
        "the lab's default typed in, not the argument": (Lab("imagenet_ddp.py", GROUPS, """
            decay = [p for p in model.parameters() if p.ndim > 1]
            no_decay = [p for p in model.parameters() if p.ndim <= 1]
            return [{"params": decay, "weight_decay": 1e-4},
                    {"params": no_decay, "weight_decay": 0.0}]"""),
            "not a number of your own"),
        "two lists, not two groups": (Lab("imagenet_ddp.py", GROUPS, """
            return [p for p in model.parameters() if p.ndim > 1], [p for p in model.parameters()
                                                                   if p.ndim <= 1]"""),
            "return a list of two dicts"),
    },
    ("10_imagenet.ipynb", "exercise 2"): {
        "the k lowest scores": (Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1, largest=False).indices
            return [(top[:, :k] == labels[:, None]).any(dim=1).sum().item() for k in ks]"""),
            "Are the k LOWEST scores taken"),
        "only the k-th best class compared": (Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1).indices
            return [(top[:, k - 1] == labels).sum().item() for k in ks]"""),
            "Top-5 counts only the top-1 hit"),
        "top-1 counted for every k": (Lab("imagenet_ddp.py", TOPK, """
            return [(logits.argmax(dim=1) == labels).sum().item() for k in ks]"""),
            "Top-5 counts only the top-1 hit"),
        "top-k over the batch (dim 0), not over the classes": (Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=0).indices.T
            return [(top[:, :k] == labels[:, None]).any(dim=1).sum().item()
                    if top.shape[0] == len(labels) else 0 for k in ks]"""),
            "Each row's best classes: topk along dim=1"),
        "a fraction, not a count": (Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1).indices
            return [(top[:, :k] == labels[:, None]).any(dim=1).float().mean().item()
                    for k in ks]"""), "not fractions"),
    },
}
# Each runs from the exercise cell on (tests/test_exercises.py's BEFORE), not the notebook's top.
WRONG[("10_imagenet.ipynb", "exercise 3")] = {
    "the whole job's images on one GPU's peak": ("""
        return images_per_s * flops_per_image / (peak_tflops * 1e12)""",
        "That is the whole job's images on ONE GPU's peak"),
    "a percentage": ("""
        return 100 * images_per_s / gpus * flops_per_image / (peak_tflops * 1e12)""",
        "a percentage?"),
    "TFLOP/s taken for FLOP/s": ("""
        return images_per_s / gpus * flops_per_image / peak_tflops""", "the peak is in TFLOP/s"),
    "the ratio inverted": ("""
        return peak_tflops * 1e12 / (images_per_s / gpus * flops_per_image)""", "= 5.198"),
    "rounded to 3 decimals": ("""
        return round(images_per_s / gpus * flops_per_image / (peak_tflops * 1e12), 3)""",
        "rounded?"),
    "GFLOP/s taken for TFLOP/s (1e9)": ("""
        return images_per_s / gpus * flops_per_image / (peak_tflops * 1e9)""", "1e9 is a GFLOP/s"),
    "forward FLOPs only (a third of the training FLOPs)": ("""
        return images_per_s / gpus * flops_per_image / 3 / (peak_tflops * 1e12)""",
        "= 0.064125, not 0.1924"),
}
