"""Train the testbed classifier (CPU, Lightning, deterministic).

Usage::

    nice -n 10 python -m var_core.testbed.train_classifier \\
        --out-dir var_core/testbed/weights --steps 600 --seed 0

Writes ``classifier.safetensors`` (fp32 weights; the architecture config is in
the safetensors metadata) and ``classifier.json`` (held-out accuracy overall
and per class, training time, sizes, versions).

Design notes
------------
* Data: ``n_train`` procedural training images are materialised once as uint8
  (a quarter of the float32 memory) and converted per batch; held-out
  accuracy is measured on the first ``n_heldout`` samples of the independent
  ``"heldout"`` stream.
* Augmentation is light and chosen for what the classifier will be used on --
  *generated* images: dihedral flips (every class is orientation-agnostic),
  small brightness/contrast jitter, additive noise, and a down/up-sampling
  blur that mimics the softness of a VAR decoded from coarse token maps.  No
  hue jitter: palette is a legitimate class cue.
* Determinism: ``seed_everything(seed)``, ``Trainer(deterministic=True)``,
  a seeded shuffling generator and no worker processes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from var_core.testbed.classifier import WEIGHTS_FILE, TestbedClassifier, classifier_accuracy
from var_core.testbed.data import CLASS_NAMES, GENERATOR_VERSION, NUM_CLASSES, make_tensor_dataset

__all__ = ["ClassifierModule", "augment", "train_classifier"]


def _u8_to_pm1(x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(127.5).sub_(1.0)


def augment(x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Light batch augmentation of ``[N,3,H,W]`` images in ``[-1, 1]``."""
    n = x.shape[0]

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    # dihedral group: random h-flip, v-flip, transpose
    m = rand(n) < 0.5
    x = torch.where(m[:, None, None, None], x.flip(-1), x)
    m = rand(n) < 0.5
    x = torch.where(m[:, None, None, None], x.flip(-2), x)
    m = rand(n) < 0.5
    x = torch.where(m[:, None, None, None], x.transpose(-1, -2), x)
    # down/up-sampling blur on ~30 % (soft, VAR-like renderings)
    m = rand(n) < 0.3
    if m.any():
        h, w = x.shape[-2:]
        f = 2 if rand(1).item() < 0.6 else 4
        soft = F.interpolate(F.avg_pool2d(x[m], f), size=(h, w), mode="bilinear", align_corners=False)
        x = x.clone()
        x[m] = soft
    # brightness / contrast jitter (around the per-image mean)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    contrast = 1.0 + (rand(n, 1, 1, 1) - 0.5) * 0.2
    bright = (rand(n, 1, 1, 1) - 0.5) * 0.12
    x = (x - mean) * contrast + mean + bright
    # additive Gaussian noise on ~half
    sigma = rand(n, 1, 1, 1) * 0.04 * (rand(n, 1, 1, 1) < 0.5)
    x = x + sigma * torch.randn(x.shape, generator=gen)
    return x.clamp_(-1.0, 1.0)


class ClassifierModule(pl.LightningModule):
    """LightningModule wrapping :class:`TestbedClassifier` (AdamW + warmup/cosine)."""

    def __init__(self, lr: float = 3e-3, weight_decay: float = 5e-4, steps: int = 600, warmup: int = 50,
                 label_smoothing: float = 0.05, widths: tuple[int, ...] = (24, 32, 48, 64, 96, 128)):
        super().__init__()
        self.save_hyperparameters()
        self.model = TestbedClassifier(NUM_CLASSES, widths=tuple(widths))

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = augment(_u8_to_pm1(x))
        logits = self.model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        acc = (logits.argmax(1) == y).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", acc, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.dim() > 1 else no_decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        total, warm = self.hparams.steps, self.hparams.warmup

        def lr_lambda(step):
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train_classifier(
    out_dir: str | Path,
    steps: int = 600,
    seed: int = 0,
    batch_size: int = 128,
    n_train: int = 12_000,
    n_heldout: int = 2_000,
    lr: float = 3e-3,
    data_seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> dict:
    """Train, evaluate on held-out data, save weights + JSON; return the JSON dict."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(seed, workers=True, verbose=False)

    t0 = time.time()
    x_tr, y_tr = make_tensor_dataset("train", n_train, seed=data_seed, cache_dir=cache_dir, dtype=torch.uint8)
    x_ho, y_ho = make_tensor_dataset("heldout", n_heldout, seed=data_seed, cache_dir=cache_dir)
    t_data = time.time() - t0

    loader = DataLoader(
        TensorDataset(x_tr, y_tr),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(seed),
    )
    module = ClassifierModule(lr=lr, steps=steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        default_root_dir=str(out_dir),
    )
    t1, c1 = time.time(), time.process_time()
    trainer.fit(module, loader)
    t_train, c_train = time.time() - t1, time.process_time() - c1

    model = module.model.eval()
    acc = classifier_accuracy(model, x_ho, y_ho)
    pred = model.predict(x_ho)
    per_class = {CLASS_NAMES[c]: float((pred[y_ho == c] == c).float().mean()) for c in range(NUM_CLASSES)}
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long)
    confusion.index_put_((y_ho, pred), torch.ones_like(y_ho), accumulate=True)

    config = {"num_classes": NUM_CLASSES, "widths": list(model.widths), "image_size": model.image_size}
    wpath = out_dir / WEIGHTS_FILE
    state = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    save_file(state, str(wpath), metadata={"config": json.dumps(config), "heldout_accuracy": f"{acc:.5f}"})
    wpath.chmod(0o644)  # safetensors writes 0600; the weights are meant to be shipped

    info = {
        "heldout_accuracy": acc,
        "heldout_per_class_accuracy": per_class,
        "heldout_confusion": confusion.tolist(),
        "n_heldout": n_heldout,
        "n_train_images": n_train,
        "train_steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "data_seed": data_seed,
        "data_generation_s": round(t_data, 2),
        "train_time_s": round(t_train, 2),
        # process CPU time (all threads): less sensitive than wall time to other
        # jobs competing for the same cores
        "train_cpu_time_s": round(c_train, 2),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": wpath.stat().st_size,
        "config": config,
        "class_names": list(CLASS_NAMES),
        "dataset_generator_version": GENERATOR_VERSION,
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    (out_dir / "classifier.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "weights"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--n-train", type=int, default=12_000)
    p.add_argument("--n-heldout", type=int, default=2_000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    info = train_classifier(a.out_dir, a.steps, a.seed, a.batch_size, a.n_train, a.n_heldout, a.lr,
                            cache_dir=a.cache_dir, progress=a.progress)
    print(json.dumps({k: info[k] for k in ("heldout_accuracy", "heldout_per_class_accuracy", "train_time_s",
                                           "num_parameters", "weights_bytes")}, indent=2))


if __name__ == "__main__":
    main()
