"""``python -m profilers.bounded_counts``: the two ways a data-dependent kept count becomes a shape, side by side.

NOVA's layer linkage (arXiv 2602.01345 §2.3, RECONSTRUCTED in specs/methods.md) sets block l's kept count from the
logit lens after block l − 1, so an exact-shape run reads every pruned block's count on the host
(``count_sync='per_block'``: one GPU stall per pruned block). ``count_sync='bounded'`` (the ``nova`` preset's
setting) runs each row's host-known upper bound of tokens and masks the slots past its count on the device. For each preset and batch size this prints, measured in one run on the same model: host
synchronisations per generation (``profilers.host_syncs``' counter), the kept tokens per pruned block (valid slots)
and the width that ran (the bound), FLOPs as executed relative to the dense baseline, wall time per generation
(interleaved rounds, the median) and whether both modes sampled the same tokens. NOVA's preset runs ``bounded``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

MODES = ("per_block", "bounded")


def _generate(adapter, config, batch_size: int, seed: int = 1000, counter=None):
    from var_core.accel.policy import build_policy
    from var_core.engine.loop import GenerationOptions, generate
    from var_core.engine.sampling import SamplingConfig
    from profilers.host_syncs import ScaleTracer

    policy = None if config is None else build_policy(config)
    labels = (torch.arange(batch_size) % adapter.cfg.num_classes).to(adapter.device)
    seeds = list(range(seed, seed + batch_size))
    options = GenerationOptions(check_finite=False, decode=False)
    with torch.inference_mode():
        if counter is None:
            return generate(adapter, labels, seeds, SamplingConfig(), policy=policy, options=options)
        with counter:
            return generate(adapter, labels, seeds, SamplingConfig(), policy=policy,
                            tracer=ScaleTracer(counter), options=options)


def _widths(records) -> tuple[float, float]:
    """(valid tokens, tokens the per-token work ran on) per pruned block and network row, averaged over the blocks
    that ran a selection: a packed block runs each row's own count or bound (``packed_tokens`` / rows), an unpacked
    one the rectangle's width."""
    valid, ran = [], []
    for record in records:
        for block, counts in enumerate(record.kept_tokens):
            marks = record.valid_tokens_R[block] if record.valid_tokens_R else (None,) * len(counts)
            packed = record.packed_tokens[block] if record.packed_tokens else (None,) * len(counts)
            for n, v, total in zip(counts, marks, packed):
                if n < record.hw[0] * record.hw[1] or v is not None:
                    rows = 1 if v is None else v.numel()
                    ran.append(float(n) if total is None else total / rows)
                    valid.append(float(n) if v is None else float(v.double().mean()))
    if not ran:
        return float("nan"), float("nan")
    return statistics.fmean(valid), statistics.fmean(ran)


def measure(adapter, preset: str, batch_size: int, rounds: int) -> list[dict]:
    """One row per mode: syncs, kept and executed widths, FLOPs ratio, median seconds, same tokens as per_block."""
    from profilers.flops import arch_from_adapter, count_record_flops
    from profilers.host_syncs import HostSyncCounter
    from var_core.accel.presets import get_preset

    arch = arch_from_adapter(adapter)
    base = _generate(adapter, None, batch_size)
    base_flops = count_record_flops(arch, base.records, batch_size).total
    configs = {mode: dataclasses.replace(get_preset(preset), count_sync=mode) for mode in MODES}
    runs, syncs = {}, {}
    for mode, config in configs.items():
        counter = HostSyncCounter()
        runs[mode] = _generate(adapter, config, batch_size, counter=counter)
        syncs[mode] = len(counter.events)
    seconds = {mode: [] for mode in MODES}
    for _ in range(rounds):  # interleaved, so load on a shared machine hits both modes alike
        for mode, config in configs.items():
            start = time.perf_counter()
            _generate(adapter, config, batch_size)
            seconds[mode].append(time.perf_counter() - start)
    reference = [r.tokens_BN for r in runs["per_block"].records if r.tokens_BN is not None]
    rows = []
    for mode in MODES:
        records = runs[mode].records
        tokens = [r.tokens_BN for r in records if r.tokens_BN is not None]
        kept, ran = _widths(records)
        rows.append(dict(
            preset=preset, batch=batch_size, mode=mode, syncs=syncs[mode],
            syncs_per_scale=syncs[mode] / adapter.num_scales, kept=kept, ran=ran,
            flops_ratio=count_record_flops(arch, records, batch_size).total / base_flops,
            seconds=statistics.median(seconds[mode]),
            same_tokens=len(tokens) == len(reference) and all(torch.equal(a, b) for a, b in zip(tokens, reference)),
        ))
    return rows


def main(argv: list[str] | None = None) -> int:
    from var_core.zoo import load_model

    parser = argparse.ArgumentParser(prog="python -m profilers.bounded_counts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="testbed", help="zoo entry of a class-conditional VAR (default testbed)")
    parser.add_argument("--presets", nargs="+", default=["nova"], help="presets with data-dependent counts")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    adapter = load_model(args.model)
    print(f"# count_sync per_block vs bounded: model={args.model} scales={adapter.num_scales} "
          f"device={adapter.device} torch={torch.__version__} rounds={args.rounds} (profilers.bounded_counts)")
    print(f"{'preset':<10} {'batch':>5} {'mode':<10} {'syncs':>6} {'/scale':>7} {'kept/row':>9} {'ran/row':>8} "
          f"{'FLOPs ratio':>11} {'s/gen':>8} same tokens")
    for preset in args.presets:
        for batch in args.batch:
            for row in measure(adapter, preset, batch, args.rounds):
                print(f"{row['preset']:<10} {row['batch']:>5} {row['mode']:<10} {row['syncs']:>6} "
                      f"{row['syncs_per_scale']:>7.1f} {row['kept']:>9.1f} {row['ran']:>8.1f} "
                      f"{row['flops_ratio']:>11.3f} {row['seconds']:>8.3f} {row['same_tokens']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
