"""Text encoders for Infinity: flan-T5 from a local directory, and a tiny seeded random encoder.

Both return :class:`TextTokens`: per-prompt features padded to the longest prompt, with the valid lengths.
That is the padded form of what the official ``encode_prompt`` packs as ``(kv_compact, lens, cu_seqlens_k,
max_seqlen_k)``; :meth:`TextTokens.from_packed` / :meth:`TextTokens.to_packed` convert between the two.

* :class:`T5TextEncoder` wraps ``transformers.T5EncoderModel`` loaded from a LOCAL directory only
  (``local_files_only=True``; nothing is downloaded). ``transformers`` stays an optional import: it is imported
  when the encoder is built, and a missing package or missing files give an error naming what is expected.
* :class:`RandomTextEncoder` is a small seeded random transformer with a trivial deterministic tokenizer of our
  own (crc32 of lower-cased words, then an end-of-sequence token, as T5 appends ``</s>``). It is what the
  ``random:infinity-*`` models use, so they run with no transformers files at all.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TextTokens:
    """Text features of ``R`` rows, padded: ``features [R, L, C]``, valid lengths ``lens [R]`` (int64)."""

    features: torch.Tensor
    lens: torch.Tensor

    def __post_init__(self) -> None:
        self.lens = torch.as_tensor(self.lens, dtype=torch.long).view(-1).cpu()
        if self.features.ndim != 3 or self.features.shape[0] != self.lens.numel():
            raise ValueError(f"features must be [R, L, C] with R = len(lens); got {tuple(self.features.shape)} and "
                             f"{self.lens.numel()} lengths")
        if self.lens.numel() and (int(self.lens.min()) < 1 or int(self.lens.max()) > self.features.shape[1]):
            raise ValueError(f"text lengths must lie in [1, {self.features.shape[1]}], got {self.lens.tolist()}")

    @property
    def rows(self) -> int:
        return self.features.shape[0]

    @property
    def channels(self) -> int:
        return self.features.shape[2]

    @property
    def mask(self) -> torch.Tensor:
        """``[R, L]`` bool, True on valid tokens."""
        L = self.features.shape[1]
        return torch.arange(L, device=self.features.device).view(1, L) < self.lens.to(self.features.device).view(-1, 1)

    @classmethod
    def from_packed(cls, kv_compact: torch.Tensor, lens: Sequence[int]) -> "TextTokens":
        """From the official packed form: the valid tokens of all prompts back to back, ``[Σ lens, C]``."""
        lens = [int(n) for n in lens]
        if sum(lens) != kv_compact.shape[0]:
            raise ValueError(f"packed text has {kv_compact.shape[0]} tokens but lens sum to {sum(lens)}")
        L = max(lens)
        out = kv_compact.new_zeros(len(lens), L, kv_compact.shape[1])
        start = 0
        for i, n in enumerate(lens):
            out[i, :n] = kv_compact[start:start + n]
            start += n
        return cls(out, torch.tensor(lens))

    @classmethod
    def from_official(cls, label_B_or_BLT) -> "TextTokens":
        """From ``(kv_compact, lens, cu_seqlens_k, max_seqlen_k)`` as ``tools/run_infinity.py`` builds it."""
        kv_compact, lens = label_B_or_BLT[0], label_B_or_BLT[1]
        return cls.from_packed(kv_compact, lens)

    def to_packed(self) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
        """The official tuple ``(kv_compact, lens, cu_seqlens_k int32, max_seqlen_k)``."""
        lens = self.lens.tolist()
        kv = torch.cat([self.features[i, :n] for i, n in enumerate(lens)])
        cu = F.pad(torch.tensor(lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
        return kv, lens, cu, max(lens)

    def select(self, rows) -> "TextTokens":
        return TextTokens(self.features[rows], self.lens[rows])

    def repeat_rows(self, n: int) -> "TextTokens":
        return TextTokens(self.features.repeat(n, 1, 1), self.lens.repeat(n))

    def to(self, device=None, dtype=None) -> "TextTokens":
        return TextTokens(self.features.to(device=device, dtype=dtype), self.lens)

    @staticmethod
    def cat(parts: Sequence["TextTokens"]) -> "TextTokens":
        """Rows of several batches, padded to the longest."""
        L = max(p.features.shape[1] for p in parts)
        feats = [F.pad(p.features, (0, 0, 0, L - p.features.shape[1])) for p in parts]
        return TextTokens(torch.cat(feats), torch.cat([p.lens for p in parts]))


# --------------------------------------------------------------------------------------------------------------
# tiny random encoder (random:infinity-*)
# --------------------------------------------------------------------------------------------------------------
class RandomTextEncoder(nn.Module):
    """A seeded random stand-in for flan-T5: word hashing tokenizer → small transformer → ``out_dim`` features.

    Deterministic across processes and platforms (crc32 tokenizer, weights from a private generator). The
    features carry T5-like scale (unit RMS), and a prompt's features depend on its words and their order.
    """

    EOS = 1
    FIRST_WORD_ID = 2

    def __init__(self, out_dim: int = 2048, width: int = 64, layers: int = 1, heads: int = 2, vocab: int = 4096,
                 max_length: int = 512, seed: int = 0):
        super().__init__()
        self.out_dim, self.width, self.vocab, self.max_length = out_dim, width, vocab, max_length
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(max_length, width))
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.ModuleList(_clone(layer) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out_dim)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
                elif name.endswith("weight"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            self.embed.weight.mul_(math.sqrt(width))
            self.pos.mul_(0.5 * math.sqrt(width))
        self.eval().requires_grad_(False)

    def tokenize(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [B, L] int64, lens [B])``: one id per lower-cased word (crc32 mod vocab), then EOS."""
        rows = []
        for prompt in prompts:
            words = re.findall(r"\w+|[^\w\s]", prompt.lower())
            ids = [self.FIRST_WORD_ID + zlib.crc32(w.encode("utf-8")) % (self.vocab - self.FIRST_WORD_ID)
                   for w in words][: self.max_length - 1]
            rows.append(ids + [self.EOS])
        L = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids, torch.tensor([len(r) for r in rows])

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextTokens:
        """Each prompt is encoded on its own (no padding inside the network), so a prompt's features do not
        depend on the other prompts of the batch."""
        if isinstance(prompts, str):
            prompts = [prompts]
        device = self.proj.weight.device
        outs, lens = [], []
        for prompt in prompts:
            ids, n = self.tokenize([prompt])
            ids = ids.to(device)
            h = self.embed(ids) + self.pos[: ids.shape[1]]
            for layer in self.layers:
                h = _encoder_layer(layer, h)
            out = self.proj(self.norm(h))[0]
            out = out / out.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # unit RMS per token, like T5's output
            outs.append(out.float())
            lens.append(int(n[0]))
        L = max(lens)
        feats = torch.stack([F.pad(o, (0, 0, 0, L - o.shape[0])) for o in outs])
        return TextTokens(feats, torch.tensor(lens))

    def describe(self) -> str:
        return f"random text encoder (width {self.width}, out {self.out_dim}, crc32 word tokenizer)"


def _encoder_layer(layer: nn.TransformerEncoderLayer, h: torch.Tensor) -> torch.Tensor:
    """Pre-norm encoder layer written out (keeps PyTorch's fused inference fast path out of the numbers)."""
    x = layer.norm1(h)
    h = h + layer.self_attn(x, x, x, need_weights=False)[0]
    return h + layer.linear2(F.gelu(layer.linear1(layer.norm2(h)), approximate="tanh"))


def _clone(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


# --------------------------------------------------------------------------------------------------------------
# flan-T5 from a local directory
# --------------------------------------------------------------------------------------------------------------
T5_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
T5_TOKENIZER_FILES = ("spiece.model", "tokenizer.json")
T5_REPO_ID = "google/flan-t5-xl"


def resolve_t5_directory(path: str | Path) -> Path:
    """The folder that holds the T5 files, from what a user points at: the folder itself (it has
    ``config.json``); a Hugging Face cache folder ``models--google--flan-t5-xl`` (its snapshot, the one
    ``refs/main`` names, see :func:`var_core.models.loading.hf_snapshot_dir`); or a hub cache root holding that
    folder. Anything else is returned unchanged, for :func:`check_t5_directory` to say what is missing."""
    from .loading import hf_repo_cache_name, hf_snapshot_dir

    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        return path
    snapshot = hf_snapshot_dir(path)
    if snapshot is not None:
        return snapshot
    cached = path / hf_repo_cache_name(T5_REPO_ID)
    if cached.is_dir():
        return hf_snapshot_dir(cached) or cached
    return path


class T5TextEncoder(nn.Module):
    """``transformers.T5EncoderModel`` + its tokenizer, loaded from a local directory (never downloaded).

    Prompts are tokenised as the official ``encode_prompt`` does (``max_length=512``, truncation), and only the
    valid tokens are kept (we pad to the longest prompt rather than to 512: the attention mask makes the
    valid tokens' features the same).

    An ``nn.Module`` whose sub-module is the T5 encoder, so that moving the model (``adapter.to``, Lightning's
    device placement) moves T5 with it; the tokenizer is a plain attribute (it holds no tensors).
    :meth:`from_parts` wraps an encoder and a tokenizer that are already loaded.
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_length: int = 512):
        self.path = resolve_t5_directory(path)
        check_t5_directory(self.path)
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError as exc:  # optional dependency
            raise ImportError(
                "the T5 text encoder needs the optional package `transformers` (pip install transformers "
                "sentencepiece); the random:infinity-* models work without it"
            ) from exc
        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.model = T5EncoderModel.from_pretrained(str(self.path), local_files_only=True)
        self.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.max_length = max_length
        self.out_dim = int(self.model.config.d_model)

    @classmethod
    def from_parts(cls, model: nn.Module, tokenizer, *, path: str | Path | None = None,
                   max_length: int = 512) -> "T5TextEncoder":
        """Wrap an encoder module (``model(input_ids=, attention_mask=)["last_hidden_state"]``, with
        ``model.config.d_model``) and a tokenizer (``tokenizer(prompts, max_length=, padding=, truncation=,
        return_tensors="pt")`` → ``input_ids``, ``attention_mask``) that are already loaded."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.path = Path(path) if path is not None else None
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.max_length = max_length
        self.out_dim = int(model.config.d_model)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextTokens:
        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = self.tokenizer(list(prompts), max_length=self.max_length, padding="longest", truncation=True,
                                return_tensors="pt")
        ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        feats = self.model(input_ids=ids, attention_mask=mask)["last_hidden_state"].float()
        lens = mask.sum(-1).cpu()
        feats = feats.masked_fill(~mask.bool().unsqueeze(-1), 0.0)
        return TextTokens(feats, lens)

    def describe(self) -> str:
        return f"T5 encoder from {self.path}"


def check_t5_directory(path: Path) -> None:
    """Raise ``FileNotFoundError`` naming every expected file when ``path`` is not a usable T5 directory."""
    expected = (
        f"expected a local flan-t5 directory (e.g. flan-t5-xl, or a Hugging Face cache folder "
        f"models--google--flan-t5-xl/snapshots/<hash>/) holding config.json, model weights (one of "
        f"{', '.join(T5_WEIGHT_FILES)} plus the shards an index names) and tokenizer files (one of "
        f"{', '.join(T5_TOKENIZER_FILES)}, with tokenizer_config.json / special_tokens_map.json)"
    )
    if not path.is_dir():
        raise FileNotFoundError(f"T5 text encoder directory not found: {path}; {expected}. Nothing is downloaded.")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in T5_WEIGHT_FILES):
        missing.append("model weights (" + " | ".join(T5_WEIGHT_FILES) + ")")
    if not any((path / f).is_file() for f in T5_TOKENIZER_FILES):
        missing.append("tokenizer (" + " | ".join(T5_TOKENIZER_FILES) + ")")
    if missing:
        present = sorted(p.name for p in path.iterdir())[:12]
        raise FileNotFoundError(f"T5 directory {path} is missing {', '.join(missing)} (found: {present}); "
                                f"{expected}. Nothing is downloaded.")
