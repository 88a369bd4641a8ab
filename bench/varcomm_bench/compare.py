"""Compare varcomm-bench JSON results of two builds, point by point.

    python -m varcomm_bench.compare --before a1.json a2.json --after b1.json b2.json

Runs of the two builds should alternate in one session (this machine is
noisy). Each point's time is the best of its runs' medians, so one loaded run
does not decide it; the ratio is before / after (> 1: the after build is faster).
Only varcomm's own methods are compared unless --methods says otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable

Key = tuple[str, str, float, str]  # bench (with its routing/notes title), test, size, method


#: What makes two runs measure different things: compared across every file (the date, the command's
#: output paths and the like are not).
_SETTINGS = ("transport", "dtype", "device", "window", "iters", "warmup", "routing", "slots", "hidden", "check")


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"compare: cannot read {path}: {e} (pass the --json files of varcomm-bench runs)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise SystemExit(f"compare: {path} is not a varcomm-bench --json file (it has no results list)")
    return doc


def _setting(doc: dict, environment: bool) -> dict:
    opts = doc.get("options", {})
    sizes = sorted({p.get("size") for r in doc.get("results", []) for p in r.get("points", [])}, key=str)
    return {"subcommand": doc.get("subcommand"), "ranks": doc.get("ranks"), "sizes": sizes,
            **{k: opts.get(k) for k in _SETTINGS},
            **({f"${k}": v for k, v in doc.get("environment", {}).items()} if environment else {})}


def _differences(docs: dict[str, dict]) -> list[str]:
    """'name: a in x.json, b in y.json' for each setting the runs do not share (the environment only
    where every file recorded it: older ones did not)."""
    environment = all("environment" in d for d in docs.values())
    settings = {p: _setting(d, environment) for p, d in docs.items()}
    names = sorted({k for s in settings.values() for k in s})
    out = []
    for k in names:
        vals = {p: s.get(k) for p, s in settings.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in vals.values()}) > 1:
            out.append(f"{k.lstrip('$')}: " + ", ".join(f"{v!r} in {p}" for p, v in vals.items()))
    return out


def _points(paths: Iterable[str], methods: set[str] | None, docs: dict[str, dict]) -> dict[Key, float]:
    best: dict[Key, float] = {}
    for path in paths:
        doc = docs[path]
        for res in doc["results"]:
            for pt in res["points"]:
                for m, v in pt["methods"].items():
                    if methods is not None and m not in methods:
                        continue
                    if methods is None and not m.startswith("varcomm"):
                        continue
                    t = v.get("time_us", {}).get("median")
                    if t is None:
                        continue
                    k = (res.get("title", res["bench"]), res["test"], float(pt["size"]), m)
                    best[k] = min(best.get(k, float("inf")), float(t))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m varcomm_bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", nargs="+", required=True, help="JSON files of the baseline build")
    p.add_argument("--after", nargs="+", required=True, help="JSON files of the build under test")
    p.add_argument("--methods", help="comma-separated methods to compare (default: varcomm*)")
    p.add_argument("--slower", type=float, default=0.9,
                   help="flag a point whose ratio is below this (default 0.9)")
    a = p.parse_args(argv)
    methods = set(a.methods.split(",")) if a.methods else None
    docs = {path: _load(path) for path in [*a.before, *a.after]}
    if methods is not None:
        known = {m for d in docs.values() for res in d["results"] for pt in res["points"] for m in pt["methods"]}
        if methods - known:
            p.error(f"--methods: {', '.join(sorted(methods - known))} not in these runs (they have: "
                    f"{', '.join(sorted(known))})")
    for line in _differences(docs):
        if line.startswith("sizes:"):  # (points are matched by size: only the shared ones are compared)
            print("compare: note: the runs measured different sizes; only the sizes in both are compared",
                  file=sys.stderr)
        else:
            print(f"compare: warning: the runs differ in {line}; their ratios compare different settings",
                  file=sys.stderr)
    before, after = _points(a.before, methods, docs), _points(a.after, methods, docs)
    keys = sorted(set(before) & set(after))
    if not keys:
        p.error("no point is in both --before and --after")
    print("| bench | test | size | method | before (µs) | after (µs) | before/after |")
    print("|---|---|---:|---|---:|---:|---:|")
    flagged = 0
    for k in keys:
        r = before[k] / after[k]
        mark = " **slower**" if r < a.slower else ""
        flagged += bool(mark)
        print(f"| {k[0]} | {k[1]} | {int(k[2])} | {k[3]} | {before[k]:.2f} | {after[k]:.2f} | {r:.2f}{mark} |")
    print(f"\n{len(keys)} points, {flagged} below {a.slower}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
