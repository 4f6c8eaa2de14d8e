"""What the saturation-throughput feature buys: 5-fold CV throughput SMAPE of one random forest
with and without it, on the same rows of the shipped training set.

    python -m benchmarks.studies.saturation_feature [--profile ID] [--rows 3000]

"without" = the 16 other features and the served fraction throughput / arriving as target (the
previous design); "with" = all features and throughput / min(arriving, saturation) as target.
Writes artifacts/benchmarks/saturation_feature.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from models.dataset import read_dataset
from models.features import ARRIVING, FEATURES, throughput_base
from models.metrics import smape
from twin import load_profile

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=3000, help="a seeded random sample of this many usable rows")
    ap.add_argument("--out", type=Path, default=result_path("saturation_feature"))
    args = ap.parse_args(argv)
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.model_selection import KFold, cross_val_predict

    ds = read_dataset([ROOT / "datasets" / args.profile / "paper.parquet"], load_profile(args.profile))
    base = np.array([throughput_base(x) for x in ds.X])
    keep = np.random.default_rng(0).permutation(np.flatnonzero(base > 0))[:args.rows]
    X, base, thr, starved = ds.X[keep], base[keep], ds.throughput[keep], ds.starved[keep]
    without = [i for i, f in enumerate(FEATURES) if f not in ("saturation_tok_s", "load_over_saturation")]
    result = {"benchmark": "saturation_feature", "profile": args.profile, "rows": len(keep),
              "model": "RandomForestRegressor(64 trees, min_samples_leaf=2, seed 0), 5-fold CV"}
    for name, cols, den in (("without", without, X[:, ARRIVING]), ("with", list(range(len(FEATURES))), base)):
        forest = RandomForestRegressor(64, min_samples_leaf=2, random_state=0, n_jobs=1)
        pred = cross_val_predict(forest, X[:, cols], thr / den, cv=KFold(5, shuffle=True, random_state=0)) * den
        result[name] = {"throughput_smape": smape(pred, thr), "starved_rows": smape(pred[starved], thr[starved]),
                        "healthy_rows": smape(pred[~starved], thr[~starved])}
        print(name, result[name])
    write_result(args.out, result, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
