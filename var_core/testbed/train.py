"""Train the project's default model, the ``testbed`` VAR + VQVAE, on the procedural testbed dataset.

Usage::

    python -m var_core.testbed.train vqvae --out DIR [--max-minutes M] [--seed S] [--resume]
    python -m var_core.testbed.train var   --out DIR [--max-minutes M] [--seed S] [--resume]
    python -m var_core.testbed.train all   --out DIR [--vqvae-minutes M1] [--var-minutes M2] ...
    python -m var_core.testbed.train export --out DIR [--metrics eval.json] [--dest var_core/testbed/weights]

Stages
------
``vqvae``
    A small 4x-downsampling VQVAE (official module layout, ``var_core.models.vqvae.VQVAE``) on 64-px images:
    loss = L1 + L2 reconstruction + the quantizer's VQ loss (commitment + codebook). The codebook is initialised
    from encoder features of the first batch, and rarely used codes are re-initialised from encoder features
    (``quantize.restart_dead_codes``) during the first part of training. Writes ``DIR/vqvae.safetensors`` and
    ``DIR/vqvae.json``.
``var``
    The class-conditional VAR transformer, teacher-forced on the token maps of the frozen VQVAE. Token maps of
    the training images are computed once and cached (``DIR/cache``). CE loss over all 680 tokens, AdamW,
    linear warmup + cosine decay, label dropout (``cond_drop_rate``) for classifier-free guidance, bf16 autocast
    on the CPU. Writes ``DIR/var.safetensors`` and ``DIR/testbed.json`` (the layout ``zoo.load_model("testbed",
    weights=DIR)`` reads).
``export``
    Copies ``DIR/{var,vqvae}.safetensors`` and ``DIR/testbed.json`` to the shipped location
    (``var_core/testbed/weights``), optionally merging an ``evaluate`` result JSON into the card under "metrics".

Both training stages are Lightning ``LightningModule`` s, time-boxed with ``Trainer(max_time=...)`` and
check-pointed every ``--ckpt-every`` steps to ``DIR/<stage>_last.ckpt`` (official-layout weights are exported
at every checkpoint, too). ``--resume`` continues from that checkpoint; the time budget is *cumulative* over
resumed runs (Lightning's Timer state is part of the checkpoint). The run is step-exact: the LR schedule reads the
step only (a time box stops early, it never bends the curve), batch ``j`` is a function of (seed, j)
(``StepBatchSampler``), and every step reseeds the RNG from (seed, step) (label dropout, code restarts), so a
resumed run equals an uninterrupted one bit for bit. The data are a pure function of ``--data-seed``.
A checkpoint is read weights-only (``torch.load(weights_only=True)``, :func:`read_checkpoint`): a file that would
unpickle code is refused with one error line, never run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl

from ..errors import UserError
from ..models.var import VAR, VARConfig
from ..models.vqvae import VQVAE
from .data import CLASS_NAMES, NUM_CLASSES, make_tensor_dataset

SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)


# ------------------------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class VQVAETrainConfig:
    # architecture (VQVAE kwargs)
    vocab_size: int = 512
    z_channels: int = 32
    ch: int = 16
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 1
    attn_at_lowest: bool = False
    norm_groups: int = 8
    share_quant_resi: int = 4
    quant_resi: float = 0.5
    beta: float = 0.25
    patch_nums: tuple[int, ...] = PATCH_NUMS
    # data
    n_images: int = 20_000
    data_seed: int = 0
    # optimisation
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    warmup_steps: int = 50
    total_steps: int = 3000  # cosine length in steps (step-exact: a time box only stops early)
    l1_weight: float = 1.0
    l2_weight: float = 1.0
    vq_weight: float = 1.0
    grad_clip: float = 1.0
    # dead-code restarts
    restart_every: int = 25
    restart_until: float = 0.7  # training progress after which no more restarts happen
    restart_min_usage: float = 1.0  # EMA hits per batch summed over scales

    def vqvae_kwargs(self) -> dict:
        return dict(
            vocab_size=self.vocab_size, z_channels=self.z_channels, ch=self.ch, ch_mult=tuple(self.ch_mult),
            num_res_blocks=self.num_res_blocks, attn_at_lowest=self.attn_at_lowest,
            patch_nums=tuple(self.patch_nums), share_quant_resi=self.share_quant_resi,
            quant_resi=self.quant_resi, beta=self.beta, dropout=0.0, norm_groups=self.norm_groups,
        )


@dataclass
class VARTrainConfig:
    # architecture (VARConfig; vocab/z_channels/patch_nums come from the VQVAE)
    depth: int = 8  # the default testbed; testbed-small: --preset small (depth 4, width 128, 2 heads)
    embed_dim: int = 256
    num_heads: int = 4
    mlp_ratio: float = 4.0
    cond_drop_rate: float = 0.1
    # data
    n_images: int = 20_000
    data_seed: int = 0
    # optimisation
    batch_size: int = 16
    lr: float = 8e-4
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    total_steps: int = 1500
    grad_clip: float = 2.0
    label_smoothing: float = 0.0
    bf16: bool = True


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {"vqvae": {}, "var": {}},
    # testbed-small's VAR (its card: time-boxed at 68 min under the old time-coupled schedule, 2,989 steps)
    "small": {"vqvae": {}, "var": dict(depth=4, embed_dim=128, num_heads=2, total_steps=6000)},
    # a few-second configuration for tests and smoke runs
    "tiny": {
        "vqvae": dict(vocab_size=32, z_channels=8, ch=8, ch_mult=(1, 2, 2), norm_groups=4, n_images=16,
                      batch_size=4, warmup_steps=1, total_steps=4, restart_every=1, patch_nums=(1, 2, 4, 16)),
        "var": dict(depth=1, embed_dim=32, num_heads=1, n_images=16, batch_size=4, warmup_steps=1, total_steps=4),
    },
}


def _lr_factor(step: int, progress: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    t = min(1.0, max(0.0, progress))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class _ScheduledModule(pl.LightningModule):
    """Shared schedule logic: training progress is ``step / total_steps``, nothing else.

    The schedule is step-exact: a time box (``--max-minutes``) only stops training early, it never bends the LR
    curve, so a run resumed from its checkpoint follows the same LR trajectory as an uninterrupted one and a
    re-run with the same seed and step count reproduces it. Choose ``total_steps`` to fit the machine. The LR is
    set on every step from the config, so checkpoints need no scheduler state.
    """

    def progress(self) -> float:
        return self.global_step / max(1, self.cfg.total_steps)

    def on_train_batch_start(self, batch, batch_idx):
        torch.manual_seed(step_seed(self.seed, self.global_step))  # label dropout etc.: a function of the step
        c = self.cfg
        factor = _lr_factor(self.global_step, self.progress(), c.warmup_steps, c.min_lr_ratio)
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] = c.lr * factor
        self.log("train/lr", c.lr * factor)


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


# ------------------------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------------------------
class _Uint8Images(Dataset):
    """uint8 ``[N,3,H,W]`` images -> float ``[-1, 1]`` on access."""

    def __init__(self, images_u8: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images_u8, labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int):
        return self.images[i].float().div_(127.5).sub_(1.0), self.labels[i]


class _Tokens(Dataset):
    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor):
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int):
        return self.tokens[i].long(), self.labels[i]


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of training step ``step``: every step's randomness is a function of (seed, step) alone."""
    return (seed * 1_000_003 + step) % (2**63)


class StepBatchSampler(torch.utils.data.Sampler):
    """Batches of a seeded index stream: epoch ``e`` is ``randperm(n)`` drawn from ``step_seed(seed, e)``, the
    epochs are concatenated, and batch ``j`` is stream items ``j·B … j·B + B − 1``.

    Batch ``j`` depends on (seed, j) only, so a run resumed at step ``start`` (``start_batch``) draws exactly the
    batches an uninterrupted run draws from there. ``len`` is one epoch of whole batches; each new iteration (a
    new Lightning epoch) continues the stream where the last one stopped.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start_batch: int = 0):
        if n < batch_size:
            raise ValueError(f"{n} training items cannot fill one batch of {batch_size}")
        self.n, self.batch_size, self.seed, self.cursor = n, batch_size, seed, start_batch
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.n // self.batch_size

    def _epoch(self, e: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != e:
            self._perm = (e, torch.randperm(self.n, generator=torch.Generator().manual_seed(step_seed(self.seed, e))))
        return self._perm[1]

    def batch(self, j: int) -> list[int]:
        out = []
        for pos in range(j * self.batch_size, (j + 1) * self.batch_size):
            out.append(int(self._epoch(pos // self.n)[pos % self.n]))
        return out

    def __iter__(self):
        for _ in range(len(self)):
            j, self.cursor = self.cursor, self.cursor + 1
            yield self.batch(j)


def _loader(ds: Dataset, batch_size: int, seed: int, start_step: int = 0) -> DataLoader:
    return DataLoader(ds, batch_sampler=StepBatchSampler(len(ds), batch_size, seed, start_step), num_workers=0)


# StepBatchSampler makes mid-epoch resumption exact; Lightning cannot know that and warns on every resume
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def read_checkpoint(path: str | Path) -> dict:
    """A training checkpoint read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
    only. A file that asks the unpickler for anything else (an object whose ``__reduce__`` would run code, which is
    what a crafted ``--resume`` checkpoint would hold) is refused with a :class:`UserError` before any of it runs;
    so is a corrupt or truncated file. The checkpoints this module writes load this way (their hyper-parameters are
    JSON-ready and Lightning's own state is plain data)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"training checkpoint {path} is missing: drop --resume to start fresh") from None
    except Exception as exc:  # noqa: BLE001 - UnpicklingError (code or unknown objects), truncated zip, ...
        text = " ".join(str(exc).split())
        if "WeightsUnpickler error:" in text:
            text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0].strip()
        raise UserError(
            f"refusing training checkpoint {path}: it is corrupt or truncated, or holds objects other than tensors "
            f"and plain data (a pickle that could run code; {type(exc).__name__}: {text[:200]}). varscope never "
            f"unpickles code: delete the file and train again without --resume") from None
    if not isinstance(data, dict):
        raise UserError(f"training checkpoint {path} holds a {type(data).__name__}, not a Lightning checkpoint: "
                        f"delete it and train again without --resume")
    return data


def _checkpoint_step(path: str | None) -> int:
    """The global step stored in a Lightning checkpoint (0 without one), read weights-only (no pickled code)."""
    if path is None:
        return 0
    return int(read_checkpoint(path).get("global_step", 0))


def _train_images(n: int, data_seed: int, cache_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    return make_tensor_dataset("train", n, seed=data_seed, dtype=torch.uint8, cache_dir=cache_dir)


# ------------------------------------------------------------------------------------------------------------------
# Lightning modules
# ------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def quantizer_inputs(q, f_BChw: torch.Tensor) -> torch.Tensor:
    """``[N, Cvae]``: the vectors the quantizer looks up at every scale (the residual ``f - f_hat_{si-1}`` resized
    to scale ``si``), i.e. the distribution that codewords must cover. Restarting dead codes from these (instead
    of from the raw features, which only match the first scales) keeps restarted codes in use."""
    fhat_list = q.f_to_fhat_list(f_BChw)
    C = f_BChw.shape[1]
    out = []
    for si, pn in enumerate(q.patch_nums):
        rest = f_BChw if si == 0 else f_BChw - fhat_list[si - 1]
        z = F.interpolate(rest, size=(pn, pn), mode="area") if si != len(q.patch_nums) - 1 else rest
        out.append(z.permute(0, 2, 3, 1).reshape(-1, C))
    return torch.cat(out)


class VQVAEModule(_ScheduledModule):
    def __init__(self, cfg: VQVAETrainConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.save_hyperparameters({"cfg": _jsonable(asdict(cfg)), "seed": seed})
        self.vae = VQVAE(**cfg.vqvae_kwargs())
        self.n_restarted = 0

    def configure_optimizers(self):
        c = self.cfg
        return torch.optim.AdamW(self.vae.parameters(), lr=c.lr, betas=(0.9, 0.99), weight_decay=c.weight_decay)

    def training_step(self, batch, batch_idx):
        img, _ = batch
        c = self.cfg
        q = self.vae.quantize
        step = self.global_step
        restart_gen = torch.Generator().manual_seed(step_seed(self.seed + 1, step))
        f = self.vae.encode_features(img)
        if step == 0 and q.record_hit == 0 and not getattr(self, "_codebook_initialised", False):
            # data-dependent codebook initialisation: every code starts as an encoder feature vector
            q.restart_dead_codes(f.detach(), min_usage=1.0, usage_V=torch.zeros(c.vocab_size), generator=restart_gen)
            self._codebook_initialised = True
        f_hat, vq_loss, stats = q(f)
        recon = self.vae.decoder(self.vae.post_quant_conv(f_hat))
        l1 = (recon - img).abs().mean()
        l2 = F.mse_loss(recon, img)
        loss = c.l1_weight * l1 + c.l2_weight * l2 + c.vq_weight * vq_loss
        if c.restart_every and step > 0 and step % c.restart_every == 0 and self.progress() < c.restart_until \
                and q.record_hit >= 10:
            n = q.restart_dead_codes(quantizer_inputs(q, f.detach()), min_usage=c.restart_min_usage,
                                     generator=restart_gen)
            self.n_restarted += n
            self.log("train/restarted", float(n))
        with torch.no_grad():
            psnr = -10 * torch.log10(F.mse_loss(recon.clamp(-1, 1), img) / 4.0)
        self.log_dict({"train/loss": loss.detach(), "train/l1": l1.detach(), "train/l2": l2.detach(),
                       "train/vq": vq_loss.detach(), "train/psnr": psnr, "train/usage": stats["usage"]},
                      prog_bar=False)
        return loss


class VARModule(_ScheduledModule):
    def __init__(self, cfg: VARTrainConfig, vqvae_config: dict, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.save_hyperparameters({"cfg": _jsonable(asdict(cfg)), "vqvae_config": vqvae_config, "seed": seed})
        self.var_config = VARConfig(
            vocab_size=vqvae_config["vocab_size"], z_channels=vqvae_config["z_channels"], num_classes=NUM_CLASSES,
            depth=cfg.depth, embed_dim=cfg.embed_dim, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio,
            patch_nums=tuple(vqvae_config["patch_nums"]), cond_drop_rate=cfg.cond_drop_rate,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.var = VAR(self.var_config)
            self.var.init_weights()
        # the frozen VQVAE is only needed for the teacher-forcing input; it is not part of this module's state
        self._vae: list[VQVAE] = []

    def attach_vqvae(self, vae: VQVAE) -> None:
        self._vae = [vae.eval().requires_grad_(False)]

    @property
    def vae(self) -> VQVAE:
        return self._vae[0]

    def configure_optimizers(self):
        c = self.cfg
        decay, no_decay = [], []
        for name, p in self.var.named_parameters():
            (decay if p.ndim >= 2 and "pos_" not in name and "emb" not in name else no_decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=tuple(c.betas))
        return opt

    def teacher_input(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        pn = self.var_config.patch_nums
        idx_list = list(torch.split(tokens_BL, [p * p for p in pn], dim=1))
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return self.vae.quantize.idx_list_to_var_input(idx_list)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        x = self.teacher_input(tokens)
        logits = self.var(labels, x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1),
                               label_smoothing=self.cfg.label_smoothing)
        with torch.no_grad():
            acc = (logits.argmax(-1) == tokens).float().mean()
        self.log_dict({"train/loss": loss.detach(), "train/acc": acc}, prog_bar=False)
        return loss


# ------------------------------------------------------------------------------------------------------------------
# export (official-layout safetensors + testbed.json)
# ------------------------------------------------------------------------------------------------------------------
def _save_safetensors(module: torch.nn.Module, path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(sd, str(tmp), metadata={k: str(v) for k, v in (metadata or {}).items()})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


DEFAULT_SAMPLING = {"cfg": 1.5, "top_k": 100, "top_p": 0.95}  # chosen by a sweep on the shipped model (MODEL_CARD)


def export_vqvae(module: VQVAEModule, out: Path, extra: dict | None = None) -> None:
    _save_safetensors(module.vae, out / "vqvae.safetensors")
    _write_json(out / "vqvae.json", {"vqvae_config": module.vae.config, **(extra or {})})


def export_var(module: VARModule, out: Path, extra: dict | None = None) -> None:
    _save_safetensors(module.var, out / "var.safetensors")
    card_path = out / "testbed.json"
    previous = json.loads(card_path.read_text()) if card_path.exists() else {}
    vq_meta = json.loads((out / "vqvae.json").read_text())
    card = {
        "name": "testbed",
        "var_config": module.var_config.to_dict(),
        "vqvae_config": vq_meta["vqvae_config"],
        "default_sampling": previous.get("default_sampling", DEFAULT_SAMPLING),
        "class_names": list(CLASS_NAMES),
        "image_size": int(vq_meta["vqvae_config"]["patch_nums"][-1] * 2 ** (len(vq_meta["vqvae_config"]["ch_mult"]) - 1)),
        "training": {"vqvae": vq_meta.get("training", {}), "var": (extra or {}).get("training", {})},
    }
    for k in ("metrics",):
        if k in previous:
            card[k] = previous[k]
    _write_json(card_path, card)


class _CheckpointAndExport(pl.Callback):
    """Every ``every`` steps and at the end: a resumable Lightning checkpoint + the official-layout export."""

    def __init__(self, out: Path, stage: str, every: int, meta_fn):
        self.out, self.stage, self.every, self.meta_fn = out, stage, every, meta_fn
        self.t0 = time.time()

    @property
    def ckpt_path(self) -> Path:
        return self.out / f"{self.stage}_last.ckpt"

    def _save(self, trainer: pl.Trainer, module) -> None:
        tmp = self.out / f"{self.stage}_last.ckpt.tmp"
        trainer.save_checkpoint(str(tmp))
        os.replace(tmp, self.ckpt_path)
        extra = {"training": self.meta_fn(trainer, module)}
        (export_vqvae if self.stage == "vqvae" else export_var)(module, self.out, extra)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0 and step > 0:
            self._save(trainer, module)
            m = trainer.callback_metrics
            msg = " ".join(f"{k.split('/')[-1]}={float(v):.4g}" for k, v in sorted(m.items()))
            print(f"[{self.stage}] step {step} {time.time() - self.t0:.0f}s {msg}", flush=True)

    def on_train_end(self, trainer, module):
        self._save(trainer, module)
        print(f"[{self.stage}] finished at step {trainer.global_step}; exported to {self.out}", flush=True)


class _Progress(pl.Callback):
    def __init__(self, stage: str, every: int = 50):
        self.stage, self.every = stage, every
        self.t0 = None

    def on_train_start(self, trainer, module):
        self.t0 = time.time()
        self.step0 = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0:
            rate = (step - self.step0) / max(1e-9, time.time() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            print(f"[{self.stage}] step {step} loss {float(loss) if loss is not None else float('nan'):.4f} "
                  f"{rate:.2f} it/s", flush=True)


def _make_trainer(out: Path, stage: str, max_minutes: float | None, max_steps: int, ckpt_every: int, grad_clip: float,
                  precision: str, meta_fn, log_every: int = 50) -> tuple[pl.Trainer, _CheckpointAndExport]:
    from lightning.pytorch.loggers import CSVLogger

    ckpt_cb = _CheckpointAndExport(out, stage, ckpt_every, meta_fn)
    max_time = None
    if max_minutes is not None:
        secs = int(round(max_minutes * 60))
        max_time = {"days": 0, "hours": secs // 3600, "minutes": (secs % 3600) // 60, "seconds": secs % 60}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=max_steps, max_epochs=-1, max_time=max_time,
        gradient_clip_val=grad_clip or None, logger=CSVLogger(str(out), name=f"{stage}_logs"),
        callbacks=[ckpt_cb, _Progress(stage, log_every)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=max(1, min(log_every, 50)), num_sanity_val_steps=0,
        deterministic=False,
    )
    return trainer, ckpt_cb


def _resume_path(out: Path, stage: str, resume: bool) -> str | None:
    p = out / f"{stage}_last.ckpt"
    if resume and p.exists():
        print(f"[{stage}] resuming from {p}", flush=True)
        return str(p)
    if resume:
        print(f"[{stage}] --resume given but no checkpoint at {p}; starting fresh", flush=True)
    return None


# ------------------------------------------------------------------------------------------------------------------
# stages
# ------------------------------------------------------------------------------------------------------------------
def train_vqvae(out: Path, cfg: VQVAETrainConfig, seed: int = 0, max_minutes: float | None = None,
                resume: bool = False, ckpt_every: int = 250, cache: bool = True, max_steps: int | None = None,
                log_every: int = 50) -> VQVAEModule:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(seed, workers=True, verbose=False)
    t_data = time.time()
    images, labels = _train_images(cfg.n_images, cfg.data_seed, out / "cache" if cache else None)
    print(f"[vqvae] {images.shape[0]} training images ready in {time.time() - t_data:.1f}s", flush=True)
    module = VQVAEModule(cfg, seed)
    t0 = time.time()

    def meta(trainer, m):
        return {"seed": seed, "steps": trainer.global_step, "config": _jsonable(asdict(cfg)),
                "wall_seconds_this_run": round(time.time() - t0, 1),
                "codes_restarted_this_run": m.n_restarted, "torch": torch.__version__,
                "threads": torch.get_num_threads()}

    trainer, _ = _make_trainer(out, "vqvae", max_minutes, max_steps or cfg.total_steps, ckpt_every, cfg.grad_clip,
                               "32-true", meta, log_every)
    ckpt = _resume_path(out, "vqvae", resume)
    trainer.fit(module, _loader(_Uint8Images(images, labels), cfg.batch_size, seed, _checkpoint_step(ckpt)),
                ckpt_path=ckpt, weights_only=True)  # Lightning's load: no pickled code either
    return module


def _load_vqvae(out: Path) -> VQVAE:
    from safetensors.torch import load_file

    meta = json.loads((out / "vqvae.json").read_text())
    vae = VQVAE.from_config(meta["vqvae_config"])
    vae.load_state_dict(load_file(str(out / "vqvae.safetensors")), strict=True)
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_tokens(vae: VQVAE, images_u8: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Concatenated token maps ``[N, L]`` (int16) of uint8 images."""
    out = []
    for i in range(0, images_u8.shape[0], batch_size):
        x = images_u8[i : i + batch_size].float().div_(127.5).sub_(1.0)
        out.append(torch.cat(vae.img_to_idx_list(x), dim=1).to(torch.int16))
    return torch.cat(out)


def _token_cache(out: Path, vae: VQVAE, cfg: VARTrainConfig, cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import hashlib

    digest = hashlib.sha1((out / "vqvae.safetensors").read_bytes()).hexdigest()[:10]
    path = out / "cache" / f"tokens_n{cfg.n_images}_s{cfg.data_seed}_vq{digest}.pt"
    if cache and path.exists():
        blob = torch.load(path, weights_only=True)
        return blob["tokens"], blob["labels"]
    t0 = time.time()
    images, labels = _train_images(cfg.n_images, cfg.data_seed, out / "cache" if cache else None)
    tokens = encode_tokens(vae, images)
    print(f"[var] encoded {tokens.shape[0]} images into {tokens.shape[1]} tokens each in {time.time() - t0:.1f}s",
          flush=True)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": tokens, "labels": labels}, path)
    return tokens, labels


def train_var(out: Path, cfg: VARTrainConfig, seed: int = 0, max_minutes: float | None = None, resume: bool = False,
              ckpt_every: int = 250, cache: bool = True, max_steps: int | None = None, log_every: int = 50) -> VARModule:
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "vqvae.safetensors").exists():
        raise FileNotFoundError(f"{out / 'vqvae.safetensors'} missing: run the 'vqvae' stage into {out} first")
    pl.seed_everything(seed, workers=True, verbose=False)
    vae = _load_vqvae(out)
    tokens, labels = _token_cache(out, vae, cfg, cache)
    module = VARModule(cfg, vae.config, seed)
    module.attach_vqvae(vae)
    n_params = sum(p.numel() for p in module.var.parameters())
    print(f"[var] VAR depth {cfg.depth} width {cfg.embed_dim}: {n_params / 1e6:.2f} M parameters", flush=True)
    t0 = time.time()

    def meta(trainer, m):
        return {"seed": seed, "steps": trainer.global_step, "config": _jsonable(asdict(cfg)),
                "params": n_params, "wall_seconds_this_run": round(time.time() - t0, 1), "torch": torch.__version__,
                "threads": torch.get_num_threads()}

    trainer, _ = _make_trainer(out, "var", max_minutes, max_steps or cfg.total_steps, ckpt_every, cfg.grad_clip,
                               "bf16-mixed" if cfg.bf16 else "32-true", meta, log_every)
    ckpt = _resume_path(out, "var", resume)
    trainer.fit(module, _loader(_Tokens(tokens, labels), cfg.batch_size, seed, _checkpoint_step(ckpt)),
                ckpt_path=ckpt, weights_only=True)  # Lightning's load: no pickled code either
    return module


def use_shipped_vqvae(folder: Path, out: Path) -> None:
    """Put ``folder``'s VQVAE (its ``testbed.json`` card names the file) into training directory ``out``, as a
    'vqvae' stage would have left it, so the 'var' stage trains a new VAR on the same tokens."""
    card_path = Path(folder) / "testbed.json"
    if not card_path.is_file():
        raise UserError(f"--vqvae-from {folder}: no testbed.json there (a shipped testbed folder has one: "
                        f"{SHIPPED_DIR})")
    card = json.loads(card_path.read_text())
    source = (Path(folder) / card.get("vqvae_file", "vqvae.safetensors")).resolve()
    if not source.is_file():
        raise UserError(f"--vqvae-from {folder}: the VQVAE file {source} named by its card is missing")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "vqvae.safetensors").is_file() or (out / "vqvae.safetensors").read_bytes() != source.read_bytes():
        shutil.copyfile(source, out / "vqvae.safetensors")
    _write_json(out / "vqvae.json", {"vqvae_config": card["vqvae_config"],
                                     "training": (card.get("training") or {}).get("vqvae", {})})


def export_to(out: Path, dest: Path = SHIPPED_DIR, metrics: Path | None = None,
              default_sampling: dict | None = None) -> None:
    """Copy the official-layout files (and the card) from a training directory to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    card = json.loads((out / "testbed.json").read_text())
    if metrics is not None:
        card["metrics"] = json.loads(Path(metrics).read_text())
    if default_sampling is not None:
        card["default_sampling"] = default_sampling
    for name in ("var.safetensors", "vqvae.safetensors"):
        shutil.copyfile(out / name, dest / f"{name}.tmp")
        os.replace(dest / f"{name}.tmp", dest / name)
    _write_json(dest / "testbed.json", card)
    if dest.resolve() != out.resolve():
        _write_json(out / "testbed.json", card)
    size = sum((dest / n).stat().st_size for n in ("var.safetensors", "vqvae.safetensors", "testbed.json"))
    print(f"exported testbed to {dest} ({size / 1e6:.2f} MB)")


# ------------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------------
def _apply_overrides(cfg, pairs: list[str], stage: str):
    """``[stage.]key=value`` overrides (JSON values) for the fields of a stage config; an unprefixed key applies
    to every stage config that has that field."""
    names = {f.name for f in fields(cfg)}
    upd = {}
    for pair in pairs:
        k, _, v = pair.partition("=")
        prefix, dot, key = k.rpartition(".")
        if dot:
            if prefix != stage:
                continue
            k = key
        if k not in names:
            continue
        val = json.loads(v)
        upd[k] = tuple(val) if isinstance(val, list) else val
    return replace(cfg, **upd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m var_core.testbed.train", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("vqvae", "var", "all", "export"))
    p.add_argument("--out", required=True, type=Path, help="training directory (checkpoints, exports, caches)")
    p.add_argument("--max-minutes", type=float, default=None, help="time box per stage (cumulative over --resume)")
    p.add_argument("--vqvae-minutes", type=float, default=None, help="'all': time box of the VQVAE stage")
    p.add_argument("--var-minutes", type=float, default=None, help="'all': time box of the VAR stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from DIR/<stage>_last.ckpt")
    p.add_argument("--preset", choices=tuple(PRESETS), default="default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=JSON",
                   help="override a config field (e.g. --set var.total_steps=3000); repeatable")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: total_steps)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-cache", action="store_true", help="do not cache images / tokens under DIR/cache")
    p.add_argument("--dest", type=Path, default=SHIPPED_DIR, help="export: destination folder")
    p.add_argument("--metrics", type=Path, default=None, help="export: evaluate JSON to merge into the card")
    p.add_argument("--sampling", type=str, default=None, help='export: default sampling JSON, e.g. \'{"cfg": 3}\'')
    p.add_argument("--then-export", action="store_true", help="after training, copy the result to --dest")
    p.add_argument("--vqvae-from", type=Path, default=None, metavar="FOLDER",
                   help="var: start from this folder's VQVAE (a shipped testbed folder, e.g. var_core/testbed/weights)"
                        " instead of a 'vqvae' stage in --out")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out
    if args.stage == "export":
        export_to(out, args.dest, args.metrics, json.loads(args.sampling) if args.sampling else None)
        return 0
    preset = PRESETS[args.preset]
    vq_cfg = _apply_overrides(replace(VQVAETrainConfig(), **preset["vqvae"]), args.overrides, "vqvae")
    var_cfg = _apply_overrides(replace(VARTrainConfig(), **preset["var"]), args.overrides, "var")
    common = dict(seed=args.seed, resume=args.resume, ckpt_every=args.ckpt_every, cache=not args.no_cache,
                  max_steps=args.max_steps)
    if args.stage in ("vqvae", "all"):
        minutes = args.vqvae_minutes if args.stage == "all" and args.vqvae_minutes is not None else args.max_minutes
        train_vqvae(out, vq_cfg, max_minutes=minutes, **common)
    if args.vqvae_from is not None:
        if args.stage != "var":
            raise UserError("--vqvae-from goes with the 'var' stage (the 'vqvae' stage trains its own VQVAE)")
        use_shipped_vqvae(args.vqvae_from, out)
    if args.stage in ("var", "all"):
        minutes = args.var_minutes if args.stage == "all" and args.var_minutes is not None else args.max_minutes
        train_var(out, var_cfg, max_minutes=minutes, **common)
    if args.then_export:
        export_to(out, args.dest)
    return 0


if __name__ == "__main__":
    from ..errors import run_command  # user errors in one line (exit 2), Ctrl-C exit 130

    sys.exit(run_command(main))
