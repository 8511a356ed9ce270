"""``python -m studies.gpucheck``: the check to run first on a GPU machine (about 5–8 minutes on one large GPU).

    python -m studies.gpucheck                        # GPU tests, then the Infinity-2B latency report
    python -m studies.gpucheck --skip-tests --out results/gpucheck

1. **The GPU-marked tests** (``pytest -m gpu``, at most ``TEST_TIMEOUT_S`` per test and ``TESTS_TIMEOUT_S`` in all:
   a hung CUDA call fails the check instead of eating its budget): generation, records, probes and the study runner on CUDA — the
   device every tensor moves to (RoPE tables, text encoder), the record's device name, CUDA events and measured
   peak memory, the model staying on the GPU after Lightning's teardown, ``--accelerator auto`` as one decision.
2. **A latency report** of ``random:infinity-2b`` (Infinity-2B's architecture with seeded random weights: no
   checkpoint needed; speed does not depend on the weights' values) at 1024 px (13 scales), batch 1, bfloat16:
   ``baseline`` vs ``fastvar``, ``nova``, ``ldpruning`` and ``toprovar``, through :mod:`studies.latency` (warm-up
   generations discarded, then rounds with every method once in a shuffled order; latency = wall-clock around
   an uninstrumented ``generate()`` synchronised on the timed device before and after, the breakdown from a
   second call with CUDA events per component, CUDA ``max_memory_allocated`` over the whole generation and per
   scale, analytic FLOPs of what each method actually computed).

``<out>/gpucheck.md`` holds the device, the test summary and one row per method: median latency [IQR], the
measured speedup of the transformer (total − text encoding − VQ decode) next to the **FLOPs-ideal** speedup
(baseline FLOPs / method FLOPs, what the method would give if time followed FLOPs), their ratio, and the peak
memory; the full latency report (``report.md``, CSVs) is in ``<out>/latency/``. Exit status 1 when a test failed.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

from studies._args import (ArgumentParser, device_setting, launch_banner, launch_precision, model_family, model_name,
                           non_negative_int, positive_int, precision_setting, preset_name, resolve_device,
                           results_folder)
from studies._cli import note_results_folder, run_cli
from var_core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
METHODS = ("baseline", "fastvar", "nova", "ldpruning", "toprovar")
BUDGET_S = 8 * 60


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m studies.gpucheck", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/gpucheck", type=results_folder, help="output folder")
    p.add_argument("--model", default="random:infinity-2b", type=model_name,
                   help="model of the latency report (default random:infinity-2b, 1024 px)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), type=preset_name,
                   help=f"presets to compare (default {' '.join(METHODS)}; baseline is always the reference)")
    p.add_argument("--precision", default=None, type=precision_setting,
                   help="precision of the latency report (default: the official sampler's: Infinity bf16-autocast, "
                        "VAR fp16-autocast+tf32, HART fp16-autocast; fp32 on a CPU dry run)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="former option, an alias: float32 = --precision fp32, bfloat16 = --precision bf16")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds per method (default 3)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="discarded generations per method (default 1)")
    p.add_argument("--device", default="auto", type=device_setting,
                   help="device of the latency report: auto (default: cuda when torch sees a CUDA GPU), cuda, "
                        "cuda:N; cpu: a dry run of this script's steps on the CPU (its numbers are not a GPU check)")
    p.add_argument("--skip-tests", action="store_true", help="only the latency report")
    p.add_argument("--plots", action="store_true", help="also the latency report's figures (slower)")
    return p


TESTS_TIMEOUT_S = 900  # the whole `pytest -m gpu` run (the check's budget is 8 minutes; a hang must not eat it)
TEST_TIMEOUT_S = 300  # one test (pytest-timeout), so one hung CUDA call fails that test, not the check


def run_gpu_tests(log=print, timeout: float = TESTS_TIMEOUT_S) -> dict:
    """``pytest -m gpu`` on the repository's tests, in a subprocess with a time limit (per test through
    pytest-timeout, and ``timeout`` seconds for the whole run: then the run is killed and reported as timed out);
    its summary line and exit status."""
    tests = REPO / "tests"
    if not tests.is_dir():
        return {"returncode": None, "summary": f"not run: no tests folder at {tests}", "seconds": 0.0}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(tests)]
    import importlib.util

    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd[4:4] = [f"--timeout={int(min(TEST_TIMEOUT_S, timeout))}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log(out[-6000:])
        return {"returncode": "timeout", "summary": f"timed out after {timeout:.0f} s (killed; the output so far is "
                f"above)", "seconds": time.perf_counter() - start}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
    if proc.returncode not in (0, 5):  # 5: no tests collected
        log(proc.stdout[-6000:] + proc.stderr[-2000:])
    return {"returncode": proc.returncode, "summary": summary if isinstance(summary, str) else summary[0],
            "seconds": time.perf_counter() - start}


def method_table(summary) -> list[dict]:
    """One row per method of a ``studies.latency`` summary (the latency batch)."""
    rows = []
    for _, r in summary.iterrows():
        rows.append({
            "method": r["method"], "total_ms": r["total_ms"], "total_q1": r["total_q1"], "total_q3": r["total_q3"],
            "transformer_ms": r["transformer_ms"], "speedup": r["speedup_transformer"],
            "ideal_speedup": r["ideal_speedup"], "of_ideal": r["speedup_vs_ideal"],
            "speedup_total": r["speedup_total"], "gflops": r["gflops_transformer"], "peak_mib": r["peak_mib"],
            "overall_peak_mib": r["overall_peak_mib"], "memory_source": r["memory_source"],
        })
    return rows


def _resolution(model: str) -> tuple[int | str, int | str]:
    """(scales, image side in px) of an Infinity zoo model from its spec alone; ``"?"`` for other models."""
    from var_core.zoo import INFINITY_SPECS

    spec = INFINITY_SPECS.get(model.removeprefix("random:"))
    if spec is None or spec.config is None or spec.vae_config is None:
        return "?", "?"
    from var_core.models.infinity import scale_schedule

    schedule = scale_schedule(spec.pn, 1.0, spec.num_scales)
    patchify = 2 if spec.config.apply_spatial_patchify else 1
    return len(schedule), max(schedule[-1][-2:]) * patchify * spec.vae_config.patch_size


def markdown(env: dict, tests: dict, rows: list[dict], settings: dict, seconds: float) -> str:
    lines = ["# GPU check", "",
             f"- device: {env['device']} ({env['device_name']}), torch {env['torch']}, CUDA {env['cuda']}, "
             f"host {env['host']}",
             f"- GPU tests (`pytest -m gpu`): {tests['summary']} ({tests['seconds']:.0f} s)",
             f"- latency: `{settings['model']}` at {settings['image_size']} px ({settings['num_scales']} scales), "
             f"batch 1, {settings['dtype']}, {settings['repeats']} rounds after {settings['warmup']} warm-up "
             f"generation(s) per method; median [IQR] of the whole generate() (synchronised), transformer = total "
             f"− text encoding − VQ decode ({env['timer']} spans); FLOPs-ideal = baseline FLOPs / method FLOPs "
             f"(analytic, of what ran); peak memory: {rows[0]['memory_source'] if rows else '?'}",
             f"- total time: {seconds:.0f} s", "",
             "| method | latency ms | transformer ms | speedup | FLOPs-ideal | speedup / ideal | GFLOPs | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['total_ms']:.0f} [{r['total_q1']:.0f}–{r['total_q3']:.0f}] | "
                     f"{r['transformer_ms']:.0f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x | "
                     f"{r['of_ideal']:.2f} | {r['gflops']:.4g} | {r['peak_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    resolved = resolve_device(args.device)  # auto: the same decision as every command's (CUDA when present)
    dry_run = torch.device(resolved).type == "cpu"
    if dry_run and args.device == "auto":
        raise UserError("the GPU check needs a CUDA GPU (torch.cuda.is_available() is False, so --device auto is the "
                        "CPU); on this machine run the CPU test suite instead (python -m pytest), or --device cpu "
                        "for a dry run of the steps")
    precision = launch_precision(args)
    from var_core.engine.precision import study_precision

    from studies.latency import LatencySettings, run_latency
    from var_core.eval.records import device_name

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    note_results_folder(out)
    device = torch.device(resolved)
    print(launch_banner("gpucheck", args.device, device, precision, model_family(args.model)), flush=True)
    env = {"device": str(device), "device_name": device_name(device), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node(),
           "timer": "CPU-clock" if dry_run else "CUDA-event"}
    print(f"GPU check on {env['device_name']} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}"
          + ("  [dry run on the CPU: not a GPU check]" if dry_run else ""))
    tests = {"returncode": None, "summary": "skipped (--skip-tests)", "seconds": 0.0}
    if not args.skip_tests:
        print("1/2 GPU tests: pytest -m gpu ...")
        tests = run_gpu_tests()
        print(f"    {tests['summary']} ({tests['seconds']:.0f} s)")
    methods = ["baseline"] + [m for m in args.methods if m != "baseline"]
    shown = study_precision(precision, None, model_family(args.model), device)
    print(f"2/2 latency: {args.model}, batch 1, {shown}: {', '.join(methods)} ...")
    settings = LatencySettings(model=args.model, method=methods[1] if len(methods) > 1 else "baseline",
                               compare=tuple(methods), batch_size=1, throughput_batch=0, repeats=args.repeats,
                               warmup=args.warmup, out=str(out / "latency"), device=str(device), precision=precision,
                               plots=args.plots)
    result = run_latency(settings, command="python -m studies.gpucheck " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv))
    rows = method_table(result["summary"])
    rows.sort(key=lambda r: methods.index(r["method"]) if r["method"] in methods else len(methods))
    num_scales, image_size = _resolution(args.model)
    seconds = time.perf_counter() - started
    text = markdown(env, tests, rows, {"model": args.model, "dtype": shown, "repeats": args.repeats,
                                       "warmup": args.warmup, "image_size": image_size,
                                       "num_scales": num_scales}, seconds)
    (out / "gpucheck.md").write_text(text)
    print()
    print(text)
    print(f"report: {out / 'gpucheck.md'} (full latency report: {result['paths']['report_md']})")
    if seconds > BUDGET_S:
        print(f"note: the check took {seconds:.0f} s, over its {BUDGET_S} s budget")
    return 1 if tests["returncode"] not in (None, 0, 5) else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
