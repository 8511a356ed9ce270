"""CPU (or GPU) time of the attention seam's kernels on one SparVAR-shaped pattern:
``python -m profilers.sparse_attention_bench [--shape tiny-1m|testbed|2b-1m] [--repeats 3] [--compile]``.

The pattern is the one :class:`~var_core.accel.attention.sparvar.SparVAR` builds for the LAST scale of a schedule
at its default setting: the top 20 % of the decision scale's keys per group of 192 queries (drawn at random here:
the count, not the choice, decides the time), a 9×9 window on the query's own scale and 3×3 on the scale between.
Queries, keys and values are random ``[R, H, n, d]`` float32 tensors. Kernels (``engine.attention``):

* ``dense``     — one SDPA call without a mask (the plain model; every ratio is against it);
* ``reference`` — materialised logits, masked softmax (the tests' reference);
* ``sdpa``      — SDPA with the boolean mask ``[R, H, n, L]``;
* ``gather``    — per query group, SDPA on the gathered union of the group's keys;
* ``flex``      — FlexAttention with a BlockMask (eager on the CPU; ``--compile``: torch.compile'd, compile time
  reported separately and left out of the timed region).

Timed region: one kernel call (CUDA: synchronised before and after), pattern construction included for the masked
kernels (they rebuild it per call in the engine too). One warm-up call, then ``--repeats`` interleaved rounds;
the report gives medians, minima and the ratio of medians to ``dense``, and the attended fraction of the pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from var_core.accel.attention.sparvar import scale_windows, top_key_mask
from var_core.engine.attention import AttentionPattern, sdpa, sparse_attention

INFINITY_1M = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
SHAPES = {  # name: (side of each scale, rows R, heads H, head dim d)
    "tiny-1m": (INFINITY_1M, 2, 2, 32),  # random:infinity-tiny on the 1M schedule (num_scales=13), batch 1
    "testbed": ((1, 2, 3, 4, 5, 6, 8, 10, 13, 16), 2, 4, 64),  # 'testbed' as shipped (its heads and width), batch 1
    "2b-1m": (INFINITY_1M, 2, 16, 128),  # Infinity-2B's last scale, batch 1 (slow on a CPU)
}
KERNELS = ("dense", "reference", "sdpa", "gather", "flex")


def sparvar_pattern(sides, heads: int, rows: int, kernel: str, seed: int = 0, top_keys: float = 0.2,
                    query_block: int = 192) -> AttentionPattern:
    """SparVAR's default pattern for the last scale of ``sides`` (decision scale −3) with random top keys."""
    hw = tuple((s, s) for s in sides)
    K, S = len(sides) - 1, len(sides) - 3
    n = sides[K] ** 2
    decision_keys = sum(s * s for s in sides[:S + 1])
    groups = -(-sides[S] ** 2 // query_block)
    mass = torch.rand(rows, heads, groups, decision_keys, generator=torch.Generator().manual_seed(seed))
    keys = top_key_mask(mass, max(1, round(top_keys * decision_keys)))
    decision_groups, target_groups = groups, -(-n // query_block)
    centres = (torch.arange(target_groups, dtype=torch.float64) + 0.5) / target_groups * decision_groups - 0.5
    nearest = centres.round().long().clamp_(0, decision_groups - 1)
    windows = scale_windows(hw, K, 9, 3, S + 1)
    return AttentionPattern(n, windows.num_keys, key_blocks_RHGL=keys.index_select(2, nearest),
                            query_block=query_block, windows=windows, kernel=kernel)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny-1m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd FlexAttention")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated subset of {','.join(KERNELS)} (dense is always run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sides, R, H, d = SHAPES[args.shape]
    n = sides[-1] ** 2
    L = sum(s * s for s in sides)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(R, H, m, d, generator=gen).to(device) for m in (n, L, L))
    scale = d ** -0.5

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(kernel: str):
        if kernel == "dense":
            return sdpa(q, k, v, scale=scale)
        return sparse_attention(q, k, v, sparvar_pattern(sides, H, R, kernel), scale)[0]

    kernels = ["dense"] + [kern for kern in args.kernels.split(",") if kern in KERNELS and kern != "dense"]
    compile_s = None
    if args.compile:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        mask_mod = sparvar_pattern(sides, H, R, "flex").mask_mod(R, H, device)
        block_mask = create_block_mask(mask_mod, R, H, n, L, device=device.type)
        t0 = time.perf_counter()
        compiled(q, k, v, block_mask=block_mask, scale=scale)
        sync()
        compile_s = time.perf_counter() - t0
        kernels.append("flex_compiled")

    def timed(kernel: str) -> float:
        sync()
        t0 = time.perf_counter()
        if kernel == "flex_compiled":
            compiled(q, k, v, block_mask=block_mask, scale=scale)
        else:
            run(kernel)
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        outputs = {kern: run(kern) for kern in ["reference"] + kernels if kern in KERNELS and kern != "dense"}
        if args.compile:
            outputs["flex_compiled"] = compiled(q, k, v, block_mask=block_mask, scale=scale)
        errors = {kern: float((o.float() - outputs["reference"].float()).abs().max()) for kern, o in outputs.items()}
        pattern = sparvar_pattern(sides, H, R, "sdpa")
        sparse_attention(q, k, v, pattern, scale)
        attended = pattern.take_pairs() / (R * n * L)
        for kern in kernels:
            timed(kern)  # warm-up
        times = {kern: [] for kern in kernels}
        for _ in range(args.repeats):
            for kern in kernels:
                times[kern].append(timed(kern))
    dense = statistics.median(times["dense"])
    result = {"shape": args.shape, "R": R, "H": H, "n": n, "L": L, "d": d, "device": str(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "attended_fraction": attended,
              "compile_s": compile_s, "max_abs_error_vs_reference": errors, "kernels": {}}
    print(f"{args.shape}: R={R} H={H} n={n} L={L} d={d} on {device} ({torch.get_num_threads()} threads, torch "
          f"{torch.__version__}); SparVAR pattern attends {attended:.1%} of the pairs")
    print(f"{'kernel':<15}{'median s':>10}{'min s':>10}{'x dense':>9}  max |err| vs reference")
    for kern in kernels:
        med, low = statistics.median(times[kern]), min(times[kern])
        result["kernels"][kern] = {"median_s": med, "min_s": low, "ratio_to_dense": med / dense}
        err = errors.get(kern)
        print(f"{kern:<15}{med:>10.4f}{low:>10.4f}{med / dense:>9.2f}  {'' if err is None else f'{err:.1e}'}")
    if compile_s is not None:
        print(f"flex_compiled: first call (compilation) {compile_s:.1f} s, not in the timed region")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
