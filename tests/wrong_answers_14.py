"""Plausible wrong answers to notebook 14's exercises: the resume (labs/fashion_elastic.py), the
rest of an epoch at another world size and Young's interval (notebook cells);
tests/test_exercises.py checks that the notebook's checks reject each one."""
from answers import Lab

RESUME = "the model's and optimizer's state dicts from get_state_dict"
REST = """
    batch = global_batch // world_size
    mine = {mine}
    done = {done}
    return [mine[i:i + batch] for i in range(done, len(mine) - batch + 1, batch)]"""
SHARE = "order[rank::world_size]"
INTERVAL = """
    mtbf_s = {mtbf}
    return {interval}"""
# Each resume answer is a 2-rank save and an async run (§1, about 20 s), then a 3-rank resume.

WRONG = {
    ("14_checkpoints.ipynb", "exercise 1"): {
        "model.state_dict() and opt.state_dict(), with their module. prefix and numbered state": (
            Lab("fashion_elastic.py", RESUME, """
            state = {"model": model.state_dict(), "optim": opt.state_dict(),
                     "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])"""),
            "it holds get_state_dict's keys"),
        "get_state_dict without save()'s options=FLAT (the optimizer's groups by number)": (
            Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt)
            state = {"model": model_state, "optim": optim_state, "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            sched.load_state_dict(state["sched"])"""),
            "Call get_state_dict with the options save() passes"),
        "get_state_dict's dicts put back with the plain module's and optimizer's load_state_dict": (
            Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt, options=FLAT)
            state = {"model": model_state, "optim": optim_state, "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            getattr(model, "module", model).load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])"""),
            "model.load_state_dict and opt.load_state_dict expect their own layouts"),
        "the checkpoint's parts asked for under other keys (optimizer, scheduler)": (
            Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt, options=FLAT)
            state = {"model": model_state, "optimizer": optim_state,
                     "scheduler": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            sched.load_state_dict(state["scheduler"])"""),
            'Ask dcp.load for the keys save() wrote ("model", "optim", "sched")'),
        "the schedule left out": (Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt, options=FLAT)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])"""),
            "the schedule starts again from its warm-up"),
        "the optimizer's state left out (its momentum starts from zero)": (
            Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt, options=FLAT)
            state = {"model": model_state, "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=optim_state)
            sched.load_state_dict(state["sched"])"""),
            "something a step depends on was not restored"),
        "dcp.load alone: the tensors filled in place, set_state_dict left out": (
            Lab("fashion_elastic.py", RESUME, """
            model_state, optim_state = get_state_dict(model, opt, options=FLAT)
            state = {"model": model_state, "optim": optim_state, "sched": sched.state_dict()}
            dcp.load(state, checkpoint_id=path)
            sched.load_state_dict(state["sched"])"""),
            "only set_state_dict(model, opt, model_state_dict=..., optim_state_dict=...) puts all "
            "of them back"),
    },
    ("14_checkpoints.ipynb", "exercise 2"): {
        "each rank skips samples_done images of its own share": (
            REST.format(mine=SHARE, done="samples_done"), "images never trained on in the epoch"),
        "the epoch from its start": (REST.format(mine=SHARE, done="0"),
                                     "images trained on twice in the epoch"),
        "the steps done, taken for images": (
            REST.format(mine=SHARE, done="samples_done // global_batch"),
            "images trained on twice in the epoch"),
        "contiguous shards instead of dealt in turn": (REST.format(
            mine="order[rank * len(order) // world_size:(rank + 1) * len(order) // world_size]",
            done="samples_done // world_size"), "images trained on twice in the epoch"),
        "a last, shorter batch kept": ("""
            batch = global_batch // world_size
            mine = order[rank::world_size]
            done = samples_done // world_size
            return [mine[i:i + batch] for i in range(done, len(mine), batch)]""",
            "a last, shorter batch is dropped"),
        "the whole global batch on every rank": ("""
            mine = order[rank::world_size]
            done = samples_done // world_size
            return [mine[i:i + global_batch]
                    for i in range(done, len(mine) - global_batch + 1, global_batch)]""",
            "each rank takes global_batch / world_size images a step"),
    },
    ("14_checkpoints.ipynb", "exercise 3"): {
        "one GPU's MTBF, not the job's": (INTERVAL.format(
            mtbf="gpu_mtbf_h * 3600", interval="math.sqrt(2 * save_s * mtbf_s)"),
            "That is one GPU's MTBF"),
        "√(C·M), without the 2": (INTERVAL.format(
            mtbf="gpu_mtbf_h * 3600 / gpus", interval="math.sqrt(save_s * mtbf_s)"),
            "the 2 is missing"),
        "the MTBF left in hours": (INTERVAL.format(
            mtbf="gpu_mtbf_h / gpus", interval="math.sqrt(2 * save_s * mtbf_s)"),
            "Hours and seconds"),
        "2·C·M, without the square root": (INTERVAL.format(
            mtbf="gpu_mtbf_h * 3600 / gpus", interval="2 * save_s * mtbf_s"),
            "grows as the square root"),
    },
}
