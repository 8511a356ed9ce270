"""Text conditioning of HART: the context tensor a Qwen2 LLM gives the transformer, and stand-ins for tests.

HART (specs/hart.md §3.2) conditions on the **last hidden states** of a Qwen2 1.5B-class LLM over the prompt
tokenised to exactly ``max_token_length`` (300) tokens: ``context [R, L, 1536]`` fp32, ``mask = ids != pad``
(bool ``[R, L]``) and ``position_ids = cumsum(mask) − 1`` (−1 on left pads, the last position repeated on right
pads). The padding is never masked inside HART: the pads' hidden states enter the attention and the pooling.
:class:`HARTContext` holds the three tensors.

* :class:`Qwen2TextEncoder` — ``transformers.AutoModel`` + ``AutoTokenizer`` from a LOCAL folder
  (``local_files_only=True``; nothing is downloaded), e.g. the release's ``Qwen2-VL-1.5B-Instruct``. The official
  scripts prepend a fixed instruction ("system") prompt for the LLM forward and cut its positions off again
  (``use_llm_system_prompt=True``); its text is not in our spec, so ``system_prompt`` is an option (default
  ``None``: no system prompt — features then differ from the official scripts'; pass the release's text to match).
  The padding side is the tokenizer's own (what ``from_pretrained`` configures), as in the official code.
* :class:`RandomHARTTextEncoder` — the seeded random word-hashing encoder of ``var_core.models.text_encoder``
  (no files), right-padded to ``max_length`` with zero features on the pads (a real LLM gives pads hidden
  states; the stand-in keeps them inert). What ``random:hart-*`` uses.
* Precomputed embeddings: pass a :class:`HARTContext` (or the official triple
  ``(context_tensor, context_mask, context_position_ids)``) as the conditions.

The unconditional rows of classifier-free guidance are :meth:`HARTContext.unconditional`: an all-zero context,
zero position ids and a mask that is 1 only at position 0 (official ``autoregressive_infer_cfg``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["HARTContext", "Qwen2TextEncoder", "RandomHARTTextEncoder", "check_qwen2_directory"]


@dataclass
class HARTContext:
    """``features [R, L, C]`` (float), ``mask [R, L]`` (bool), ``position_ids [R, L]`` (int64)."""

    features: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor

    def __post_init__(self) -> None:
        if self.features.ndim != 3:
            raise ValueError(f"HART context features must be [R, L, C], got {tuple(self.features.shape)}")
        R, L = self.features.shape[:2]
        self.mask = torch.as_tensor(self.mask).to(torch.bool)
        self.position_ids = torch.as_tensor(self.position_ids).to(torch.long)
        if tuple(self.mask.shape) != (R, L) or tuple(self.position_ids.shape) != (R, L):
            raise ValueError(f"context mask {tuple(self.mask.shape)} and position ids "
                             f"{tuple(self.position_ids.shape)} must both be [R, L] = [{R}, {L}]")

    @property
    def rows(self) -> int:
        return self.features.shape[0]

    @property
    def length(self) -> int:
        return self.features.shape[1]

    @property
    def channels(self) -> int:
        return self.features.shape[2]

    @classmethod
    def from_official(cls, triple) -> "HARTContext":
        """From ``(context_tensor, context_mask, context_position_ids)`` as ``encode_prompts`` returns them."""
        features, mask, position_ids = triple[:3]
        return cls(features, mask, position_ids)

    @classmethod
    def from_mask(cls, features: torch.Tensor, mask: torch.Tensor) -> "HARTContext":
        """Position ids from the mask, ``cumsum(mask) − 1`` (the official rule)."""
        mask = mask.to(torch.bool)
        return cls(features, mask, mask.long().cumsum(1) - 1)

    @classmethod
    def unconditional(cls, rows: int, length: int, channels: int, device=None, dtype=torch.float32) -> "HARTContext":
        """The CFG rows: zero context, zero position ids, a mask that is 1 only at position 0."""
        mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
        mask[:, 0] = True
        return cls(torch.zeros(rows, length, channels, device=device, dtype=dtype), mask,
                   torch.zeros(rows, length, dtype=torch.long, device=device))

    def select(self, rows) -> "HARTContext":
        return HARTContext(self.features[rows], self.mask[rows], self.position_ids[rows])

    def to(self, device=None, dtype=None) -> "HARTContext":
        return HARTContext(self.features.to(device=device, dtype=dtype), self.mask.to(device),
                           self.position_ids.to(device))

    @staticmethod
    def cat(parts: Sequence["HARTContext"]) -> "HARTContext":
        lengths = {p.length for p in parts}
        if len(lengths) != 1:
            raise ValueError(f"HART contexts must all have the same length (the transformer's context_token), got "
                             f"{sorted(lengths)}")
        device = parts[0].features.device
        return HARTContext(torch.cat([p.features.to(device) for p in parts]),
                           torch.cat([p.mask.to(device) for p in parts]),
                           torch.cat([p.position_ids.to(device) for p in parts]))


# --------------------------------------------------------------------------------------------------------------
# tiny random encoder (random:hart-*)
# --------------------------------------------------------------------------------------------------------------
class RandomHARTTextEncoder(nn.Module):
    """A seeded random stand-in for the Qwen2 encoder: :class:`~var_core.models.text_encoder.RandomTextEncoder`
    features of the prompt's words, right-padded (zeros) or truncated to ``max_length`` tokens."""

    def __init__(self, out_dim: int, max_length: int, seed: int = 0, width: int = 64):
        super().__init__()
        from .text_encoder import RandomTextEncoder

        self.inner = RandomTextEncoder(out_dim=out_dim, width=width, max_length=max(max_length, 2), seed=seed)
        self.out_dim, self.max_length = int(out_dim), int(max_length)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> HARTContext:
        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = self.inner.encode(list(prompts))
        R, L, C = tokens.features.shape
        n = self.max_length
        feats = tokens.features.new_zeros(R, n, C)
        mask = torch.zeros(R, n, dtype=torch.bool)
        for i, length in enumerate(tokens.lens.tolist()):
            k = min(length, n)
            feats[i, :k] = tokens.features[i, :k]
            mask[i, :k] = True
        return HARTContext.from_mask(feats, mask.to(feats.device))

    def describe(self) -> str:
        return f"random text encoder (out {self.out_dim}, {self.max_length} tokens, right-padded with zeros)"


# --------------------------------------------------------------------------------------------------------------
# Qwen2 from a local folder
# --------------------------------------------------------------------------------------------------------------
QWEN2_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
QWEN2_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
QWEN2_REPO_ID = "mit-han-lab/Qwen2-VL-1.5B-Instruct"


def check_qwen2_directory(path: Path) -> None:
    """``FileNotFoundError`` naming every expected file when ``path`` is not a usable Qwen2 folder."""
    expected = (f"expected a local Qwen2 folder ({QWEN2_REPO_ID}, or its Hugging Face cache folder "
                f"models--{QWEN2_REPO_ID.replace('/', '--')}/snapshots/<hash>/) holding config.json, weights (one of "
                f"{', '.join(QWEN2_WEIGHT_FILES)}) and a tokenizer ({' or '.join(QWEN2_TOKENIZER_FILES)})")
    if not path.is_dir():
        raise FileNotFoundError(f"Qwen2 text encoder folder not found: {path}; {expected}. Nothing is downloaded.")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in QWEN2_WEIGHT_FILES):
        missing.append("weights (" + " | ".join(QWEN2_WEIGHT_FILES) + ")")
    if not any((path / f).is_file() for f in QWEN2_TOKENIZER_FILES):
        missing.append("tokenizer (" + " | ".join(QWEN2_TOKENIZER_FILES) + ")")
    if missing:
        present = sorted(p.name for p in path.iterdir())[:12]
        raise FileNotFoundError(f"Qwen2 folder {path} is missing {', '.join(missing)} (found: {present}); "
                                f"{expected}. Nothing is downloaded.")


def resolve_qwen2_directory(path: str | Path) -> Path:
    """The folder itself, or the snapshot of a Hugging Face cache folder (``models--org--name``)."""
    from .loading import hf_snapshot_dir

    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        return path
    return hf_snapshot_dir(path) or path


class Qwen2TextEncoder(nn.Module):
    """HART's text encoder: a Qwen2 base model (``AutoModel``, no LM head) and its tokenizer from a local folder.

    ``encode(prompts)`` tokenises every prompt to exactly ``max_length`` tokens (``padding="max_length"``,
    truncation), prepends ``system_prompt`` (if given: its tokens, unpadded, attention mask 1) for the forward pass,
    and returns the last hidden states of the prompt positions as fp32 (``hidden_states[-1]``), with
    ``mask = ids != pad_token_id`` and ``position_ids = cumsum(mask) − 1`` (excluding the system prompt).
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_length: int = 300, system_prompt: str | None = None):
        self.path = resolve_qwen2_directory(path)
        check_qwen2_directory(self.path)
        try:
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:  # optional dependency
            raise ImportError("the Qwen2 text encoder needs the optional package `transformers`; the random:hart-* "
                              "models and precomputed HARTContext conditions work without it") from exc
        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(self.path), local_files_only=True)
        self.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.max_length = int(max_length)
        self.system_prompt = system_prompt
        self.out_dim = int(getattr(self.model.config, "hidden_size", 0) or
                           getattr(getattr(self.model.config, "text_config", None), "hidden_size", 0))

    @classmethod
    def from_parts(cls, model: nn.Module, tokenizer, *, max_length: int = 300, system_prompt: str | None = None,
                   path: str | Path | None = None) -> "Qwen2TextEncoder":
        """Wrap an already loaded base model (``model(input_ids=, attention_mask=, output_hidden_states=True)``
        with ``.hidden_states``) and tokenizer (with ``pad_token_id``)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.path = Path(path) if path is not None else None
        self.tokenizer, self.model = tokenizer, model.eval().requires_grad_(False)
        self.max_length, self.system_prompt = int(max_length), system_prompt
        self.out_dim = int(model.config.hidden_size)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> HARTContext:
        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = self.tokenizer(list(prompts), padding="max_length", max_length=self.max_length, truncation=True,
                                return_tensors="pt")
        ids = tokens["input_ids"].to(self.device)
        pad_id = self.tokenizer.pad_token_id
        mask = ids != pad_id if pad_id is not None else tokens["attention_mask"].to(self.device).bool()
        position_ids = mask.long().cumsum(1) - 1
        attention = mask.long()
        prefix = 0
        if self.system_prompt:
            sys_ids = self.tokenizer(self.system_prompt, padding="do_not_pad", return_tensors="pt")["input_ids"]
            sys_ids = sys_ids.to(self.device).expand(ids.shape[0], -1)
            prefix = sys_ids.shape[1]
            ids = torch.cat((sys_ids, ids), dim=1)
            attention = torch.cat((torch.ones_like(sys_ids), attention), dim=1)
        out = self.model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, prefix:].float()
        return HARTContext(hidden, mask, position_ids)

    def describe(self) -> str:
        return (f"Qwen2 encoder from {self.path} ({self.max_length} tokens, system prompt "
                f"{'on' if self.system_prompt else 'off'})")
