"""The confirmatory tests of README.md's plan, from a units.json: each row against uniform on the
seeds given (default 5-14), as the plan stated them: the paired t-test over seeds and McNemar's test
on the digits pooled over those seeds, each Holm-adjusted over the rows.  (The protocol's second
version reads McNemar per seed only, and adds the bootstrap and the TOST: routings-mnist-v2.)
    python docs/results/routings-mnist-12k-confirm/confirm.py docs/results/routings-mnist-12k-confirm/units.json
"""
import json
import sys

from pycapsnet.experiments import study_stats as st

N_TEST = 10000


def main(path, seeds=range(5, 15), rows=("vb", "dynamic"), base="uniform"):
    units = json.load(open(path))["units"]
    done = {r: [units[f"main {r} seed {s}"] for s in seeds] for r in (base, *rows)}
    errors = {r: [u["test_error"] for u in us] for r, us in done.items()}
    print(f"seeds {seeds.start}-{seeds.stop - 1} ({len(seeds)}); test error %, mean ± sample sd [t 95%]")
    for r in (base, *rows):
        o = st.spread(errors[r])
        print(f"  {r:8s} {o['mean']:.3f} ± {o['sd']:.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]   "
              + " ".join(f"{e:.2f}" for e in errors[r]))
    paired, pooled = {r: st.paired(errors[r], errors[base]) for r in rows}, {}
    for r in rows:
        counts = [st.discordant(st.unpack(u["wrong"], N_TEST), st.unpack(v["wrong"], N_TEST))
                  for u, v in zip(done[r], done[base])]
        b, c = sum(x for x, _ in counts), sum(y for _, y in counts)
        pooled[r] = {"b": b, "c": c, "p": st.mcnemar(b, c)}
    t_holm = dict(zip(rows, st.holm([paired[r]["p"] for r in rows])))
    m_holm = dict(zip(rows, st.holm([pooled[r]["p"] for r in rows])))
    for r in rows:
        p, m = paired[r], pooled[r]
        lower = sum(x < y for x, y in zip(errors[r], errors[base]))
        print(f"  {r} - {base}: {p['mean']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] points; paired t p = "
              f"{p['p']:.3g} (Holm {t_holm[r]:.3g}); McNemar b/c {m['b']}/{m['c']}, p = {m['p']:.3g} "
              f"(Holm {m_holm[r]:.3g}); lower than {base} in {lower} of {len(seeds)} seeds")


if __name__ == "__main__":
    main(sys.argv[1], *([range(int(sys.argv[2]), int(sys.argv[3]))] if len(sys.argv) > 3 else []))
