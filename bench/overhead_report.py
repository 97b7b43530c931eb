"""overhead.py's figures: a workload's accumulated step times summarised per variant (medians,
percentiles, pooled and per-round paired ratios to plain, bytes per span), the targets checked
against them, and the printed table."""
from __future__ import annotations

from common import median as _median, percentile  # bench/ is first on sys.path
from overhead_measure import VARIANTS


def summarise(acc, failed, module_calls):
    out = {}
    plain = acc["plain"]
    plain_med = _median(plain["total"])
    plain_mean = sum(plain["total"]) / len(plain["total"])
    for v in VARIANTS:
        a = acc[v]
        if v in failed or not a["total"]:
            out[v] = dict(failed=failed.get(v, "no samples"))
            continue
        s = sorted(a["total"])
        med = percentile(s, 50)
        paired = [m / p for m, p in zip(a["round_medians"], plain["round_medians"])]
        d = dict(median_ns=med, p10_ns=percentile(s, 10), p90_ns=percentile(s, 90), min_ns=s[0], max_ns=s[-1],
                 round_medians_ns=a["round_medians"],
                 round_median_min_ns=min(a["round_medians"]), round_median_max_ns=max(a["round_medians"]),
                 host_median_ns=_median(a["host"]), round_host_medians_ns=a["round_host_medians"],
                 ratio=med / plain_med, paired_ratios=paired,
                 mean_ns=sum(s) / len(s), mean_ratio=sum(s) / len(s) / plain_mean,
                 extra_us_per_call=(med - plain_med) / module_calls / 1e3,
                 paired_ratio_min=min(paired), paired_ratio_max=max(paired),
                 paired_ratio_median=_median(paired),
                 # min of round medians over plain's: the least disturbed block of each variant,
                 # robust when other processes share the CPUs (timeit's reasoning)
                 best_round_ratio=min(a["round_medians"]) / min(plain["round_medians"]),
                 samples=len(s), steps_ns=a["total"], host_ns=a["host"],
                 block_start_s_median=_median(a["start_s"]), block_stop_s_median=_median(a["stop_s"]))
        if v.startswith("traced"):
            recs = a["spans"] + a["collectives"]
            d.update(bytes_on_disk=a["bytes"], spans=a["spans"], collectives=a["collectives"],
                     traced_steps=a["traced_steps"], errors=a["errors"], dropped_spans=a["dropped"],
                     bytes_per_span=a["bytes"] / recs if recs else None,
                     bytes_per_step=a["bytes"] / a["traced_steps"] if a["traced_steps"] else None,
                     spans_per_step=a["spans"] / a["traced_steps"] if a["traced_steps"] else None,
                     verified=a["verified"])
        out[v] = d
    return out


def targets_for(workload, variants):
    def ratio(v):
        d = variants.get(v, {})
        return d.get("ratio")

    checks = []

    def add(name, value, limit, kind):
        if value is None or limit is None:
            checks.append(dict(name=name, value=value, limit=limit, result="n/a"))
        else:
            ok = value <= limit if kind == "le" else value < limit
            checks.append(dict(name=name, value=value, limit=limit, result="PASS" if ok else "FAIL"))

    prof = ratio("profiler")
    if workload == "llama8b-decode":
        add("traced-nofp <= x1.15", ratio("traced-nofp"), 1.15, "le")
        add("traced-fp <= x1.30", ratio("traced-fp"), 1.30, "le")
    add("traced-default (mean) <= x1.10", variants.get("traced-default", {}).get("mean_ratio"), 1.10, "le")
    add("traced-nofp < profiler", ratio("traced-nofp"), prof, "lt")
    add("traced-fp < profiler", ratio("traced-fp"), prof, "lt")
    return checks


def print_table(res):
    c = res
    print()
    tp = c.get("model", {}).get("tp", 1)
    print(f"== {c['workload']}  device={c['device']} dtype={c['dtype']} batch={c['batch']} "
          f"seq={c['seq']}" + (f" tp={tp} (figures of rank 0)" if tp > 1 else "") + f"  module calls/step={c['module_calls_per_step']}  "
          f"R={c['rounds']} W={c['warmup']} N={c['steps']} ==")
    if c.get("note"):
        print(f"   note: {c['note']}")
    hdr = (f"{'variant':<15} {'median ms':>10} {'p10..p90 ms':>19} {'round med min..max':>20} "
           f"{'ratio':>7} {'paired med':>10} {'paired min..max':>16} {'best-rnd':>8} {'host ms':>9} {'+us/call':>8} "
           f"{'B/span':>8} {'KiB/step':>9}")
    print(hdr)
    print("-" * len(hdr))
    for v in VARIANTS:
        d = c["variants"][v]
        if "failed" in d:
            print(f"{v:<15} FAILED: {d['failed']}")
            continue
        ms = lambda x: x / 1e6  # noqa: E731
        bps = f"{d['bytes_per_span']:.1f}" if d.get("bytes_per_span") else "-"
        kps = f"{d['bytes_per_step'] / 1024:.1f}" if d.get("bytes_per_step") else "-"
        print(f"{v:<15} {ms(d['median_ns']):>10.3f} "
              f"{ms(d['p10_ns']):>8.3f}..{ms(d['p90_ns']):<9.3f} "
              f"{ms(d['round_median_min_ns']):>9.3f}..{ms(d['round_median_max_ns']):<9.3f} "
              f"{'x%.3f' % d['ratio']:>7} {'x%.3f' % d['paired_ratio_median']:>10} "
              f"{d['paired_ratio_min']:>7.3f}..{d['paired_ratio_max']:<7.3f} "
              f"{'x%.3f' % d['best_round_ratio']:>8} "
              f"{ms(d['host_median_ns']):>9.3f} {d['extra_us_per_call']:>+8.2f} {bps:>8} {kps:>9}")
    default = c["variants"]["traced-default"]
    if "failed" not in default:
        ver = default.get("verified") or {}
        means = ", ".join(f"{v} x{c['variants'][v]['mean_ratio']:.3f}" for v in ("traced-nofp", "traced-fp")
                          if "failed" not in c["variants"][v])
        print(f"   traced-default (the schedule): MEAN x{default['mean_ratio']:.3f} of plain's mean "
              f"({means}); median x{default['ratio']:.3f}, paired med x{default['paired_ratio_median']:.3f}; "
              f"{ver.get('fingerprinted_steps')} of {ver.get('steps')} steps of a block fingerprinted "
              f"(W={c['warmup']} of them untimed)")
    for v in ("traced-nofp", "traced-default", "traced-fp", "traced-fp-hooks"):
        d = c["variants"][v]
        if "failed" in d:
            continue
        ver = d.get("verified") or {}
        print(f"   {v}: {d['spans']} spans + {d['collectives']} collectives in {d['traced_steps']} steps "
              f"({d['spans_per_step']:.1f} spans/step), {d['bytes_on_disk']} bytes on disk, "
              f"errors={d['errors']}, dropped={d['dropped_spans']}; reader check of one block: "
              f"{ver.get('spans')} spans, matches stats: {ver.get('matches_stats')}"
              f"{', problems: ' + '; '.join(ver['problems']) if ver.get('problems') else ''}")
    stops = ", ".join(f"{v} {c['variants'][v]['block_stop_s_median'] * 1e3:.0f} ms"
                      for v in VARIANTS if "failed" not in c["variants"][v])
    print("   ratio = pooled median / plain's; paired = per-round median / plain's in the same round; "
          "best-rnd = min round median / plain's min round median")
    print(f"   block stop cost (median, untimed): {stops}")
    print("   targets (informational):")
    for t in c["targets"]:
        val = "n/a" if t["value"] is None else f"x{t['value']:.3f}"
        lim = "n/a" if t["limit"] is None else f"x{t['limit']:.3f}"
        print(f"     {t['name']:<26} {val:>8} vs {lim:<8} {t['result']}")
