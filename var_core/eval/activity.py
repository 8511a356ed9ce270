"""How often each component of an arm acted, from what its scales recorded (issue 31: an arm identical to another
is explained in the table, not only in prose).

Read from the per-batch data a run keeps of its :class:`~var_core.engine.context.ScaleRecord` s (kept and valid
tokens per block and branch, skipped scales, guidance per scale, the policy's per-scale history with its
per-sample guidance stops) and the per-sample activation scale:

* ``activation``: the first accelerated scale of each sample (``num_scales`` = never) and how many samples activated;
* ``kept_per_scale``: per scale, the share of tokens a sample computed over all blocks and branches (1 = dense,
  0 = the scale was skipped); ``pruned_scales``: how many scales computed fewer tokens than dense;
* ``guidance_stopped``: samples whose classifier-free guidance stopped at some scale (``k`` of ``n``);
* ``scales_skipped``: per sample, the mean number of scales not generated (skipped, or after an early stop);
* ``restorer``: branch-token slots the restorer filled (``hits``: pruned slots served from its cache or rule) and
  slots computed (``misses``), summed over samples, scales, blocks and branches;
* ``components``: per kind, the component's name and whether it acted; ``inactive`` lists the kinds whose
  component is not the no-op one of its kind yet never acted in the run (reported in the table).
"""

from __future__ import annotations

from typing import Any

NO_OP = {"activation": "never", "restorer": "identity", "guidance": "full", "skip": "none"}


def _sample_count(batch: dict) -> int:
    return int(batch.get("size") or len(batch.get("indices") or ()) or 1)


def activity(batches: list[dict], activation_scale: list | None, scale_hw, policy: dict | None) -> dict[str, Any]:
    """The activity of one arm: ``batches`` as :class:`~var_core.eval.lightning.GenerationRun` keeps them,
    ``activation_scale`` per sample (None entries: unknown), ``scale_hw`` the model's scales, ``policy`` the arm's
    ``PolicyConfig.to_dict()`` (None: the plain loop)."""
    num_scales = len(scale_hw)
    n = sum(_sample_count(b) for b in batches)
    kept_sum = [0.0] * num_scales
    kept_n = [0] * num_scales
    stopped_samples = 0
    skipped_scales = 0.0
    hits = misses = 0.0
    for batch in batches:
        size = _sample_count(batch)
        kept = batch.get("valid_tokens") or batch.get("kept_tokens") or []
        skipped = list(batch.get("skipped") or [])
        ran = len(skipped)
        skipped_scales += size * (sum(bool(s) for s in skipped) + max(num_scales - ran, 0))
        for s, (h, w) in enumerate(scale_hw):
            dense = h * w
            if s >= ran or skipped[s]:
                kept_sum[s] += 0.0
                kept_n[s] += size
                continue
            counts = [c for block in (kept[s] if s < len(kept) else []) for c in block]
            if not counts:
                continue
            kept_sum[s] += size * sum(counts) / (len(counts) * dense)
            kept_n[s] += size
            misses += size * sum(counts)
            hits += size * sum(dense - c for c in counts)
        stopped = [False] * size
        guidance = list(batch.get("guidance") or [])
        if guidance and guidance[0] == "both":  # a run that starts without guidance (cfg 1) never "stops" it
            for step in batch.get("history") or []:
                mask = step.get("cond_only")
                if isinstance(mask, list) and len(mask) == size:
                    stopped = [a or bool(b) for a, b in zip(stopped, mask)]
                elif step.get("guidance") not in (None, "both"):
                    stopped = [True] * size
            if any(g != "both" for g in guidance):
                stopped = [True] * size
        stopped_samples += sum(stopped)
    kept_per_scale = [kept_sum[s] / kept_n[s] if kept_n[s] else None for s in range(num_scales)]
    acts = [a for a in (activation_scale or []) if a is not None]
    activated = sum(1 for a in acts if a < num_scales) if acts else None
    pruned_scales = sum(1 for v in kept_per_scale if v is not None and 0 < v < 1 - 1e-12)
    skipped_mean = skipped_scales / n if n else 0.0
    out: dict[str, Any] = {
        "samples": n,
        "activation": {"scale_per_sample": list(activation_scale or []), "activated": activated,
                       "of": len(acts) if acts else None},
        "kept_per_scale": kept_per_scale, "pruned_scales": pruned_scales,
        "guidance_stopped": {"samples": stopped_samples, "of": n},
        "scales_skipped": skipped_mean,
        "restorer": {"hits": hits, "misses": misses},
    }
    out["components"], out["inactive"] = _components(policy, out)
    return out


def _components(policy: dict | None, act: dict) -> tuple[dict, list[str]]:
    if not policy:
        return {}, []
    pruned = act["pruned_scales"] > 0 or act["restorer"]["hits"] > 0
    activated = act["activation"]["activated"]
    acted = {
        "activation": bool(activated) if activated is not None else pruned,
        "scorer": pruned, "schedule": pruned or act["scales_skipped"] > 0,
        "restorer": act["restorer"]["hits"] > 0,
        "guidance": act["guidance_stopped"]["samples"] > 0,
        # a skipped scale is the skip component's unless it is "none" (then the schedule's 100 % ratio skipped it)
        "skip": act["scales_skipped"] > 0 and (policy.get("skip") or {}).get("name") != "none",
    }
    components, inactive = {}, []
    for kind, did in acted.items():
        name = (policy.get(kind) or {}).get("name")
        if name is None:
            continue
        components[kind] = {"name": name, "acted": bool(did)}
        if not did and NO_OP.get(kind) != name and not (kind in ("scorer", "schedule") and not _prunes(policy)):
            inactive.append(f"{kind} {name}")
    return components, inactive


def _prunes(policy: dict) -> bool:
    """Whether a config can prune at all (an arm whose activation never starts is a no-op by its own design)."""
    return (policy.get("activation") or {}).get("name") != "never"


def summary_text(act: dict | None) -> str:
    """One table cell: ``act 2/2 · pruned 2 sc · cfg stop 0/2 · skip 0.0 · fill 38%``."""
    if not act:
        return "–"
    a = act["activation"]
    parts = [f"act {a['activated']}/{a['of']}" if a.get("of") else "act –"]  # –: no activation component
    parts.append(f"pruned {act['pruned_scales']} sc")
    g = act["guidance_stopped"]
    parts.append(f"cfg stop {g['samples']}/{g['of']}")
    parts.append(f"skip {act['scales_skipped']:.1f}")
    r = act["restorer"]
    total = r["hits"] + r["misses"]
    parts.append(f"fill {100 * r['hits'] / total:.0f}%" if total else "fill –")
    return " · ".join(parts)


def activity_lines(records: list[dict]) -> list[str]:
    """The table's activity section: one row per arm, then the components that never acted."""
    rows = [r for r in records if r.get("activity")]
    if not rows:
        return []
    lines = ["Activity per arm (var_core.eval.activity): `act` samples whose acceleration started / samples; "
             "`pruned` scales computed on fewer tokens than dense; `cfg stop` samples whose guidance stopped; "
             "`skip` scales not generated per sample; `fill` share of branch-token slots filled by the restorer "
             "(cache hits) rather than computed (misses); kept tokens per scale in the record (`activity`).\n",
             "| arm | activity | kept per scale | never acted |", "|---|---|---|---|"]
    for r in rows:
        act = r["activity"]
        kept = " ".join("–" if v is None else f"{v:.2f}" for v in act.get("kept_per_scale") or [])
        lines.append(f"| {r['arm']} | {summary_text(act)} | {kept} | {', '.join(act.get('inactive') or []) or '–'} |")
    never = [(r["arm"], c) for r in rows for c in r["activity"].get("inactive") or []]
    lines.append("")
    if never:
        lines.append("Components that never acted in this study: " + "; ".join(f"`{arm}`: {c}" for arm, c in never)
                     + " (the arm runs as if they were absent).\n")
    return lines
