"""The per-sample top-k/top-p draw (inverse CDF over the top-k survivors) against hand-worked distributions.

Expected values are computed here from first principles (explicit probabilities, the uniform the generator
yields), never with the sampler's own helpers.
"""

import math

import pytest
import torch

from var_core.engine.sampling import SamplingConfig, draw_categorical

# token probabilities 0.4, 0.3, 0.15, 0.1, 0.05 placed at shuffled vocabulary positions
PROBS = {3: 0.4, 0: 0.3, 5: 0.15, 1: 0.1, 4: 0.05}
V = 6  # position 2 has probability 0 (logit -30: effectively never)


def _logits() -> torch.Tensor:
    logits = torch.full((V,), -30.0)
    for position, p in PROBS.items():
        logits[position] = math.log(p)
    return logits


def test_one_uniform_per_token_maps_through_the_renormalised_cdf():
    """top_k=3 keeps {3: .4, 0: .3, 5: .15} → renormalised .4706, .3529, .1765; the CDF runs over the survivors in
    vocabulary order (0, 3, 5): the draw is the first survivor whose cumulative mass exceeds u·total, u the sample
    generator's next float64 uniform."""
    N = 64
    logits = _logits().expand(1, N, V).contiguous()
    tokens = draw_categorical(logits, SamplingConfig(top_k=3, top_p=0.0, draw="inverse_cdf"),
                              [torch.Generator().manual_seed(7)])
    uniforms = torch.rand(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    kept = [(0, 0.3), (3, 0.4), (5, 0.15)]  # vocabulary order
    total = sum(p for _, p in kept)
    expected = []
    for u in uniforms.tolist():
        cumulative = 0.0
        for position, p in kept:
            cumulative += p / total
            if u < cumulative:
                expected.append(position)
                break
        else:
            expected.append(kept[-1][0])
    assert tokens.view(-1).tolist() == expected
    assert set(expected) == {3, 0, 5}  # the seed exercises every survivor


def test_inverse_cdf_stays_coupled_when_two_survivors_swap_ranks():
    """Tokens 0 and 3 at probabilities .35 ± 1e-4 swap ranks between two runs; in vocabulary order the CDF moves
    by 2e-4 at most, so with the same uniforms at most a few of 4000 draws change (in probability order the two
    intervals would trade places and about 70 % of the draws of those two tokens would change)."""
    N = 4000
    base = torch.full((V,), -30.0)
    for position, p in {0: 0.35 + 1e-4, 3: 0.35 - 1e-4, 5: 0.2, 1: 0.1}.items():
        base[position] = math.log(p)
    swapped = base.clone()
    swapped[0], swapped[3] = base[3], base[0]
    sampling = SamplingConfig(top_k=4, top_p=0.0, draw="inverse_cdf")
    first = draw_categorical(base.expand(1, N, V).contiguous(), sampling, [torch.Generator().manual_seed(9)])
    second = draw_categorical(swapped.expand(1, N, V).contiguous(), sampling, [torch.Generator().manual_seed(9)])
    assert (first != second).sum().item() <= 10


def test_the_default_draw_is_the_official_multinomial():
    assert SamplingConfig().draw == "multinomial"


def test_top_p_drops_the_official_ascending_tail():
    """top_k=4 keeps .4, .3, .15, .1 (mass .95 → .421, .316, .158, .105). Official top-p=0.8 drops the ascending
    prefix with cumulative mass <= 0.2: .105 (cum .105) goes, .158 (cum .263) stays. So token 1 never appears and
    the others appear with .4/.85, .3/.85, .15/.85."""
    N = 4000
    logits = _logits().expand(2, N, V).contiguous()
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    tokens = draw_categorical(logits, SamplingConfig(top_k=4, top_p=0.8, draw="inverse_cdf"), gens)
    counts = torch.bincount(tokens.view(-1), minlength=V).double() / tokens.numel()
    assert counts[1] == 0 and counts[4] == 0 and counts[2] == 0
    for position, p in ((3, 0.4 / 0.85), (0, 0.3 / 0.85), (5, 0.15 / 0.85)):
        sd = math.sqrt(p * (1 - p) / tokens.numel())
        assert abs(counts[position].item() - p) < 5 * sd, (position, counts[position].item(), p)


def test_draws_are_per_sample_and_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 40) * 2
    sampling = SamplingConfig(top_k=10, top_p=0.9, draw="inverse_cdf")
    batch = draw_categorical(logits, sampling, [torch.Generator().manual_seed(s) for s in (11, 12, 13)])
    alone = draw_categorical(logits[1:2], sampling, [torch.Generator().manual_seed(12)])
    assert torch.equal(batch[1:2], alone)
    # every draw is among the sample's 10 largest logits
    top10 = logits.topk(10, dim=-1).indices
    assert bool((top10 == batch.unsqueeze(-1)).any(-1).all())


def test_a_tie_at_the_kth_logit_keeps_every_tied_token_as_the_official_filter_does():
    """logits [2, 1, 1, 0] with top_k=2: the official filter keeps tokens 0, 1 and 2 (2 and 1 tie at the k-th
    value), so token 2 must be drawn about e/(e²+2e) of the time — a top-k of exactly 2 would never draw it."""
    N = 3000
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0]).expand(1, N, 4).contiguous()
    tokens = draw_categorical(logits, SamplingConfig(top_k=2, top_p=0.0, draw="inverse_cdf"),
                              [torch.Generator().manual_seed(3)])
    share = (tokens == 2).double().mean().item()
    p = math.e / (math.e ** 2 + 2 * math.e)
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / N)
    assert not bool((tokens == 3).any())


@pytest.mark.parametrize("top_k", [0, 6])
def test_without_an_active_top_k_the_multinomial_path_is_used(top_k):
    """top_k = 0 or >= V: the official multinomial path, reproducible from torch.multinomial with the same
    generator state."""
    logits = _logits().expand(1, 20, V).contiguous()
    tokens = draw_categorical(logits, SamplingConfig(top_k=top_k, top_p=0.0, draw="inverse_cdf"),
                              [torch.Generator().manual_seed(5)])
    expected = torch.multinomial(logits[0].softmax(-1), 1, replacement=True,
                                 generator=torch.Generator().manual_seed(5)).view(1, 20)
    assert torch.equal(tokens, expected)


def test_multinomial_draw_reproduces_the_previous_stream_and_bad_names_are_refused():
    logits = _logits().expand(2, 30, V).contiguous()
    sampling = SamplingConfig(top_k=4, top_p=0.0, draw="multinomial")
    tokens = draw_categorical(logits, sampling, [torch.Generator().manual_seed(s) for s in (8, 9)])
    masked = logits.clone()
    masked[..., 2] = float("-inf")
    masked[..., 4] = float("-inf")  # the two smallest of six: outside the top 4
    expected = torch.stack([torch.multinomial(masked[b].softmax(-1), 1, replacement=True,
                                              generator=torch.Generator().manual_seed(s)).view(30)
                            for b, s in ((0, 8), (1, 9))])
    assert torch.equal(tokens, expected)
    with pytest.raises(ValueError, match="draw must be one of"):
        SamplingConfig(draw="gumbel")
