"""SpeContext's layers in groups, each group served by one proxy: for G = 1 .. --max-groups, the split of the layers
into G runs of consecutive layers, each attended with the selection of its first layer's own OracleTopK (the proxy an
engine can compute when the group starts: that layer's q and k), that keeps the most mass recall on average. Reads the
cross-layer matrix kvsift_specontext_layers writes (rows: source layer, columns: target layer, entries: mass recall
relative to the target's own oracle; docs/bench/specontext_layers_2pct.csv) and prints per G the groups, the mean and
the minimum over the target layers. Exhaustive over the cut points (C(L - 1, G - 1) splits).

Usage: layer_groups.py [--max-groups G] MATRIX.csv"""
import argparse
import csv
import itertools


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix")
    parser.add_argument("--max-groups", type=int, default=4)
    args = parser.parse_args()
    rows = list(csv.reader(open(args.matrix)))
    recall = {int(r[0]): [float(x) for x in r[1:]] for r in rows[1:]}
    layers = len(recall)
    print("| groups | first layers (the proxies) | mean | min |")
    print("|---|---|---|---|")
    for groups in range(1, args.max_groups + 1):
        best = None
        for cuts in itertools.combinations(range(1, layers), groups - 1):
            bounds = (0, *cuts, layers)
            served = [recall[first][t] for first, end in zip(bounds, bounds[1:]) for t in range(first, end)]
            mean = sum(served) / len(served)
            if best is None or mean > best[0]:
                best = (mean, min(served), bounds[:-1])
        print(f"| {groups} | {', '.join(map(str, best[2]))} | {best[0]:.3f} | {best[1]:.3f} |")


if __name__ == "__main__":
    main()
