"""The confirmatory tests of README.md's plan, from a units.json: each row against uniform on the
seeds given (default 5-14) by the study's own statistics (study_report.mnist_rows: the paired t-test
and McNemar pooled over those seeds, each Holm-adjusted over the rows).
    python docs/results/routings-mnist-12k-confirm/confirm.py docs/results/routings-mnist-12k-confirm/units.json
"""
import json
import sys

from pycapsnet.experiments.study_report import mnist_rows

N_TEST = 10000


def main(path, seeds=range(5, 15), rows=("vb", "dynamic"), base="uniform"):
    units = json.load(open(path))["units"]
    done = {r: [units[f"main {r} seed {s}"] for s in seeds] for r in (base, *rows)}
    out = mnist_rows(done, base, N_TEST)
    print(f"seeds {seeds.start}-{seeds.stop - 1} ({len(seeds)}); test error %, mean ± sample sd [t 95%]")
    for r in (base, *rows):
        o = out[r]
        print(f"  {r:8s} {o['mean']:.3f} ± {o['sd']:.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]   "
              + " ".join(f"{e:.2f}" for e in o["errors"]))
    for r in rows:
        p, m = out[r]["vs_baseline"], out[r]["mcnemar"]
        lower = sum(x < y for x, y in zip(out[r]["errors"], out[base]["errors"]))
        print(f"  {r} - {base}: {p['mean']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] points; paired t p = "
              f"{p['p']:.3g} (Holm {out[r]['t_holm']:.3g}); McNemar b/c {m['b']}/{m['c']}, p = {m['p']:.3g} "
              f"(Holm {out[r]['mcnemar_holm']:.3g}); lower than {base} in {lower} of {len(seeds)} seeds")


if __name__ == "__main__":
    main(sys.argv[1], *([range(int(sys.argv[2]), int(sys.argv[3]))] if len(sys.argv) > 3 else []))
