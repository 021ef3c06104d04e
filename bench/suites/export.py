"""Exported weights in PyTorch: for the MLP, CNN and GPT of configs/, a short
meshtrain run, `meshtrain export --logits-for 64`, and
bench/peers/torch_export_check.py, which builds the equivalent torch module,
loads the file with load_state_dict and computes the logits of the same
inputs. One line per model: the largest |torch - meshtrain| logit difference
("value", in millionths: result lines round to 4 decimals), the tolerance it
is held to (same unit), and the share of examples (tokens for the GPT) whose
arg-max class agrees.
"""

from common import PEERS, thread_env
from meshtrain import config_path

STEPS = (20, 5)  # training steps before export (normal, --quick)


def run(ctx):
    exe = ctx.ensure_built("meshtrain")
    py = ctx.torch_python()
    steps = STEPS[1 if ctx.quick else 0]
    for model in ("mlp", "cnn", "gpt"):
        ckpt = ctx.workdir / f"{model}.ckpt.safetensors"
        weights = ctx.workdir / f"{model}.safetensors"
        common = [exe, "--config", config_path(model), "--set", "train.threads=1",
                  "--set", f'train.checkpoint="{ckpt}"']
        line = {"name": f"{model}_export_torch_logits", "unit": "1e-6 (max abs logit diff)", "model": model,
                "steps": steps}
        train = [common[0], "train", *common[1:], "--quiet", "--set", f"train.steps={steps}",
                 "--set", "train.eval=false"]
        export = [common[0], "export", *common[1:], "--out", weights, "--logits-for", "64"]
        error = None
        for name, cmd in (("train", train), ("export", export)):
            r = ctx.run(cmd, thread_env(1), f"{model}-{name}")
            if not r.ok:
                error = f"meshtrain {name}: {r.failure()}"
                break
        if error is None:
            r = ctx.run([py, PEERS / "torch_export_check.py", "--weights", weights,
                         "--logits", ctx.workdir / f"{model}.logits.safetensors"],
                        thread_env(1), f"{model}-torch")
            lines = r.json_lines()
            if lines:
                res = lines[-1]
                line.update({"value": res["max_abs_diff"] * 1e6,
                             "tolerance": res["tolerance"] * 1e6,
                             "argmax_agreement": res["argmax_agreement"],
                             "logits": res["logits"], "peer_name": f"pytorch-{res['torch']}"})
                if not res["ok"]:
                    error = "PyTorch's logits differ beyond the tolerance"
            else:
                error = f"torch_export_check: {r.failure()}"
        if error:
            line.setdefault("value", None)
            line["error"] = error
        ctx.emit(line)

