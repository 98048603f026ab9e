"""The confirmatory tests of README.md's plan, from a units.json: each row against uniform on the
seeds given (default 5-14), the paired t-test Holm-adjusted over the rows, McNemar pooled beside it.
    python docs/results/routings-mnist-12k-confirm/confirm.py docs/results/routings-mnist-12k-confirm/units.json
"""
import json
import sys

from pycapsnet.experiments import study_stats as st

N_TEST = 10000


def main(path, seeds=range(5, 15), rows=("vb", "dynamic"), base="uniform"):
    units = json.load(open(path))["units"]
    unit = {(r, s): units[f"main {r} seed {s}"] for r in (base, *rows) for s in seeds}
    err = {r: [unit[r, s]["test_error"] for s in seeds] for r in (base, *rows)}
    out = {}
    for r in rows:
        b = c = 0
        for s in seeds:
            db, dc = st.discordant(st.unpack(unit[r, s]["wrong"], N_TEST), st.unpack(unit[base, s]["wrong"], N_TEST))
            b, c = b + db, c + dc
        out[r] = {"paired": st.paired(err[r], err[base]), "mcnemar": (b, c, st.mcnemar(b, c))}
    holm_t = st.holm([out[r]["paired"]["p"] for r in rows])
    holm_m = st.holm([out[r]["mcnemar"][2] for r in rows])
    print(f"seeds {seeds.start}-{seeds.stop - 1} ({len(seeds)}); test error %, mean ± sample sd [t 95%]")
    for r in (base, *rows):
        s = st.spread(err[r])
        print(f"  {r:8s} {s['mean']:.3f} ± {s['sd']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]   "
              + " ".join(f"{e:.2f}" for e in err[r]))
    for r, ht, hm in zip(rows, holm_t, holm_m):
        p, (b, c, pm) = out[r]["paired"], out[r]["mcnemar"]
        print(f"  {r} - {base}: {p['mean']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] points; paired t p = "
              f"{p['p']:.3g} (Holm {ht:.3g}); McNemar b/c {b}/{c}, p = {pm:.3g} (Holm {hm:.3g}); "
              f"lower than {base} in {sum(x < y for x, y in zip(err[r], err[base]))} of {len(seeds)} seeds")


if __name__ == "__main__":
    main(sys.argv[1], *( [range(int(sys.argv[2]), int(sys.argv[3]))] if len(sys.argv) > 3 else []))
