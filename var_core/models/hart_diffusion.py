"""HART's residual diffusion head (``DiffLoss``, MAR-style; specs/hart.md §6), re-implemented in the official
parameter layout (``diffloss.net.*`` of the transformer checkpoint).

After the last scale's discrete tokens are sampled, a small AdaLN MLP denoises, per token, the **continuous**
residual that the codebook cannot represent; the condition of each token is the transformer's final hidden state
plus the embedding of its sampled code (computed by the adapter, :meth:`HARTTransformer.diffusion_condition`).

* Net :class:`SimpleMLPAdaLN`: ``t_emb = MLP(sinusoid_256(t))`` (cos half first), ``y = t_emb + cond_embed(z)``,
  ``h = input_proj(x)``, ``depth`` AdaLN residual blocks (shift, scale, gate), a final AdaLN layer → ``2·Cvae``
  channels: ε and the variance-interpolation values ``v``. ``t`` is the *original* timestep (0…999).
* Process :class:`RespacedDiffusion`: iDDPM, 1000-step cosine schedule respaced to ``steps`` (official ``"8"``:
  timesteps ``[0, 143, 285, 428, 571, 714, 856, 999]``), ε prediction, learned-range variance; tables in float64,
  cast to fp32 where used (as ``_extract_into_tensor`` does).
* Sampling (:meth:`DiffusionHead.sample`): ``p_sample_loop`` from ``x_K = noise``; ``x̂0`` clamped to [−1, 1]; the
  result times ``vae_scale = 0.6``. Guidance ``s`` (HART: the last scale's ``t = cfg·(N−2)/(N−1)``):
  rows ``[cond ; uncond]``, the net runs on ``[x_cond ; x_cond]``, ``ε = (1+s)·ε_c − s·ε_u`` for both halves,
  each half's own variance values. **``s == 1.0`` exactly takes the unguided branch** (an official quirk,
  reproduced): every row is denoised on its own condition, no mixing. Every other ``s`` — **``s = 0`` included**
  (HART at ``cfg = 0``) — takes the guided branch: ``ε = ε_c``, but the noise is drawn as under guidance.
  ``s`` may be a per-row tensor (per-sample guidance stops: ``s = 0`` gives the conditional prediction alone).
* ``cond_only=True``: ``z`` holds only the conditional rows of the official call (the unconditional rows were
  never computed, e.g. HART at ``cfg = 0``); allowed where they cannot change the conditional half, i.e.
  ``s = 0`` (guided branch) and ``s = 1.0`` (unguided branch). The result is that call's conditional half, with
  the noise drawn exactly as the full call draws it (the unconditional rows' share drawn and dropped).

Randomness comes from a *noise source*: a callable ``noise(rows, channels) -> tensor`` (it may return more rows
than asked for: the first ``rows`` are used, the whole draw is traced). The official order (global generator):
one draw of the initial noise (half the rows under guidance, duplicated), then one draw for all rows at every
step, also at the last (multiplied by 0). :func:`torch_noise` gives that order from a generator (None =
the global one); the adapter builds per-sample sources for batch-independent results.

Knob that matters: ``steps`` (the respacing; official 8). Training (``forward`` with the VLB loss) is not
implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["DiffusionHead", "RespacedDiffusion", "SimpleMLPAdaLN", "respaced_timesteps", "torch_noise"]

VAE_SCALE = 0.6  # the training target is residual / 0.6
NUM_TRAIN_TIMESTEPS = 1000


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[cos(t·f), sin(t·f)]`` with ``f_i = exp(−ln(max_period)·i/(dim/2))`` (float32)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_dim).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """``net``: ``(x [n, Cvae], t [n] original timesteps, c [n, C]) → [n, 2·Cvae]`` (ε ‖ variance values)."""

    def __init__(self, in_channels: int, width: int, out_channels: int, cond_channels: int, depth: int):
        super().__init__()
        self.in_channels = in_channels
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(cond_channels, width)
        self.input_proj = nn.Linear(in_channels, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        y = self.time_embed(t) + self.cond_embed(c)
        h = self.input_proj(x)
        for block in self.res_blocks:
            h = block(h, y)
        return self.final_layer(h, y)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor, cfg_scale) -> torch.Tensor:
        """Rows ``[cond ; uncond]``: the net on ``[x_c ; x_c]``, ``ε = (1+s)·ε_c − s·ε_u`` for both halves (HART's
        convention), each half's own variance values. ``cfg_scale``: a float or ``[n/2]`` per conditional row."""
        half = x.shape[0] // 2
        out = self.forward(torch.cat([x[:half], x[:half]]), t, c)
        eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
        cond_eps, uncond_eps = eps[:half], eps[half:]
        s = cfg_scale if not isinstance(cfg_scale, torch.Tensor) else cfg_scale.view(-1, 1).to(eps.dtype)
        mixed = (1 + s) * cond_eps - s * uncond_eps
        return torch.cat([torch.cat([mixed, mixed]), rest], dim=1)


# ----- the process ---------------------------------------------------------------------------------------------
def cosine_betas(num_steps: int = NUM_TRAIN_TIMESTEPS, max_beta: float = 0.999) -> torch.Tensor:
    """iDDPM cosine schedule ``ᾱ(t) = cos²((t/T + 0.008)/1.008·π/2)``, ``β_i = min(1 − ᾱ(i+1)/ᾱ(i), max_beta)``
    (float64)."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta) for i in range(num_steps)]
    return torch.tensor(betas, dtype=torch.float64)


def respaced_timesteps(steps: int, num_train: int = NUM_TRAIN_TIMESTEPS) -> list[int]:
    """The kept original timesteps of the respacing string ``str(steps)`` (one section): ``round(k·(T−1)/(K−1))``
    with Python rounding (official ``space_timesteps``); ``[0, 143, …, 999]`` for 8."""
    if not 1 <= steps <= num_train:
        raise ValueError(f"diffusion steps must be in [1, {num_train}], got {steps}")
    if steps == 1:
        return [0]
    frac = (num_train - 1) / (steps - 1)
    out, cur = [], 0.0
    for _ in range(steps):
        out.append(round(cur))
        cur += frac
    return out


@dataclass(frozen=True)
class DiffusionTables:
    """The respaced process' float64 tables (``gen`` of the fixture's ``golden_diffusion.pt``)."""

    timestep_map: torch.Tensor  # int64 [K]
    betas: torch.Tensor
    alphas_cumprod: torch.Tensor
    alphas_cumprod_prev: torch.Tensor
    sqrt_recip_alphas_cumprod: torch.Tensor
    sqrt_recipm1_alphas_cumprod: torch.Tensor
    posterior_variance: torch.Tensor
    posterior_log_variance_clipped: torch.Tensor
    posterior_mean_coef1: torch.Tensor
    posterior_mean_coef2: torch.Tensor
    log_betas: torch.Tensor


class RespacedDiffusion:
    """iDDPM sampling on a respaced cosine schedule, learned-range variance, ε prediction."""

    def __init__(self, steps: int = 8, num_train: int = NUM_TRAIN_TIMESTEPS):
        self.steps = int(steps)
        kept = respaced_timesteps(self.steps, num_train)
        base = torch.cumprod(1.0 - cosine_betas(num_train), dim=0)
        self.train_alphas_cumprod = base  # ᾱ of the 1000-step training process (float64)
        last, betas = 1.0, []
        for t in kept:
            betas.append(1.0 - float(base[t]) / last)
            last = float(base[t])
        b = torch.tensor(betas, dtype=torch.float64)
        ac = torch.cumprod(1.0 - b, dim=0)
        ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        post_var = b * (1.0 - ac_prev) / (1.0 - ac)
        clipped = torch.log(torch.cat([post_var[1:2], post_var[1:]])) if len(b) > 1 else torch.log(post_var)
        self.tables = DiffusionTables(
            timestep_map=torch.tensor(kept, dtype=torch.long), betas=b, alphas_cumprod=ac, alphas_cumprod_prev=ac_prev,
            sqrt_recip_alphas_cumprod=torch.sqrt(1.0 / ac), sqrt_recipm1_alphas_cumprod=torch.sqrt(1.0 / ac - 1),
            posterior_variance=post_var, posterior_log_variance_clipped=clipped,
            posterior_mean_coef1=b * torch.sqrt(ac_prev) / (1.0 - ac),
            posterior_mean_coef2=(1.0 - ac_prev) * torch.sqrt(1.0 - b) / (1.0 - ac),
            log_betas=torch.log(b),
        )

    def _at(self, table: torch.Tensor, i: int, like: torch.Tensor) -> torch.Tensor:
        """Entry ``i`` of a float64 table as a float32 scalar tensor on ``like``'s device (``_extract_into_tensor``)."""
        return table[i].to(device=like.device, dtype=torch.float32)

    def p_step(self, model_out: torch.Tensor, x: torch.Tensor, i: int, noise: torch.Tensor | None,
               temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """One reverse step at respaced index ``i`` from the net output ``[n, 2·C]``; returns the step's tensors."""
        C = x.shape[1]
        eps, v = model_out[:, :C], model_out[:, C:]
        min_log = self._at(self.tables.posterior_log_variance_clipped, i, x)
        max_log = self._at(self.tables.log_betas, i, x)
        frac = (v + 1) / 2
        log_variance = frac * max_log + (1 - frac) * min_log
        pred_x0 = (self._at(self.tables.sqrt_recip_alphas_cumprod, i, x) * x
                   - self._at(self.tables.sqrt_recipm1_alphas_cumprod, i, x) * eps).clamp(-1, 1)
        mean = (self._at(self.tables.posterior_mean_coef1, i, x) * pred_x0
                + self._at(self.tables.posterior_mean_coef2, i, x) * x)
        sample = mean
        if i > 0 and noise is not None:
            sample = mean + torch.exp(0.5 * log_variance) * noise * temperature
        return {"mean": mean, "log_variance": log_variance, "pred_xstart": pred_x0, "sample": sample}


NoiseSource = Callable[[int, int], torch.Tensor]


def torch_noise(generator: torch.Generator | None = None, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> NoiseSource:
    """``noise(rows, channels)`` from ``generator`` (None: the global torch generator, as the official code)."""
    def draw(rows: int, channels: int) -> torch.Tensor:
        gen_device = generator.device if generator is not None else device
        out = torch.randn(rows, channels, generator=generator, device=gen_device, dtype=torch.float32)
        return out.to(device=device, dtype=dtype)
    return draw


class DiffusionHead(nn.Module):
    """``diffloss``: the net (``diffloss.net.*``) and the respaced sampler."""

    def __init__(self, target_channels: int, cond_channels: int, width: int, depth: int, steps: int = 8):
        super().__init__()
        self.in_channels = target_channels
        self.net = SimpleMLPAdaLN(target_channels, width, 2 * target_channels, cond_channels, depth)
        self.default_steps = int(steps)
        self._processes: dict[int, RespacedDiffusion] = {}

    def process(self, steps: int | None = None) -> RespacedDiffusion:
        steps = int(steps or self.default_steps)
        if steps not in self._processes:
            self._processes[steps] = RespacedDiffusion(steps)
        return self._processes[steps]

    @torch.no_grad()
    def sample(self, z_nC: torch.Tensor, cfg=1.0, temperature: float = 1.0, steps: int | None = None,
               noise: NoiseSource | None = None, trace: list | None = None, cond_only: bool = False
               ) -> torch.Tensor:
        """``[n, Cvae]`` residual tokens (×``VAE_SCALE``) for the conditions ``z`` (official ``DiffLoss.sample``).

        ``cfg`` a float: exactly 1.0 → unguided (every row on its own condition), else (0 included) rows
        ``[cond ; uncond]`` guided with ``(1+s)·ε_c − s·ε_u``. ``cfg`` a ``[n/2]`` tensor: per conditional row
        (always the guided branch). ``cond_only``: ``z`` is only the conditional half of the official call's rows
        (``cfg`` must be 0 or exactly 1.0, where that half does not depend on the other): each row is denoised on
        its own condition, the noise drawn as the full call draws it — guided (0): ``n`` rows initially and ``2n``
        at every step; unguided (1.0): ``2n`` rows each time; the first ``n`` used. ``noise``: a noise source
        (default: the global generator). ``trace``: filled with one dict per step (``x_t``, ``t_index``,
        ``model_timesteps``, ``model_out``, ``mean``, ``log_variance``, ``pred_xstart``, ``sample``, ``noise``:
        the whole draw) plus ``{"noise_init": …}`` (the whole draw) first.
        """
        noise = noise or torch_noise(None, z_nC.device, z_nC.dtype)
        n = z_nC.shape[0]
        if cond_only:
            if isinstance(cfg, torch.Tensor) or float(cfg) not in (0.0, 1.0):
                raise ValueError(f"cond_only needs cfg 0 or 1.0 (the unconditional rows change the result at cfg "
                                 f"{cfg!r}): pass the [cond ; uncond] rows")
            guided = False  # the conditional half of either branch: ε_c and v_c of each row on its own condition
            init_rows, step_rows = (n, 2 * n) if float(cfg) == 0.0 else (2 * n, 2 * n)
        else:
            guided = isinstance(cfg, torch.Tensor) or float(cfg) != 1.0
            if guided and n % 2:
                raise ValueError(f"guided diffusion needs [cond ; uncond] rows (an even count), got {n}")
            init_rows, step_rows = (n // 2 if guided else n), n
        init = noise(init_rows, self.in_channels)
        x = init[:n // 2].repeat(2, 1) if guided else init[:n]
        x = x.to(z_nC.dtype)
        if trace is not None:
            trace.append({"noise_init": init})
        proc = self.process(steps)
        tmap = proc.tables.timestep_map.to(z_nC.device)
        for i in reversed(range(proc.steps)):
            t_model = tmap[i].expand(n)
            out = self.net.forward_with_cfg(x, t_model, z_nC, cfg) if guided else self.net(x, t_model, z_nC)
            step_noise = noise(step_rows, self.in_channels)
            step = proc.p_step(out, x, i, step_noise[:n].to(x.dtype), temperature)
            if trace is not None:
                trace.append({"x_t": x, "t_index": torch.full((n,), i, dtype=torch.long), "model_timesteps": t_model,
                              "model_out": out, "noise": step_noise, **step})
            x = step["sample"]
        return x * VAE_SCALE
