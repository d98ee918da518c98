"""Loss parity of float8 training on one GPU: N steps of ViT-B/16 and Swin-T in bf16-pure and in fp8 (each recipe
asked for), from the same initial weights on the same learnable synthetic stream. Writes the per-step losses (JSON) and
a plot (PNG, where matplotlib imports) and prints each fp8 run's final loss, the mean of its last 50 steps, against
bf16-pure's. A second bf16-pure run from other initial weights (same stream) is the yardstick: how far two runs of
one precision end apart. `--plot losses.json` only plots and prints (for a GPU machine without matplotlib).

The runs are eager: compiling fuses torchao's casts without changing their arithmetic (it moves the results by float8
rounding noise, as fp8 itself does), and the compiles would cost more device time than the steps."""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.config import FP8_RECIPES, ModelConfig
from vitctl.trainer.fp8 import ALIGNMENT, convert_to_float8
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.optim import param_groups, set_lr
from vitctl.trainer.precision import MasterWeights

CLASSES, IMG_SIZE = 100, 224
SIGNAL = 0.25  # the class pattern's amplitude under unit noise: learnable, but not in a few steps
FINAL_STEPS = 50  # the final loss is the mean of these last steps
WARMUP_STEPS, WEIGHT_DECAY, CLIP, LABEL_SMOOTHING = 100, 0.05, 1.0, 0.1


class TemplateStream:
    """Batches of a class's fixed pattern under fresh noise, labelled by that class: learnable, never repeating, and
    the same sequence in every run of one seed."""

    def __init__(self, batch: int, device: torch.device, seed: int) -> None:
        self.batch, self.generator = batch, torch.Generator(device).manual_seed(seed)
        coarse = torch.randn(CLASSES, 3, 16, 16, generator=self.generator, device=device)
        self.templates = F.interpolate(coarse, size=IMG_SIZE, mode="bilinear")

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.templates.device
        labels = torch.randint(0, CLASSES, (self.batch,), generator=self.generator, device=device)
        noise = torch.randn(self.batch, 3, IMG_SIZE, IMG_SIZE, generator=self.generator, device=device)
        return SIGNAL * self.templates[labels] + noise, labels


CONTROL = "bf16-pure, other init"


def losses_of(name: str, recipe: str | None, init_seed: int, args: argparse.Namespace) -> list[float]:
    """Each step's loss, training `name` bf16-pure (fp32 masters, fused AdamW) from the weights of `init_seed`, its
    blocks in float8 with `recipe`."""
    device = torch.device("cuda")
    ops = resolve("all", device)
    model = build_model(ModelConfig(name=name, num_classes=CLASSES, drop_path=0.0), ops, init_seed).to(device)
    if recipe is not None:
        convert_to_float8(model, recipe, fsdp=False)
    master = MasterWeights(model)
    optimizer = ops.optimizer(param_groups(master.module, WEIGHT_DECAY, None), args.lr, (0.9, 0.999), 1e-8)
    stream = TemplateStream(args.batch, device, args.seed)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    losses = []
    for step in range(args.steps):
        set_lr(optimizer, args.lr * min(1.0, (step + 1) / WARMUP_STEPS))
        images, labels = next(stream)
        loss = loss_fn(model(images.to(torch.bfloat16)).float(), labels)
        loss.backward()
        master.step(optimizer, CLIP)
        losses.append(loss.detach())
    return torch.stack(losses).tolist()


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-FINAL_STEPS:])


def summary(results: dict) -> str:
    lines = [f"| model | run | first loss | final loss (last {FINAL_STEPS} steps) | vs bf16-pure |",
             "|---|---|---:|---:|---:|"]
    for name, runs in results["losses"].items():
        reference = final(runs["bf16-pure"])
        for run, losses in runs.items():
            gap = "" if run == "bf16-pure" else f"{(final(losses) - reference) / reference:+.2%}"
            lines.append(f"| {name} | {run} | {losses[0]:.4f} | {final(losses):.4f} | {gap} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """One panel per model: each run's loss as a moving average of 20 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["losses"]
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, (name, runs) in zip(axes[0], models.items(), strict=True):
        for run, losses in runs.items():
            smooth = torch.tensor(losses).unfold(0, 20, 1).mean(1)
            axis.plot(range(20, len(losses) + 1), smooth, label=f"{run} (final {final(losses):.4f})", linewidth=1)
        axis.set(title=f"{name}, batch {results['batch']}", xlabel="step", ylabel="loss (20-step mean)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def plot_if_possible(results: dict, path: Path) -> None:
    try:
        plot(results, path)
    except ImportError:
        print(f"no matplotlib here; plot elsewhere: python bench/fp8_parity.py --plot {path.with_suffix('.json')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit_b16,swin_t")
    parser.add_argument("--recipes", default=",".join(FP8_RECIPES))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fp8_parity.json"), help="the losses' JSON; the PNG beside it")
    parser.add_argument("--plot", type=Path, metavar="JSON",
                        help="no run: summarise a JSON written before and plot it to --out's PNG")
    args = parser.parse_args()
    cuda_or_exit("python bench/fp8_parity.py")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.plot:
        results = json.loads(args.plot.read_text())
        print(summary(results))
        plot_if_possible(results, args.out.with_suffix(".png"))
        return
    if unknown := set(args.recipes.split(",")) - set(FP8_RECIPES):
        parser.error(f"--recipes: {', '.join(sorted(unknown))} not among {', '.join(FP8_RECIPES)}")
    if args.batch % ALIGNMENT:
        parser.error(f"--batch must be a multiple of {ALIGNMENT} (float8 matmuls over batch x tokens)")
    if args.steps < FINAL_STEPS:
        parser.error(f"--steps must be at least {FINAL_STEPS}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps, batch {args.batch}, "
          f"lr {args.lr}, seed {args.seed}", flush=True)
    results = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed, "losses": {}}
    for name in args.models.split(","):
        runs = {"bf16-pure": (None, args.seed), CONTROL: (None, args.seed + 1),
                **{f"fp8 {recipe}": (recipe, args.seed) for recipe in args.recipes.split(",")}}
        results["losses"][name] = {}
        for run, (recipe, init_seed) in runs.items():
            start = time.perf_counter()
            losses = losses_of(name, recipe, init_seed, args)
            results["losses"][name][run] = losses
            print(f"{name} {run}: first {losses[0]:.4f}, final {final(losses):.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            args.out.write_text(json.dumps(results))  # after each run: a call cut short keeps what finished
    print(f"losses: {args.out}\n\n{summary(results)}\n")
    plot_if_possible(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
