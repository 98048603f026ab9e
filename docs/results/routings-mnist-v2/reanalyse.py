"""The MNIST record read under the protocol's second version (README.md says what was declared):
    python docs/results/routings-mnist-v2/reanalyse.py docs/results/routings-mnist-12k-confirm/units.json
(the confirmation's units.json holds the record's seeds 0-4 of every row and the new seeds 5-14)."""
import json
import sys

from pycapsnet.experiments.study_report import main_rows

N_TEST, MARGIN, BASE = 10000, 0.1, "uniform"
READINGS = {"(a) the record, seeds 0-4": (("uniform", "dynamic", "attention", "inverted", "self", "vb", "cnn"), range(5)),
            "(b) fifteen seeds, 0-14": (("uniform", "dynamic", "vb"), range(15))}


def main(path):
    units = json.load(open(path))["units"]
    for title, (rows, seeds) in READINGS.items():
        done = {r: [units[f"main {r} seed {s}"] for s in seeds] for r in rows}
        out = main_rows(done, BASE, N_TEST, MARGIN)
        print(f"\n{title}: test error % (mean ± sd [95% bootstrap]); against {BASE}: Δ [95% bootstrap], bootstrap p "
              f"(Holm), paired t p (Holm), TOST ±{MARGIN} p (Holm), word; McNemar b/c per seed\n")
        print("| row | test error % | Δ (points) | bootstrap p (Holm) | t p (Holm) | TOST p (Holm) | word | McNemar b/c |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            o = out[r]
            cell = f"{o['mean']:.2f} ± {o['sd']:.2f} [{o['ci95'][0]:.2f}, {o['ci95'][1]:.2f}]"
            if r == BASE:
                print(f"| {r} | {cell} | (baseline) | | | | | |")
                continue
            v, t, tost = o["vs_baseline"], o["vs_baseline"]["t"], o["tost"]
            print(f"| {r} | {cell} | {v['mean']:+.2f} [{v['ci95'][0]:+.2f}, {v['ci95'][1]:+.2f}] | {v['p']:.3g} "
                  f"({o['p_holm']:.3g}) | {t['p']:.3g} ({o['t_holm']:.3g}) | {tost['p']:.3g} ({o['tost_holm']:.3g}) | "
                  f"**{o['word']}** | {', '.join(f'{m[chr(98)]}/{m[chr(99)]}' for m in o['mcnemar_per_seed'])} |")


if __name__ == "__main__":
    main(sys.argv[1])
