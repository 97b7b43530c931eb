"""Step-paired measurement shared by bench/fp_ab.py, bench/native_proxy.py and
bench/fp_ablation.py: every round runs one step of each variant, in shuffled order, so that
consecutive steps differ only in the variant and a drifting host moves all variants alike."""
import random
import statistics


def shuffled_rounds(run, variants, rounds: int, seed: int = 0) -> dict:
    """``run(variant)`` -> ns, once per variant per round in a shuffled order; the times by
    variant, in round order (so ``times[a][i]`` and ``times[b][i]`` are one round's pair)."""
    rng = random.Random(seed)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            times[v].append(run(v))
    return times


def paired_median(times: dict, a: str, b: str) -> float:
    """The median over rounds of ``a``'s time minus ``b``'s, in the unit of ``times``."""
    return statistics.median(x - y for x, y in zip(times[a], times[b]))
