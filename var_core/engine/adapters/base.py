"""The model-adapter seam: everything the loop needs from a model family, and nothing about methods.

An adapter wraps one family's modules (VAR + VQVAE, Infinity + BSQ-VAE + text encoder) and exposes the
steps of next-scale generation as small functions over an explicit, per-generation ``state`` object. The loop in
``var_core.engine.loop`` owns control flow; the adapter owns tensor layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from ..context import GuidanceMode
from ..kvcache import KVCache
from ..packing import RowPacking
from ..sampling import SamplingConfig


def rows_for(guidance: GuidanceMode, batch_size: int) -> int:
    return batch_size * (2 if guidance is GuidanceMode.BOTH else 1)


def row_slice_after_drop(old: GuidanceMode, new: GuidanceMode, batch_size: int) -> slice:
    """Rows of the old layout that survive a guidance change (cond rows come first in ``BOTH``)."""
    if old is new:
        return slice(None)
    if old is GuidanceMode.BOTH and new is GuidanceMode.COND_ONLY:
        return slice(0, batch_size)
    if old is GuidanceMode.BOTH and new is GuidanceMode.UNCOND_ONLY:
        return slice(batch_size, 2 * batch_size)
    raise ValueError(
        f"cannot switch guidance from {old.value} to {new.value}: the dropped rows' KV cache no longer exists"
    )


class ModelAdapter(ABC):
    """One model family behind the loop. Implementations: ``VARAdapter`` (and ``InfinityAdapter``)."""

    family: str = "abstract"
    branches: tuple[str, ...] = ("attn", "ffn")

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def scale_hw(self) -> tuple[tuple[int, int], ...]: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    def num_scales(self) -> int:
        return len(self.scale_hw)

    @property
    def total_tokens(self) -> int:
        return sum(h * w for h, w in self.scale_hw)

    def token_offsets(self) -> list[int]:
        offsets, start = [], 0
        for h, w in self.scale_hw:
            offsets.append(start)
            start += h * w
        return offsets

    def modules(self) -> dict[str, torch.nn.Module]:
        """Every module whose parameters or buffers generation reads, by attribute name: what Lightning (through
        ``GenerationModule``) and :meth:`to` move. An adapter keeps every tensor it reads in one of these (as a
        parameter or a buffer), never as a plain tensor attribute, so that moving the model moves all of it."""
        return adapter_modules(self)

    def to(self, device: torch.device | str) -> "ModelAdapter":
        """Move every module of :meth:`modules` to ``device`` (dtypes unchanged); returns ``self``."""
        for module in self.modules().values():
            module.to(device)
        return self

    @abstractmethod
    def initial_guidance(self, sampling: SamplingConfig) -> GuidanceMode:
        """Whether the unconditional rows are needed at all under these sampling settings."""

    @abstractmethod
    def begin(self, conditions: Any, guidance: GuidanceMode, sampling: SamplingConfig) -> Any:
        """Encode the conditions (class labels / prompts) and return the per-generation state."""

    def kv_cache(self) -> KVCache:
        return KVCache(self.num_blocks, self.total_tokens)

    @abstractmethod
    def scale_input(self, state: Any, si: int) -> torch.Tensor:
        """``[R, N, C]`` hidden input of scale ``si`` for the current row layout."""

    @abstractmethod
    def run_branch(
        self, state: Any, si: int, block: int, branch: str, x_RnC: torch.Tensor, keep_Rn: torch.Tensor | None,
        valid_Rn: torch.Tensor | None, cache: KVCache, want_probs: bool, packing: RowPacking | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual-branch output for the given tokens (gates included), plus attention probabilities.

        ``keep_Rn``: the tokens' positions within the scale (None: all, in order). ``valid_Rn``: False marks
        padding of a ragged selection; padded keys must be excluded from attention (``KVCache.append`` returns
        the bias to use)."""

    @abstractmethod
    def logits(self, state: Any, x_RNC: torch.Tensor) -> torch.Tensor:
        """Head output ``[R, N, V]`` (also used for the logit lens on intermediate hidden states)."""

    def context_length(self, state: Any) -> int | None:
        """Length of the cross-attention context a generation attended to (None: no cross-attention)."""
        return None

    def row_packing(self, keep_Rn: torch.Tensor, valid_Rn: torch.Tensor | None) -> RowPacking | None:
        """How the per-token work of a ragged selection runs: a :class:`RowPacking` (valid tokens only; the
        adapter's ``run_branch`` must honour it) or None (the padded layout). Default: padded."""
        return None

    def head_parts(self, state: Any, x_RNC: torch.Tensor, rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.nn.Linear] | None:
        """``(features_RNC, linear)`` with ``logits == linear(features)``: the head's normalised input and its affine
        layer, so a lens can mix CFG rows before the (costly) projection (see ``engine.lens_probe``). ``rows``
        (int64 network-row indices): ``x_RNC`` holds only those rows (a lens on some samples). None: the family's
        head is not affine in one feature tensor; lens mixtures then combine full logits."""
        return None

    @abstractmethod
    def guide(self, state: Any, si: int, logits_RNV: torch.Tensor, sampling: SamplingConfig,
              cond_only_B: torch.Tensor | None = None) -> torch.Tensor:
        """Combine the CFG halves into ``[B, N, V]`` in the family's convention.

        ``cond_only_B`` (bool ``[B]``): samples that use their conditional logits alone although the batch still
        computes both halves (per-sample guidance stopping; outputs equal those of a physical row drop)."""

    @abstractmethod
    def sample(self, guided_BNV: torch.Tensor, sampling: SamplingConfig,
               generators: Sequence[torch.Generator] | None, shared_generator: torch.Generator | None) -> torch.Tensor:
        """Draw this scale's tokens from the guided logits."""

    @abstractmethod
    def update_latent(self, state: Any, si: int, tokens: torch.Tensor, keep_BN: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Accumulate the sampled scale into the latent; returns the residual map at scale resolution.

        ``keep_BN`` (bool ``[B, N]``, token grid of the scale): only these tokens' residual codes enter the latent;
        the others' are zero on the scale's grid before the family's usual upsampling (and VAR's Phi), and the
        returned residual map is zero there too. None: every token (the plain algorithm)."""

    def finish(self, state: Any, x_RNC: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig,
               generators: Sequence[torch.Generator] | None = None,
               shared_generator: torch.Generator | None = None) -> None:
        """After the LAST scale's latent update (only when that scale ran): family-specific work on its final hidden
        state ``x_RNC`` and sampled ``tokens`` that changes the latent (HART: the residual diffusion head). Default:
        nothing. Randomness: ``generators`` (one per sample) or ``shared_generator``, as for :meth:`sample`."""

    @abstractmethod
    def decode(self, state: Any) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] from the accumulated latent."""

    def decode_preview(self, state: Any, grid_scale: int) -> torch.Tensor:
        """Images ``[B, 3, h, w]`` in [0, 1] from the accumulated latent resized to the latent grid of scale
        ``grid_scale`` (a coarse preview; SkipVAR decodes its features from the 8×8 grid of Infinity-1024)."""
        raise NotImplementedError(f"the {getattr(self, 'family', 'model')} adapter does not decode a latent preview "
                                  f"(a coarse decode of the accumulated latent); it is only defined for Infinity")

    @abstractmethod
    def latent(self, state: Any) -> torch.Tensor:
        """The accumulated latent (``f_hat`` for VAR)."""

    # ----- the second-model seam (engine.switch): what a refiner needs to take a generation over -----------------
    def tokenizer_fingerprint(self) -> str | None:
        """A hash of the tokenizer (the VQVAE's configuration and weights): two adapters with the same fingerprint
        read each other's tokens and latents alike, so one may hand a generation to the other. None: unknown (this
        adapter cannot take part in a model switch)."""
        return None

    def replay_latent(self, state: Any, si: int, record: Any) -> None:
        """Teacher forcing: advance this adapter's latent by scale ``si`` as another model generated it (``record``:
        that scale's :class:`~var_core.engine.context.ScaleRecord`, its ``residual_BChw`` the residual map that
        entered the latent), so that :meth:`scale_input` of the next scale is what the other model saw."""
        raise NotImplementedError(f"the {self.family} adapter cannot prefill from another model's scales "
                                  f"(replay_latent); a model switch needs it")

    def adopt_latent(self, state: Any, latent: torch.Tensor) -> None:
        """Take over another model's accumulated latent (same tokenizer) as this generation's latent."""
        raise NotImplementedError(f"the {self.family} adapter cannot take over another model's latent "
                                  f"(adopt_latent); a model switch needs it")

    @abstractmethod
    def select_rows(self, state: Any, rows: slice, guidance: GuidanceMode) -> None:
        """Drop CFG rows from the state (the loop slices the KV cache itself)."""


def adapter_modules(adapter: Any) -> dict[str, torch.nn.Module]:
    """The ``nn.Module`` attributes of an adapter (of any adapter-like object), by attribute name, each once."""
    out: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for name, value in vars(adapter).items():
        if isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            out[name] = value
    return out
