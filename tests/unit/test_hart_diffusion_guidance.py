"""HART's residual diffusion head under guidance: which branch the official sampler takes at every cfg (cfg 0
included), and per-sample guidance stops.

The reference below is written in this test from the official control flow (``DiffLoss.sample`` →
``p_sample_loop`` → ``p_sample`` with learned-range variance, mit-han-lab/hart): ``not cfg == 1.0`` selects the
guided branch (initial noise for half the rows, duplicated; ``forward_with_cfg``), so cfg 0 is *guided* with
guidance 0 and draws noise for both halves at every step; exactly 1.0 is unguided. Its process tables are the
official ones recorded in ``golden_diffusion.pt``; only the MLP (``diffloss.net``, checked against the official
``net_direct`` golden by the verifier) is ours. The transformer side (tokens, the diffusion condition of both halves)
comes from our loop with the official row layout (both halves at every cfg), which the AR goldens pin.

Fixture: ``shared/fixtures/official_hart_tiny`` or ``$VARSCOPE_HART_FIXTURE``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from var_core.engine import GenerationOptions, GuidanceMode, ScalePlan, generate
from var_core.engine.adapters.hart_adapter import HARTAdapter, HARTSamplingConfig
from var_core.engine.policy import Policy
from var_core.models.hart_text import HARTContext
from var_core.zoo import load_model

REPO = Path(__file__).resolve().parents[2]
FIXTURE_DIR = Path(os.environ.get("VARSCOPE_HART_FIXTURE", REPO.parent / "shared" / "fixtures" / "official_hart_tiny"))
needs_fixture = pytest.mark.skipif(
    not (FIXTURE_DIR / "llm" / "config.json").is_file(),
    reason=f"official HART fixture not found at {FIXTURE_DIR} (set VARSCOPE_HART_FIXTURE)")

TORCH_SEED, G_SEED = 1234, 0


def _greedy(cfg: float, **kw) -> HARTSamplingConfig:
    # top_p 1e-4 keeps only the argmax (the fixture's greedy runs); no Gumbel smoothing
    return HARTSamplingConfig(cfg=cfg, top_k=600, top_p=1e-4, more_smooth=False, **kw)


class _BothHalves(HARTAdapter):
    """The official row layout at every cfg: conditional and unconditional rows (official HART always runs both)."""

    def initial_guidance(self, sampling):
        return GuidanceMode.BOTH


def _official_diffusion(net, z: torch.Tensor, cfg: float, tables: dict, timestep_map, temperature: float = 1.0):
    """``DiffLoss.sample(z, temperature, cfg)`` of the official code, from its control flow; returns the result
    (×0.6) and the list of global-generator draws (their shapes)."""
    n, C = z.shape[0], net.in_channels
    draws = []

    def randn(rows):
        draws.append((rows, C))
        return torch.randn(rows, C)

    if not cfg == 1.0:  # the official condition for the guided branch
        half = randn(n // 2)
        x = torch.cat([half, half])

        def model(x, t):
            h = x[: n // 2]
            out = net(torch.cat([h, h]), t, z)
            eps, rest = out[:, :C], out[:, C:]
            cond_eps, uncond_eps = eps[: n // 2], eps[n // 2:]
            mixed = cond_eps * (1 + cfg) - cfg * uncond_eps
            return torch.cat([torch.cat([mixed, mixed]), rest], dim=1)
    else:
        x = randn(n)

        def model(x, t):
            return net(x, t, z)

    def at(name, i):  # _extract_into_tensor: the float64 table entry cast to fp32
        return tables[name][i].float()

    log_betas = torch.log(tables["betas"])
    for i in reversed(range(len(timestep_map))):
        out = model(x, torch.full((n,), int(timestep_map[i]), dtype=torch.long))
        eps, v = out[:, :C], out[:, C:]
        frac = (v + 1) / 2
        log_var = frac * log_betas[i].float() + (1 - frac) * at("posterior_log_variance_clipped", i)
        x0 = (at("sqrt_recip_alphas_cumprod", i) * x - at("sqrt_recipm1_alphas_cumprod", i) * eps).clamp(-1, 1)
        mean = at("posterior_mean_coef1", i) * x0 + at("posterior_mean_coef2", i) * x
        draws.append(tuple(x.shape))
        noise = torch.randn_like(x)
        x = mean + float(i != 0) * torch.exp(0.5 * log_var) * noise * temperature
    return x * 0.6, draws


def _fixture_context() -> HARTContext:
    inp = torch.load(FIXTURE_DIR / "inputs.pt", weights_only=True)
    return HARTContext(inp["context_tensor"], inp["context_mask"], inp["context_position_ids"])


def _run(adapter, ctx, sampling):
    """One generation in the official RNG order; returns the result and the global generator's state after it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TORCH_SEED)
        result = generate(adapter, ctx, sampling=sampling, shared_generator=torch.Generator().manual_seed(G_SEED))
        return result, torch.get_rng_state()


def _to_map(tokens_BNC: torch.Tensor, side: int) -> torch.Tensor:
    B, N, C = tokens_BNC.shape
    return tokens_BNC.transpose(1, 2).reshape(B, C, side, side)  # row-major token order


@pytest.fixture(scope="module")
def official_tiny():
    if not (FIXTURE_DIR / "llm" / "config.json").is_file():
        pytest.skip(f"official HART fixture not found at {FIXTURE_DIR}")
    return load_model("official-hart-tiny", weights=FIXTURE_DIR)


def _reference_run(adapter: HARTAdapter, cfg: float) -> dict:
    """What the official sampler produces at ``cfg`` (greedy tokens), from the reference diffusion above."""
    ctx = _fixture_context()
    both = _BothHalves(adapter.model, adapter.tokenizer, keep_diffusion_trace=True)
    full, _ = _run(both, ctx, _greedy(cfg))  # the official transformer rows: z of both halves
    plain, _ = _run(adapter, ctx, _greedy(cfg, diffusion=False))  # the discrete latent (official final_stage=1)
    gd = torch.load(FIXTURE_DIR / "golden_diffusion.pt", weights_only=True)["schedule"]
    N = adapter.cfg.num_scales
    t = cfg * ((N - 2) / (N - 1))  # the official loop: t = cfg·ratio with the ratio of scale N−2
    z = both.last_diffusion["z"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TORCH_SEED)  # no other global draw happens before the diffusion head
        out, draws = _official_diffusion(adapter.model.diffloss.net, z, t, gd["gen"], gd["timestep_map"])
        state = torch.get_rng_state()
    B, L = plain.tokens[-1].shape
    residual = out[: B * L].view(B, L, -1)  # the conditional half
    side = adapter.cfg.patch_nums[-1]
    return {"t": t, "z": z, "out": out, "draws": draws, "rng_state": state, "residual": residual,
            "tokens": full.tokens, "plain": plain, "latent": plain.latent + _to_map(residual, side)}


# ---------------------------------------------------------------------------------------------------------------
# which branch at which cfg
# ---------------------------------------------------------------------------------------------------------------
@needs_fixture
@pytest.mark.parametrize("cfg", [0.0, 1.0, 7 / 6, 4.5], ids=["cfg0", "cfg1", "t_exactly_1", "cfg4.5"])
def test_diffusion_head_matches_the_official_branch_at_every_cfg(official_tiny, cfg):
    """cfg 0: guided with guidance 0 (noise for both halves at every step); t = cfg·6/7 == 1.0 exactly (cfg 7/6):
    the unguided branch over both halves; otherwise guided. The latent, the image, the residual tokens and the
    global generator's state after the run equal the official control flow's."""
    ref = _reference_run(official_tiny, cfg)
    ours, state = _run(official_tiny, _fixture_context(), _greedy(cfg))
    assert all(torch.equal(a, b) for a, b in zip(ours.tokens, ref["tokens"]))
    assert torch.equal(state, ref["rng_state"]), "different global-generator draws than the official branch"
    residual = ours.latent - ref["plain"].latent
    assert float((residual - (ref["latent"] - ref["plain"].latent)).abs().max()) <= 2e-4
    assert float(ref["residual"].abs().max()) > 1e-2  # the residual is far above that tolerance
    image = official_tiny.tokenizer.fhat_to_img(ref["latent"]).add(1).mul(0.5)
    assert float((ours.images - image).abs().max()) <= 1e-4


@needs_fixture
def test_cfg0_draws_noise_like_the_guided_branch(official_tiny):
    """cfg 0 at B = 2, 12×12 last scale (N = 144 tokens per sample): the initial draw is 288 × 16 (half of the
    576 network rows, duplicated), then 8 draws of 576 × 16; the unguided branch would draw 288 every time."""
    ref = _reference_run(official_tiny, 0.0)
    assert ref["t"] == 0.0 and ref["draws"] == [(288, 16)] + [(576, 16)] * 8
    traced = HARTAdapter(official_tiny.model, official_tiny.tokenizer, keep_diffusion_trace=True)
    ours, _ = _run(traced, _fixture_context(), _greedy(0.0))
    trace = traced.last_diffusion["trace"]
    assert tuple(trace[0]["noise_init"].shape) == (288, 16)
    assert [tuple(s["noise"].shape) for s in trace[1:]] == [(576, 16)] * 8
    assert traced.last_diffusion["cfg"] == 0.0
    assert ours.records[-1].guidance is GuidanceMode.COND_ONLY  # no unconditional rows computed at cfg 0


# ---------------------------------------------------------------------------------------------------------------
# the verifier on a cfg-0 golden built from the official control flow
# ---------------------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cfg0_golden(adapter: HARTAdapter) -> dict:
    """A ``golden_ar_greedy_cfg0.pt`` in the fixture's "medium" format (README keys), from the reference."""
    ref = _reference_run(adapter, 0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TORCH_SEED)
        init = torch.randn(ref["draws"][0])
        steps = [torch.randn(shape) for shape in ref["draws"][1:]]
    plain = ref["plain"]
    tok = adapter.tokenizer
    image = tok.fhat_to_img(ref["latent"])
    f_hat, next_inputs, p = [], [], adapter.cfg.patch_nums
    acc = torch.zeros_like(ref["latent"])
    for si, idx in enumerate(ref["tokens"][:-1]):
        acc, nxt = tok.next_autoregressive_input(si, acc, tok.embed_idx(idx, p[si]))
        f_hat.append(acc)
        next_inputs.append(nxt)
    return {
        "args": {"B": 2, "cfg": 0.0, "top_p": 1e-4, "more_smooth": False, "g_seed": G_SEED,
                 "torch_manual_seed_before_call": TORCH_SEED, "num_maskgit_iters": 1, "final_stage": 0},
        "idx_Bl": list(ref["tokens"]), "image": image.add(1).mul(0.5), "img_decode": image,
        "final_f_hat": ref["latent"], "diffusion_cfg": ref["t"], "diffusion_z": ref["z"],
        "diffusion_out": ref["out"], "residual_tokens": ref["residual"], "diffusion_noise_init": init,
        "diffusion_noise_steps": steps, "n_global_randn": 1, "n_global_randn_like": len(steps),
        "guided_logits": [r.guided_logits_BNV for r in plain.records], "f_hat": f_hat, "next_input": next_inputs,
        "sampler_top_k": [600] * 7 + [300], "sampler_top_p": [1e-4] * 8, "gumbel_calls": 0,
    }


@needs_fixture
def test_verify_passes_a_cfg0_golden_of_the_official_behaviour(official_tiny, tmp_path):
    """A fixture holding only the model folders, the inputs and a cfg-0 AR golden built from the official control
    flow: every check passes, including the ones the unguided cfg-0 path failed (image, final latent, residual
    tokens, diffusion outputs and noise, diffusion cfg, the condition of both halves)."""
    from var_core.verify.hart import verify_hart_fixture

    for sub in ("llm", "tokenizer"):
        shutil.copytree(FIXTURE_DIR / sub, tmp_path / sub)
    for name in ("config.json", "inputs.pt"):
        shutil.copy(FIXTURE_DIR / name, tmp_path / name)
    torch.save(_cfg0_golden(official_tiny), tmp_path / "golden_ar_greedy_cfg0.pt")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    (tmp_path / "SHA256SUMS").write_text("".join(f"{_sha256(tmp_path / f)}  {f}\n" for f in files))
    checks = verify_hart_fixture(tmp_path)
    failed = [c.line() for c in checks if c.passed is False]
    assert not failed, "\n".join(failed)
    passed = {c.name for c in checks if c.passed}
    for key in ("tokens", "image", "final_f_hat", "img_decode", "diffusion_cfg", "diffusion_z", "residual_tokens",
                "diffusion_out", "diffusion_noise_init (global RNG order)", "diffusion_noise_steps", "guided_logits"):
        assert f"llm/greedy_cfg0/{key}" in passed, key
    z_check = next(c for c in checks if c.name == "llm/greedy_cfg0/diffusion_z")
    assert "conditional rows" in z_check.note


# ---------------------------------------------------------------------------------------------------------------
# per-sample guidance stop in the diffusion head
# ---------------------------------------------------------------------------------------------------------------
class _StopAtLast(Policy):
    """At the last scale: per-sample stop (``cond_only_B``), or (``drop``) the whole batch's unconditional rows."""

    name = "test/stop-at-last"

    def __init__(self, stopped_B: list[bool] | None = None, drop: bool = False):
        self.stopped_B, self.drop = stopped_B, drop

    def plan_scale(self, ctx) -> ScalePlan:
        if not ctx.is_last:
            return ScalePlan()
        if self.drop:
            return ScalePlan(guidance=GuidanceMode.COND_ONLY)
        return ScalePlan(cond_only_B=torch.tensor(self.stopped_B) if self.stopped_B is not None else None)


def test_per_sample_guidance_stop_denoises_each_sample_as_alone():
    """Batch [stopped, guided] with per-sample seeds (batch-independent results): the stopped sample's latent equals
    it generated alone with the unconditional rows dropped at the last scale (the conditional prediction, no
    per-sample mixing involved), the other equals it generated alone with guidance."""
    tiny = load_model("random:hart-tiny")
    sampling = HARTSamplingConfig(cfg=4.5, top_k=600, top_p=0.0, more_smooth=False)
    opts = GenerationOptions(decode=False)
    batch = generate(tiny, [3, 5], seeds=[11, 12], sampling=sampling, policy=_StopAtLast([True, False]),
                     options=opts)
    stopped_alone = generate(tiny, [3], seeds=[11], sampling=sampling, policy=_StopAtLast(drop=True), options=opts)
    guided_alone = generate(tiny, [5], seeds=[12], sampling=sampling, options=opts)
    assert all(torch.equal(t[0:1], a) for t, a in zip(batch.tokens, stopped_alone.tokens))
    assert all(torch.equal(t[1:2], a) for t, a in zip(batch.tokens, guided_alone.tokens))
    assert float((batch.latent[0:1] - stopped_alone.latent).abs().max()) <= 1e-4
    assert float((batch.latent[1:2] - guided_alone.latent).abs().max()) <= 1e-4
    # the two treatments of one sample differ far beyond that tolerance (the test can tell them apart)
    guided_0 = generate(tiny, [3], seeds=[11], sampling=sampling, options=opts)
    assert float((guided_0.latent - stopped_alone.latent).abs().max()) > 1e-2
