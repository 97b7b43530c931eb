"""cProfile of one ``merge_ranks`` call, for ``merge_bench.py`` when the merge misses its rate."""
from __future__ import annotations

import cProfile
import io
import pstats
import time


def profile_merge(d: str, top: int = 15) -> dict:
    """cProfile of one merge_ranks call; a second profiler takes over inside compute_verdicts, so
    besides the whole merge the rest of it (loading, inserts, indexes) is shown on its own."""
    from tensor_trace.exporters import analysis as pl
    from tensor_trace.exporters import pipeline as mg

    rest, verdicts = cProfile.Profile(), cProfile.Profile()
    orig = pl.compute_verdicts

    def split(con):
        rest.disable()
        verdicts.enable()
        try:
            return orig(con)
        finally:
            verdicts.disable()
            rest.enable()

    pl.compute_verdicts = split
    t = time.perf_counter()
    try:
        rest.enable()
        mg.merge_ranks(d, warn=lambda m: None, workers=0)  # in this process, so the profile sees the loading
        rest.disable()
    finally:
        pl.compute_verdicts = orig
    out = {"wall_s_under_cprofile": time.perf_counter() - t}

    def table(stats, key):
        s = io.StringIO()
        stats.stream = s
        stats.sort_stats(key).print_stats(top)
        text = s.getvalue()
        return text[text.find("   ncalls"):].rstrip()

    whole = pstats.Stats(rest).add(verdicts).strip_dirs()
    out["whole_total_s"] = whole.total_tt
    out["cumulative"] = table(whole, "cumulative")
    out["tottime"] = table(whole, "tottime")
    outside = pstats.Stats(rest).strip_dirs()
    out["outside_verdicts_total_s"] = outside.total_tt
    out["outside_verdicts_tottime"] = table(outside, "tottime")
    out["outside_verdicts_cumulative"] = table(outside, "cumulative")
    return out


def text(p: dict) -> str:
    """The profile as merge_bench prints it."""
    return (f"\n## cProfile of merge_ranks, {p['steps']}-step trace, {p['span_records']:,} span "
            f"records ({p['wall_s_under_cprofile']:.1f} s under the profiler)\n-- whole merge, by cumulative time\n"
            + p["cumulative"] + "\n-- whole merge, by own time\n" + p["tottime"]
            + f"\n-- outside compute_verdicts ({p['outside_verdicts_total_s']:.1f} s of {p['whole_total_s']:.1f} s), "
            "by own time\n" + p["outside_verdicts_tottime"]
            + "\n-- outside compute_verdicts, by cumulative time\n" + p["outside_verdicts_cumulative"])
