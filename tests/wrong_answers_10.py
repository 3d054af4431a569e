"""Plausible wrong answers to notebook 10's exercises (param_groups and correct_topk in
labs/imagenet_ddp.py); tests/test_exercises.py checks that the notebook's checks reject each one."""
from answers import Lab

GROUPS = "a parameter with one dimension"
TOPK = "logits.topk(max(ks), dim=1)"

WRONG = {
    ("10_imagenet.ipynb", "exercise 1"): {
        "weight decay on everything (one group)": Lab("imagenet_ddp.py", GROUPS, """
            return [{"params": list(model.parameters()), "weight_decay": weight_decay}]"""),
        "BatchNorm found by its name ('bn'): torchvision's downsample.1 is missed": Lab("imagenet_ddp.py", GROUPS, """
            named = list(model.named_parameters())
            no_decay = [p for n, p in named if "bn" in n or n.endswith("bias")]
            decay = [p for n, p in named if not ("bn" in n or n.endswith("bias"))]
            return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]"""),
        "only the biases spared, BatchNorm's scale decayed": Lab("imagenet_ddp.py", GROUPS, """
            named = list(model.named_parameters())
            return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": weight_decay},
                    {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]"""),
        "the groups swapped": Lab("imagenet_ddp.py", GROUPS, """
            decay = [p for p in model.parameters() if p.ndim > 1]
            no_decay = [p for p in model.parameters() if p.ndim <= 1]
            return [{"params": no_decay, "weight_decay": weight_decay}, {"params": decay, "weight_decay": 0.0}]"""),
        "the 1-D parameters left out of the optimiser": Lab("imagenet_ddp.py", GROUPS, """
            return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": weight_decay}]"""),
        "the lab's default typed in, not the argument": Lab("imagenet_ddp.py", GROUPS, """
            decay = [p for p in model.parameters() if p.ndim > 1]
            no_decay = [p for p in model.parameters() if p.ndim <= 1]
            return [{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}]"""),
        "two lists, not two groups": Lab("imagenet_ddp.py", GROUPS, """
            return [p for p in model.parameters() if p.ndim > 1], [p for p in model.parameters() if p.ndim <= 1]"""),
    },
    ("10_imagenet.ipynb", "exercise 2"): {
        "the k lowest scores": Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1, largest=False).indices
            return [(top[:, :k] == labels[:, None]).any(dim=1).sum().item() for k in ks]"""),
        "only the k-th best class compared": Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1).indices
            return [(top[:, k - 1] == labels).sum().item() for k in ks]"""),
        "top-1 counted for every k": Lab("imagenet_ddp.py", TOPK, """
            return [(logits.argmax(dim=1) == labels).sum().item() for k in ks]"""),
        "top-k over the batch (dim 0), not over the classes": Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=0).indices.T
            return [(top[:, :k] == labels[:, None]).any(dim=1).sum().item() if top.shape[0] == len(labels) else 0 for k in ks]"""),
        "a fraction, not a count": Lab("imagenet_ddp.py", TOPK, """
            top = logits.topk(max(ks), dim=1).indices
            return [(top[:, :k] == labels[:, None]).any(dim=1).float().mean().item() for k in ks]"""),
    },
}
# Each runs from the exercise cell on (tests/test_exercises.py's BEFORE), not the notebook's top.
WRONG[("10_imagenet.ipynb", "exercise 3")] = {
    "the whole job's images on one GPU's peak": """
        return images_per_s * flops_per_image / (peak_tflops * 1e12)""",
    "a percentage": """
        return 100 * images_per_s / gpus * flops_per_image / (peak_tflops * 1e12)""",
    "TFLOP/s taken for FLOP/s": """
        return images_per_s / gpus * flops_per_image / peak_tflops""",
    "the ratio inverted": """
        return peak_tflops * 1e12 / (images_per_s / gpus * flops_per_image)""",
    "rounded to 3 decimals": """
        return round(images_per_s / gpus * flops_per_image / (peak_tflops * 1e12), 3)""",
    "GFLOP/s taken for TFLOP/s (1e9)": """
        return images_per_s / gpus * flops_per_image / (peak_tflops * 1e9)""",
    "forward FLOPs only (a third of the training FLOPs)": """
        return images_per_s / gpus * flops_per_image / 3 / (peak_tflops * 1e12)""",
}
