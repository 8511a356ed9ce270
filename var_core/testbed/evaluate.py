"""Evaluate the shipped ``testbed`` model: class fidelity, FID-proxy, and per-scale predictive entropy.

Usage::

    python -m var_core.testbed.evaluate --samples 256 [--batch-size 32] [--out DIR] [--weights DIR]
                                        [--cfg X --top-k K --top-p P --draw D] [--seed S] [--ref-samples N]

Generates ``--samples`` images (classes round-robin, one seed per sample) with the plain engine loop and the
testbed's ``default_sampling`` (from ``testbed.json``, overridable), then reports

* **class accuracy**: the shipped testbed classifier's top-1 agreement with the conditioning class, overall and
  per class;
* **FID-proxy**: torchmetrics ``FrechetInceptionDistance`` in the classifier's 128-d feature space
  (``ClassifierFeatureExtractor``), generated images vs. ``--ref-samples`` held-out real images; and the
  **floor**: the same distance for as many *real training* images as there are generated ones (what a perfect
  generator would score at this sample size);
* **per-scale predictive entropy** of the baseline sampler (softmax of the guided logits the sampler sees,
  before top-k/top-p; nats): per-token mean and per-scale total, with the spread over classes. Plotted with
  seaborn (``entropy.png``) and saved as JSON (``entropy.json``).

``DIR`` receives ``metrics.json``, ``entropy.json``, ``entropy.png`` and ``samples.png``. The last line printed is
``class_accuracy=… fid_proxy=… fid_floor=… seconds=…`` (seconds: wall time of the whole evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..engine import GenerationOptions, SamplingConfig, generate
from ..engine.sampling import DRAWS
from ..zoo import TESTBED_FOLDERS, load_model, read_testbed_card, testbed_folder
from .classifier import ClassifierFeatureExtractor, load_classifier
from .data import CLASS_NAMES, NUM_CLASSES, make_tensor_dataset


def default_sampling(weights: str | Path | None = None, model: str = "testbed") -> SamplingConfig:
    """The testbed's default sampling setting (``testbed.json`` → ``default_sampling``)."""
    card = read_testbed_card(testbed_folder(model, weights))
    return SamplingConfig(**(card.get("default_sampling") or {}))


@torch.no_grad()
def _entropy_per_scale(result) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` per-token mean and ``[B, S]`` per-scale total entropy (nats) of the guided distributions."""
    means, totals = [], []
    for rec in result.records:
        logp = torch.log_softmax(rec.guided_logits_BNV.float(), dim=-1)
        h_BN = -(logp.exp() * logp).sum(-1)
        means.append(h_BN.mean(1))
        totals.append(h_BN.sum(1))
    return torch.stack(means, 1), torch.stack(totals, 1)


@torch.no_grad()
def generate_samples(adapter, n: int, batch_size: int, sampling: SamplingConfig, seed: int = 0):
    """Generate ``n`` images (labels ``i % 10``, seeds ``seed·10⁶ + i``): images [n,3,H,W] in [0,1], labels,
    per-token-mean and total entropy ``[n, S]``, generation seconds."""
    labels = torch.arange(n) % NUM_CLASSES
    images, ent_mean, ent_total = [], [], []
    opts = GenerationOptions(keep_raw_logits=False)
    t0 = time.perf_counter()
    for i in range(0, n, batch_size):
        lab = labels[i : i + batch_size]
        seeds = [seed * 1_000_000 + j for j in range(i, i + lab.numel())]
        res = generate(adapter, lab, seeds=seeds, sampling=sampling, options=opts)
        images.append(res.images.float().cpu())
        m, t = _entropy_per_scale(res)
        ent_mean.append(m)
        ent_total.append(t)
    return torch.cat(images), labels, torch.cat(ent_mean), torch.cat(ent_total), time.perf_counter() - t0


@torch.no_grad()
def time_generation(adapter, sampling: SamplingConfig, n: int = 16, repeats: int = 3) -> float:
    """Best-of-``repeats`` wall time to generate ``n`` images in one batch (after one warm-up)."""
    labels = torch.arange(n) % NUM_CLASSES
    opts = GenerationOptions(keep_raw_logits=False)
    generate(adapter, labels, seeds=list(range(n)), sampling=sampling, options=opts)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(adapter, labels, seeds=list(range(n)), sampling=sampling, options=opts)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def class_accuracy(classifier, images01: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[float]]:
    pred = classifier.predict(images01 * 2 - 1)
    correct = (pred == labels).float()
    per_class = [float(correct[labels == c].mean()) if (labels == c).any() else float("nan")
                 for c in range(NUM_CLASSES)]
    return float(correct.mean()), per_class


@torch.no_grad()
def fid_scores(classifier, generated01: torch.Tensor, n_ref: int, data_seed: int = 0,
               batch_size: int = 256) -> tuple[float, float]:
    """(FID-proxy generated vs held-out, floor: train real vs held-out), both with ``len(generated01)`` fakes."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    fid = FrechetInceptionDistance(feature=ClassifierFeatureExtractor(classifier), normalize=True,
                                   reset_real_features=False)
    ref, _ = make_tensor_dataset("heldout", n_ref, seed=data_seed)
    for i in range(0, n_ref, batch_size):
        fid.update((ref[i : i + batch_size] + 1) / 2, real=True)
    for i in range(0, generated01.shape[0], batch_size):
        fid.update(generated01[i : i + batch_size], real=False)
    proxy = float(fid.compute())
    fid.reset()
    train, _ = make_tensor_dataset("train", generated01.shape[0], seed=data_seed)
    for i in range(0, train.shape[0], batch_size):
        fid.update((train[i : i + batch_size] + 1) / 2, real=False)
    floor = float(fid.compute())
    return proxy, floor


def entropy_summary(ent_mean: torch.Tensor, ent_total: torch.Tensor, labels: torch.Tensor,
                    patch_nums) -> dict:
    """Per scale: overall mean/std over samples and per-class means with their spread (std/min/max)."""
    out = {"unit": "nats", "patch_nums": list(patch_nums), "class_names": list(CLASS_NAMES), "scales": []}
    for si, pn in enumerate(patch_nums):
        row = {"scale": si, "pn": int(pn), "tokens": int(pn * pn)}
        for key, ent in (("per_token_mean", ent_mean), ("total", ent_total)):
            col = ent[:, si]
            per_class = [float(col[labels == c].mean()) for c in range(NUM_CLASSES)]
            pc = torch.tensor(per_class)
            row[key] = {
                "mean": float(col.mean()), "std_over_samples": float(col.std()),
                "per_class": per_class, "class_std": float(pc.std()), "class_min": float(pc.min()),
                "class_max": float(pc.max()),
            }
        out["scales"].append(row)
    return out


def plot_entropy(ent_mean: torch.Tensor, ent_total: torch.Tensor, labels: torch.Tensor, patch_nums,
                 path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = []
    for i in range(ent_mean.shape[0]):
        for si, pn in enumerate(patch_nums):
            rows.append({"scale": f"{si}\n{pn}x{pn}", "si": si, "class": CLASS_NAMES[int(labels[i])],
                         "per-token entropy (nats)": float(ent_mean[i, si]),
                         "scale total entropy (nats)": float(ent_total[i, si])})
    df = pd.DataFrame(rows)
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    palette = sns.color_palette("tab10", NUM_CLASSES)
    for ax, col in zip(axes, ("per-token entropy (nats)", "scale total entropy (nats)")):
        sns.lineplot(data=df, x="si", y=col, hue="class", hue_order=list(CLASS_NAMES), palette=palette,
                     errorbar=None, ax=ax, linewidth=1.0, alpha=0.85)
        sns.lineplot(data=df, x="si", y=col, color="black", errorbar=("pi", 50), ax=ax, linewidth=2.2,
                     label="all classes (mean; band: 25-75th pct.)")
        ax.set_xticks(range(len(patch_nums)))
        ax.set_xticklabels([f"{si}\n{pn}x{pn}" for si, pn in enumerate(patch_nums)])
        ax.set_xlabel("scale (index, token map)")
        ax.set_ylabel(col)
    axes[1].set_yscale("log")
    axes[0].get_legend().remove()
    axes[1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title or "testbed baseline: predictive entropy per scale")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_sample_grid(images01: torch.Tensor, labels: torch.Tensor, path: Path, per_class: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(NUM_CLASSES, per_class, figsize=(per_class * 0.9 + 1.4, NUM_CLASSES * 0.95),
                             squeeze=False)
    for c in range(NUM_CLASSES):
        idx = (labels == c).nonzero().flatten()[:per_class]
        for j in range(per_class):
            ax = axes[c, j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j < idx.numel():
                ax.imshow(images01[idx[j]].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
        axes[c, 0].set_ylabel(CLASS_NAMES[c], fontsize=7, rotation=0, ha="right", va="center")
    fig.tight_layout(pad=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate(samples: int = 256, batch_size: int = 32, out: Path | None = None, weights: str | Path | None = None,
             sampling: SamplingConfig | None = None, seed: int = 0, ref_samples: int | None = None,
             plots: bool = True, timing: bool = True, model: str = "testbed") -> dict:
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    adapter = load_model(model, weights=weights)
    load_seconds = time.perf_counter() - t0
    sampling = sampling or default_sampling(weights, model)
    images, labels, ent_mean, ent_total, gen_seconds = generate_samples(adapter, samples, batch_size, sampling, seed)
    classifier = load_classifier()
    acc, per_class = class_accuracy(classifier, images, labels)
    n_ref = ref_samples if ref_samples is not None else max(1000, samples)
    fid_proxy, fid_floor = fid_scores(classifier, images, n_ref)
    patch_nums = adapter.cfg.patch_nums
    entropy = entropy_summary(ent_mean, ent_total, labels, patch_nums)
    gen16 = time_generation(adapter, sampling) if timing else None
    metrics = {
        "model": model, "samples": samples, "batch_size": batch_size, "seed": seed, "ref_samples": n_ref,
        "sampling": {"cfg": sampling.cfg, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "draw": sampling.draw},
        "class_accuracy": acc,
        "class_accuracy_per_class": dict(zip(CLASS_NAMES, per_class)),
        "fid_proxy": fid_proxy, "fid_floor": fid_floor,
        "load_seconds": load_seconds, "generation_seconds": gen_seconds,
        "generation_seconds_16_images": gen16, "torch_threads": torch.get_num_threads(),
        "entropy_per_token_mean_by_scale": [s["per_token_mean"]["mean"] for s in entropy["scales"]],
        "entropy_total_by_scale": [s["total"]["mean"] for s in entropy["scales"]],
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if plots:
            plot_entropy(ent_mean, ent_total, labels, patch_nums, out / "entropy.png",
                         f"testbed baseline (cfg={sampling.cfg}, top_k={sampling.top_k}, top_p={sampling.top_p}, "
                         f"{samples} samples): predictive entropy per scale")
            save_sample_grid(images, labels, out / "samples.png")
        (out / "entropy.json").write_text(json.dumps(entropy, indent=2) + "\n")
    metrics["seconds"] = time.perf_counter() - t_start
    if out is not None:
        (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m var_core.testbed.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("testbed_eval"), help="output folder (JSON, PNG)")
    p.add_argument("--model", choices=tuple(TESTBED_FOLDERS), default="testbed",
                   help="which shipped testbed (default: testbed, depth 8 width 256)")
    p.add_argument("--weights", type=Path, default=None, help="testbed folder (default: the model's shipped weights)")
    p.add_argument("--cfg", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--draw", choices=DRAWS, default=None,
                   help="per-sample token draw (default: multinomial, the official sampler's; inverse_cdf: one uniform per "
                        "token over the top-k survivors, cheaper, less tightly coupled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref-samples", type=int, default=None, help="held-out reference images (default max(1000, N))")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-timing", action="store_true", help="skip the 16-image generation timing")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = default_sampling(args.weights, args.model)
    sampling = SamplingConfig(
        cfg=base.cfg if args.cfg is None else args.cfg,
        top_k=base.top_k if args.top_k is None else args.top_k,
        top_p=base.top_p if args.top_p is None else args.top_p,
        draw=base.draw if args.draw is None else args.draw,
    )
    m = evaluate(args.samples, args.batch_size, args.out, args.weights, sampling, args.seed, args.ref_samples,
                 plots=not args.no_plots, timing=not args.no_timing, model=args.model)
    per_class = " ".join(f"{k}={v:.2f}" for k, v in m["class_accuracy_per_class"].items())
    print(f"per-class accuracy: {per_class}")
    print("entropy per token by scale (nats): " + " ".join(f"{v:.2f}" for v in m["entropy_per_token_mean_by_scale"]))
    if m["generation_seconds_16_images"] is not None:
        print(f"load {m['load_seconds']:.2f}s, 16 images in {m['generation_seconds_16_images']:.2f}s")
    print(f"class_accuracy={m['class_accuracy']:.4f} fid_proxy={m['fid_proxy']:.3f} fid_floor={m['fid_floor']:.3f} "
          f"seconds={m['seconds']:.1f}")
    return 0


if __name__ == "__main__":
    from ..errors import run_command  # user errors in one line (exit 2), Ctrl-C exit 130

    sys.exit(run_command(main))
