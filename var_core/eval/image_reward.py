"""ImageReward (Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
NeurIPS 2023): a BLIP image-text encoder and an MLP head trained on human rankings; higher is better.

Network (plain ``torch.nn``, written from BLIP's published architecture — Li et al., "BLIP", 2022, its ``vit.py`` and
``med.py`` — and the ImageReward paper; the packages ``image-reward`` / BLIP need torchvision, which does not import
beside CPU torch 2.13):

* image: BLIP's ViT (ViT-L/16 at 224 px in the release): patch convolution with bias, a class token, learned
  positions, pre-norm blocks (``LayerNorm(eps=1e-6)``, fused ``qkv`` with bias, exact GELU MLP), a final norm; every
  token is kept (``[B, 1 + (224/16)², 1024]``);
* text: BLIP's ``med`` BERT-base *with cross-attention in every layer* (no token-type embeddings, absolute
  positions, post-norm ``LayerNorm(eps=1e-12)``, self-attention masked by the padding with ``(1 − mask)·−10000``,
  then cross-attention to all image tokens, then the GELU feed-forward);
* reward: the output at the first text position through ``mlp`` (Linear 768→1024→128→64→16→1, dropouts between
  and no activation, as released), then ``(r − mean) / std`` with the release's constants
  (:data:`REWARD_MEAN`, :data:`REWARD_STD`, constants of the official code, not stored in the checkpoint).

Weights: the released ``ImageReward.pt``, a state dict whose keys are ``blip.visual_encoder.*`` (``cls_token``,
``pos_embed``, ``patch_embed.proj.*``, ``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}.*``, ``norm.*``),
``blip.text_encoder.*`` (``embeddings.{word_embeddings,position_embeddings,LayerNorm}.*``,
``encoder.layer.N.{attention,crossattention}.{self.{query,key,value},output.{dense,LayerNorm}}.*``,
``encoder.layer.N.{intermediate.dense,output.dense,output.LayerNorm}.*``) and ``mlp.layers.{0,2,4,6,7}.*``; other
``blip.*`` entries (BLIP's projection heads, ``position_ids``) are not used. Sizes are read from the tensors; the
head counts (not stored) are ``width / 64`` (16 for ViT-L, 12 for BERT-base) unless a ``med_config.json`` beside
the file (BLIP's BERT config: ``num_attention_heads``) or :class:`ImageRewardConfig` says otherwise. Tokenizer:
``bert-base-uncased`` (a local folder with its ``vocab.txt``; BLIP adds ``[DEC]`` and ``[ENC]``), prompts padded
to 35 tokens and truncated there, as the official ``score``. Images: CLIP's preprocessing at 224 px
(:func:`var_core.eval.clip_score.clip_preprocess`: bicubic resize, centre crop, OpenAI mean/std).

Knob that matters: the weights (score scales are only comparable within one checkpoint). RECONSTRUCTED:
``first_token="cls"`` feeds the tokenizer's ``[CLS]`` first as we read the official ``score`` (BLIP's own
image-text matching replaces it with ``[ENC]``; ``first_token="enc"`` selects that).

Layout on disk (``--image-reward-weights PATH``): ``PATH`` is the ``ImageReward.pt`` file or a folder holding it;
the tokenizer is looked for in ``bert-base-uncased/`` or ``tokenizer/`` beside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .metric_base import MetricUnavailable

__all__ = ["REWARD_MEAN", "REWARD_STD", "ImageRewardConfig", "ImageRewardModel", "LoadedImageReward",
           "load_image_reward", "image_reward_scores", "find_checkpoint", "WEIGHT_FILE"]

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
WEIGHT_FILE = "ImageReward.pt"
TOKENIZER_DIRS = ("bert-base-uncased", "tokenizer")


@dataclass(frozen=True)
class ImageRewardConfig:
    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_mlp: int = 4096
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_intermediate: int = 3072
    vocab_size: int = 30524
    max_positions: int = 512
    mlp_widths: tuple[int, ...] = (1024, 128, 64, 16)
    max_length: int = 35  # prompt tokens (padded and truncated), as the official score()
    reward_mean: float = REWARD_MEAN
    reward_std: float = REWARD_STD
    first_token: str = "cls"  # RECONSTRUCTED: "enc" puts BLIP's [ENC] first (its image-text matching)

    @staticmethod
    def from_state_dict(sd: dict[str, torch.Tensor], med_config: dict | None = None, **overrides
                        ) -> "ImageRewardConfig":
        """Sizes read from the tensors of an ImageReward state dict (prefixes ``blip.`` / ``mlp.``)."""
        v = "blip.visual_encoder."
        t = "blip.text_encoder."
        try:
            width = sd[v + "cls_token"].shape[-1]
            patch = sd[v + "patch_embed.proj.weight"].shape[-1]
            grid = math.isqrt(sd[v + "pos_embed"].shape[1] - 1)
            text_width = sd[t + "embeddings.word_embeddings.weight"].shape[1]
            mlp_widths = []
            k = 0
            while f"mlp.layers.{k}.weight" in sd:
                mlp_widths.append(sd[f"mlp.layers.{k}.weight"].shape[0])
                k += 1 if k >= 6 else 2  # Linear at 0, 2, 4, 6 (dropouts between), then 7
        except KeyError as exc:
            raise MetricUnavailable(f"not an ImageReward checkpoint: {exc.args[0]!r} is missing (expected the "
                                    f"released ImageReward.pt layout: blip.visual_encoder.*, blip.text_encoder.*, "
                                    f"mlp.layers.*)") from None
        med = med_config or {}
        cfg = ImageRewardConfig(
            image_size=grid * patch, patch_size=patch, vision_width=width,
            vision_layers=_count(sd, v + "blocks."), vision_heads=max(1, width // 64),
            vision_mlp=sd[v + "blocks.0.mlp.fc1.weight"].shape[0], text_width=text_width,
            text_layers=_count(sd, t + "encoder.layer."),
            text_heads=int(med.get("num_attention_heads", max(1, text_width // 64))),
            text_intermediate=sd[t + "encoder.layer.0.intermediate.dense.weight"].shape[0],
            vocab_size=sd[t + "embeddings.word_embeddings.weight"].shape[0],
            max_positions=sd[t + "embeddings.position_embeddings.weight"].shape[0],
            mlp_widths=tuple(mlp_widths[:-1]))
        return replace(cfg, **overrides)


def _count(sd: dict, prefix: str) -> int:
    return len({k[len(prefix):].split(".", 1)[0] for k in sd if k.startswith(prefix)})


# ----- BLIP ViT ----------------------------------------------------------------------------------------------
class _PatchEmbed(nn.Module):
    def __init__(self, patch: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class _ViTAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        out = attn.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class _ViTMlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _ViTBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _ViTAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = _ViTMlp(width, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class BlipVisionEncoder(nn.Module):
    """BLIP's ViT: every output token, ``[B, 1 + grid², width]``."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        grid = cfg.image_size // cfg.patch_size
        self.patch_embed = _PatchEmbed(cfg.patch_size, cfg.vision_width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.vision_width))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, cfg.vision_width))
        self.blocks = nn.ModuleList(_ViTBlock(cfg.vision_width, cfg.vision_heads, cfg.vision_mlp)
                                    for _ in range(cfg.vision_layers))
        self.norm = nn.LayerNorm(cfg.vision_width, eps=1e-6)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, :x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# ----- BLIP med BERT with cross-attention ------------------------------------------------------------------
class _SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, kv_width: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(kv_width, width)
        self.value = nn.Linear(kv_width, width)

    def _split(self, x):
        B, N, C = x.shape
        return x.view(B, N, self.heads, C // self.heads).transpose(1, 2)

    def forward(self, x, context, additive_mask):
        q, k, v = self._split(self.query(x)), self._split(self.key(context)), self._split(self.value(context))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if additive_mask is not None:
            scores = scores + additive_mask
        out = scores.softmax(-1) @ v
        return out.transpose(1, 2).reshape(x.shape)


class _SelfOutput(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12)

    def forward(self, h, residual):
        return self.LayerNorm(self.dense(h) + residual)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_width: int):
        super().__init__()
        self.self = _SelfAttention(width, heads, kv_width)
        self.output = _SelfOutput(width)

    def forward(self, x, context, additive_mask):
        return self.output(self.self(x, context, additive_mask), x)


class _Intermediate(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.dense = nn.Linear(width, hidden)

    def forward(self, x):
        return F.gelu(self.dense(x))


class _Output(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.dense = nn.Linear(hidden, width)
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12)

    def forward(self, h, residual):
        return self.LayerNorm(self.dense(h) + residual)


class _BertLayer(nn.Module):
    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.attention = _Attention(cfg.text_width, cfg.text_heads, cfg.text_width)
        self.crossattention = _Attention(cfg.text_width, cfg.text_heads, cfg.vision_width)
        self.intermediate = _Intermediate(cfg.text_width, cfg.text_intermediate)
        self.output = _Output(cfg.text_intermediate, cfg.text_width)

    def forward(self, x, text_mask, image_tokens):
        x = self.attention(x, x, text_mask)
        x = self.crossattention(x, image_tokens, None)  # every image token is valid
        return self.output(self.intermediate(x), x)


class _Embeddings(nn.Module):
    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.text_width)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.text_width)
        self.LayerNorm = nn.LayerNorm(cfg.text_width, eps=1e-12)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(pos)[None])


class _Encoder(nn.Module):
    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.layer = nn.ModuleList(_BertLayer(cfg) for _ in range(cfg.text_layers))


class BlipTextEncoder(nn.Module):
    """BLIP's multimodal text encoder: ``last_hidden_state`` ``[B, T, text_width]``."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(self, ids, attention_mask, image_tokens):
        x = self.embeddings(ids)
        additive = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.encoder.layer:
            x = layer(x, additive, image_tokens)
        return x


class _Blip(nn.Module):
    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.visual_encoder = BlipVisionEncoder(cfg)
        self.text_encoder = BlipTextEncoder(cfg)


class _RewardMLP(nn.Module):
    def __init__(self, width: int, widths: Sequence[int]):
        super().__init__()
        dims = [width, *widths]
        layers: list[nn.Module] = []
        drops = (0.2, 0.2, 0.1)
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(drops):
                layers.append(nn.Dropout(drops[i]))
        layers.append(nn.Linear(dims[-1], 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


class ImageRewardModel(nn.Module):
    """``blip.visual_encoder``, ``blip.text_encoder`` and ``mlp``: the released key layout."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        if cfg.first_token not in ("cls", "enc"):
            raise ValueError(f"first_token must be 'cls' or 'enc', got {cfg.first_token!r}")
        self.cfg = cfg
        self.blip = _Blip(cfg)
        self.mlp = _RewardMLP(cfg.text_width, cfg.mlp_widths)

    def text_features(self, pixel_values: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The text encoder's first-position output with cross-attention to the image, ``[B, text_width]``."""
        image_tokens = self.blip.visual_encoder(pixel_values)
        return self.blip.text_encoder(ids, mask, image_tokens)[:, 0, :].float()

    def forward(self, pixel_values: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Normalised rewards ``[B]``."""
        raw = self.mlp(self.text_features(pixel_values, ids, mask))[:, 0]
        return (raw - self.cfg.reward_mean) / self.cfg.reward_std


# ----- loading ---------------------------------------------------------------------------------------------
def open_released_checkpoint(path: str | Path | None, tokenizer: str | Path | None, *, weight_file: str,
                             tokenizer_dirs: Sequence[str], tokenizer_files: str, side_config: str, what: str,
                             flag: str, beside: str) -> tuple[Path, Path, dict[str, torch.Tensor], dict | None]:
    """What ImageReward and HPSv2.1 both need before building a model: the checkpoint (file or folder), its local
    tokenizer folder, the state dict (weights-only) and the optional side config JSON next to the checkpoint.
    :class:`MetricUnavailable` says what is missing; nothing is downloaded."""
    if path is None:
        raise MetricUnavailable(f"{what} needs the released {weight_file}: pass {flag} FILE_OR_DIR (with {beside} "
                                f"beside it; nothing is downloaded)")
    checkpoint = find_checkpoint(path, weight_file, what, flag)
    tok_dir = _find_tokenizer(checkpoint, tokenizer, tokenizer_dirs, tokenizer_files, what, flag)
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise MetricUnavailable(f"{what}'s tokenizer needs the 'transformers' package ({type(exc).__name__}: "
                                f"{exc})") from None
    sd = _read_state_dict(checkpoint, what)
    side = checkpoint.parent / side_config
    return checkpoint, tok_dir, sd, (json.loads(side.read_text()) if side.is_file() else None)


def find_checkpoint(path: str | Path, name: str, what: str, flag: str) -> Path:
    """``path`` itself (a file) or ``path/name`` (a folder); :class:`MetricUnavailable` naming what was searched."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / name).is_file():
            return p / name
        candidates = sorted(p.glob("*.pt")) + sorted(p.glob("*.pth"))
        if len(candidates) == 1:
            return candidates[0]
        raise MetricUnavailable(f"{what}: no {name} in {p} (found {', '.join(c.name for c in candidates) or 'none'}"
                                f"); pass {flag} with the file or its folder")
    raise MetricUnavailable(f"{what} weights not found at {p} (pass {flag} FILE_OR_DIR)")


def _read_state_dict(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable / pickled code: say so, never run it
        raise MetricUnavailable(f"cannot read the {what} weights {path} ({type(exc).__name__}: {exc})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise MetricUnavailable(f"{path} is not a state dict of tensors (the {what} release is one)")
    return {k.removeprefix("module."): v for k, v in data.items()}


def _find_tokenizer(checkpoint: Path, tokenizer: str | Path | None, names: Sequence[str], need: str, what: str,
                    flag: str) -> Path:
    if tokenizer is not None:
        candidates = [Path(tokenizer).expanduser()]
    else:
        candidates = [checkpoint.parent / n for n in names]
    for c in candidates:
        if c.is_dir() and any((c / f).is_file() for f in need.split("|")):
            return c
    raise MetricUnavailable(f"{what} needs its tokenizer: put a folder {' or '.join(names)}/ (with {need.replace('|', ' or ')}) "
                            f"beside {checkpoint.name} in {checkpoint.parent} (searched "
                            f"{', '.join(str(c) for c in candidates)}); {flag} names the file or its folder")


class LoadedImageReward:
    """The model, its tokenizer and the checkpoint path (loaded once per run)."""

    def __init__(self, model: ImageRewardModel, tokenizer, path: Path):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.path = path

    def to(self, device) -> "LoadedImageReward":
        self.model.to(device)
        return self

    def tokenize(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(list(texts), padding="max_length", truncation=True,
                             max_length=self.model.cfg.max_length, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if self.model.cfg.first_token == "enc":
            ids = ids.clone()
            ids[:, 0] = self.tokenizer.convert_tokens_to_ids("[ENC]")
        return ids, mask


def _bert_tokenizer(folder: Path):
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertTokenizer
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        tok = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
        tok.add_special_tokens({"bos_token": "[DEC]"})  # as BLIP's init_tokenizer
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    finally:
        hf_logging.set_verbosity(previous)
    return tok


def load_image_reward(path: str | Path | None, *, tokenizer: str | Path | None = None,
                      config: ImageRewardConfig | None = None, **overrides) -> LoadedImageReward:
    """ImageReward from the released ``ImageReward.pt`` (file or folder) and a local ``bert-base-uncased``
    tokenizer; :class:`MetricUnavailable` with what is missing otherwise. ``overrides``: fields of
    :class:`ImageRewardConfig` (e.g. ``first_token="enc"``)."""
    checkpoint, tok_dir, sd, med = open_released_checkpoint(
        path, tokenizer, weight_file=WEIGHT_FILE, tokenizer_dirs=TOKENIZER_DIRS,
        tokenizer_files="vocab.txt|tokenizer.json", side_config="med_config.json", what="ImageReward",
        flag="--image-reward-weights", beside="a bert-base-uncased/ tokenizer folder")
    cfg = config or ImageRewardConfig.from_state_dict(sd, med, **overrides)
    if config is not None and overrides:
        cfg = replace(cfg, **overrides)
    wanted = {k: v for k, v in sd.items() if k.startswith(("blip.visual_encoder.", "blip.text_encoder.", "mlp."))
              and not k.endswith("position_ids")}
    model = ImageRewardModel(cfg)
    try:
        model.load_state_dict(wanted, strict=True)
    except RuntimeError as exc:
        raise MetricUnavailable(f"{checkpoint} does not match the ImageReward architecture ({exc})") from None
    return LoadedImageReward(model, _bert_tokenizer(tok_dir), checkpoint)


@torch.no_grad()
def image_reward_scores(images: torch.Tensor, texts: Sequence[str], scorer: LoadedImageReward,
                        batch_size: int = 16) -> np.ndarray:
    """Per-sample ImageReward of ``images`` (``[B, 3, H, W]`` in ``[0, 1]`` or uint8) for ``texts``."""
    from .clip_score import clip_preprocess

    if len(texts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(texts)} prompts")
    model = scorer.model
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(texts), batch_size):
        pixels = clip_preprocess(images[i:i + batch_size], model.cfg.image_size).to(device)
        ids, mask = scorer.tokenize(texts[i:i + batch_size])
        out.append(model(pixels, ids.to(device), mask.to(device)).double().cpu())
    return torch.cat(out).numpy() if out else np.zeros(0)
