"""varcomm-bench output: nccl-tests-style tables, JSON, markdown and plots."""
from __future__ import annotations

import math
from typing import Any

from .core import SHORT, fmt_bytes

ORDER = ("varcomm", "two-phase", "fallback", "mpi4py", "libfabric", "memcpy", "d2d", "nccl")


def _t(us: float | None) -> str:
    if us is None or math.isnan(us):
        return "-"
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def _x(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _bw(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _wrong(v: Any) -> str:
    return "N/A" if v is None else str(v)


def shown(res: dict[str, Any]) -> list[str]:
    """Methods with at least one point, table order."""
    have = {m for p in res["points"] for m in p["methods"]}
    return [m for m in ORDER if m in have]


def table(res: dict[str, Any]) -> str:
    ms = shown(res)
    base = [m for m in ms if m != "varcomm"]
    reps = max((d["repeats"] for p in res["points"] for d in p["methods"].values()), default=0)
    lines = [f"# {res['title']}",
             f"# {res['ranks']} ranks, {res['dtype']}, {res['device']}; each time the median of {reps} samples;"
             f" x = baseline time / varcomm time (> 1: varcomm faster); #wrong: messages whose bytes differed from"
             f" what was sent (with -c; N/A without; the last column: the baselines')"]
    lines += [f"# {n}" for n in res.get("notes", [])]
    head1 = f"#{'':>9} {'':>10} {'':>8}  "
    head2 = f"#{'size':>9} {'count':>10} {'type':>8}  "
    if "varcomm" in ms:
        head1 += f"{' varcomm ':-^40}    "
        head2 += f"{'time(us)':>9} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}    "
    for b in base:
        head1 += f"{' ' + SHORT[b] + ' ':-^17}  "
        head2 += f"{'time(us)':>9} {'x':>7}  "
    if base:
        head2 += f"{'#wrong':>7}"
        head1 += f"{'(others)':>7}"
    lines += [head1.rstrip(), head2.rstrip()]
    for p in res["points"]:
        line = f"{fmt_bytes(p['size']):>10} {_count(p['count']):>10} {p['type']:>8}  "
        v = p["methods"].get("varcomm")
        if "varcomm" in ms:
            if v:
                line += (f"{_t(v['time_us']['median']):>9} {_bw(v['algbw_gbps']['median']):>11} "
                         f"{_bw(v['busbw_gbps']['median']):>11} {_wrong(v['wrong']):>6}    ")
            else:
                line += f"{'-':>9} {'-':>11} {'-':>11} {'-':>6}    "
        others: list[Any] = []
        for b in base:
            d = p["methods"].get(b)
            if d:
                line += f"{_t(d['time_us']['median']):>9} {_x(p['ratios'].get(b)):>7}  "
                others.append(d["wrong"])
            else:
                line += f"{'n/a':>9} {'':>7}  "
        if base:
            checked = [x for x in others if x is not None]
            line += f"{(str(sum(checked)) if checked else 'N/A'):>7}"
        lines.append(line.rstrip())
    host = [m for m in ms if any("host_us" in p["methods"].get(m, {}) for p in res["points"])]
    if host and res.get("device") != "cpu":  # (on the CPU it is the time column again)
        lines += ["# host-blocked time per op (us): the slowest rank's time inside the calls, before the final "
                  "device synchronize",
                  f"#{'size':>9}  " + " ".join(f"{SHORT[m]:>9}" for m in host)]
        for p in res["points"]:
            cells = [p["methods"].get(m, {}).get("host_us", {}).get("median") for m in host]
            lines.append(f"{fmt_bytes(p['size']):>10}  " + " ".join(f"{_t(c):>9}" for c in cells))
    for m, st in res["methods"].items():
        if st["status"] != "ok" and st.get("reason") != "not selected":
            lines.append(f"#  {st['status']:<7} {m}: {st['reason']}")
        elif st.get("partial") or st.get("note"):
            lines.append(f"#  note    {m}: {st.get('note') or ''}{'; ' if st.get('note') and st.get('partial') else ''}"
                         f"{('n/a for ' + st['partial']) if st.get('partial') else ''}")
    return "\n".join(lines)


def _count(c: float) -> str:
    return str(int(c)) if abs(c - round(c)) < 1e-9 else f"{c:.1f}"


def wrong_total(results: list[dict[str, Any]]) -> int:
    return sum(d["wrong"] or 0 for r in results for p in r["points"] for d in p["methods"].values())


def wrong_by_method(results: list[dict[str, Any]]) -> dict[str, int]:
    """Wrong messages per column, the table's hidden variants (varcomm-numpy, mpi4py-torch, ...) too."""
    per: dict[str, int] = {}
    for r in results:
        for p in r["points"]:
            for m, d in p["methods"].items():
                if d["wrong"]:
                    per[m] = per.get(m, 0) + d["wrong"]
    return per


def describe(doc: dict[str, Any]) -> str:
    mc = doc["machine"]
    fi = mc.get("libfabric", {})
    parts = [doc["date"], f"{mc.get('cpu', '?')}", f"{mc.get('cores')} cores"]
    if mc.get("loadavg_start"):
        parts.append(f"load {mc['loadavg_start'][0]:.1f}" + (f" -> {mc['loadavg_end'][0]:.1f}"
                                                             if mc.get("loadavg_end") else ""))
    parts.append(f"torch {mc.get('torch')}, varcomm {mc.get('varcomm')}, numpy {mc.get('numpy')}")
    if mc.get("mpi"):
        parts.append(f"mpi4py {mc.get('mpi4py')} on {mc['mpi']}")
    if fi:
        parts.append(f"libfabric {fi.get('version', '?')}" + (f" ({fi['provider_used']})"
                                                             if fi.get("provider_used") else ""))
    parts.append(f"varcomm transport {mc.get('transport', '?')}")
    if mc.get("slot_copies"):
        sc = mc["slot_copies"]
        parts.append(f"rank 0's slot copies from 16 KiB: {sc['ordinary']} ordinary, {sc['streamed']} non-temporal "
                     f"(landing area: {sc.get('landing_ordinary', '?')}, {sc.get('landing_streamed', '?')})")
    parts.append(f"launcher {doc.get('launcher')}, {doc['elapsed_s']} s")
    return "# " + "; ".join(parts) + _noisy(mc)


def _noisy(mc: dict[str, Any]) -> str:
    """A warning line where the machine was busier than its cores during the run (a user trial read
    '37x' and '0.03x' off a run at load 8.6 on 2 cores, with nothing saying they were noise)."""
    loads = [v[0] for v in (mc.get("loadavg_start"), mc.get("loadavg_end")) if v]
    cores = mc.get("cores") or 0
    if not loads or not cores or max(loads) <= cores:
        return ""
    return (f"\n# WARNING: load {max(loads):.1f} on {cores} cores during the run (other work, or more ranks than "
            "cores): these times are noisy; rerun on an idle machine, and compare builds in one session "
            "(python -m varcomm_bench.compare)")


def text(doc: dict[str, Any]) -> str:
    out = [describe(doc), ""]
    for r in doc["results"]:
        out += [table(r), ""]
    return "\n".join(out)


# OSU micro-benchmark names and value columns, so `--osu` output pastes next
# to osu_latency / osu_bw / osu_bibw / osu_alltoallv runs. OSU's bibw counts
# both directions, which is our busbw for bibw (busbw_factor 2).
_OSU = {"latency": ("osu_latency", "Latency (us)"), "unibw": ("osu_bw", "Bandwidth (MB/s)"),
        "bibw": ("osu_bibw", "Bandwidth (MB/s)")}


def _rank(m: str) -> tuple[float, str]:
    """Table order; variants such as varcomm-numpy right after their method."""
    if m in ORDER:
        return ORDER.index(m), m
    head = m.split("-")[0]
    return (ORDER.index(head) + 0.5 if head in ORDER else len(ORDER)), m


def osu(doc: dict[str, Any]) -> str:
    """The results as OSU-style columns: one block per benchmark and method."""
    out = [describe(doc), ""]
    for r in doc["results"]:
        # all-to-all: osu_alltoallv's Size is what a rank sends each peer (ours: the mean, S / ranks), and
        # the time is the slowest rank's, the column osu_alltoallv -f calls Max Latency
        name, col = _OSU.get(r["test"], ("osu_alltoallv" if r["bench"] == "alltoall" else "", "Max Latency(us)"))
        per_peer = r["bench"] == "alltoall"
        if r["bench"] == "varlen":
            name, col = "", "Latency (us)"
        have = {m for p in r["points"] for m in p["methods"]}
        for m in sorted(have, key=_rank):
            out.append(f"# varcomm-bench {r['bench']} {r['test']}{' (like ' + name + ')' if name else ''}:"
                       f" {doc['labels'].get(m, m)}, {r['ranks']} ranks, {r['dtype']} on {r['device']}")
            out.append(f"# {'Size':<10}{col:>20}")
            for p in r["points"]:
                d = p["methods"].get(m)
                if not d:
                    continue
                if col.startswith("Bandwidth"):
                    key = "busbw_gbps" if r["test"] == "bibw" else "algbw_gbps"
                    v = f"{d[key]['median'] * 1000:.2f}"
                else:
                    v = f"{d['time_us']['median']:.2f}"
                size = int(p["size"]) // r["ranks"] if per_peer else int(p["size"])
                out.append(f"{size:<12}{v:>20}")
            out.append("")
    return "\n".join(out)


def markdown(doc: dict[str, Any]) -> str:
    return "\n".join([f"# varcomm-bench {doc['subcommand']}, {doc['date']}", "", "```", doc["command"], "```", "",
                      "```", text(doc).rstrip(), "```", ""])


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    results = [r for r in doc["results"] if r["points"]]
    if not results:
        raise RuntimeError("nothing to plot")
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 3.6 * len(results)), squeeze=False)
    colors = {"varcomm": "C3", "two-phase": "C1", "fallback": "C0", "mpi4py": "C2", "libfabric": "C4",
              "memcpy": "C7", "d2d": "C5"}
    for row, r in zip(axes, results):
        for m in shown(r):
            xs, t, tlo, thi, bw, blo, bhi = [], [], [], [], [], [], []
            for p in r["points"]:
                d = p["methods"].get(m)
                if not d:
                    continue
                xs.append(p["size"])
                t.append(d["time_us"]["median"])
                tlo.append(d["time_us"]["min"])
                thi.append(d["time_us"]["max"])
                bw.append(d["algbw_gbps"]["median"])
                blo.append(d["algbw_gbps"]["min"])
                bhi.append(d["algbw_gbps"]["max"])
            style = dict(color=colors[m], marker="o", ms=4, lw=2.4 if m == "varcomm" else 1.4,
                         ls="-" if m in ("varcomm", "two-phase") else "--" if m in ("memcpy", "d2d") else "-",
                         label=doc["labels"].get(m, m), zorder=3 if m == "varcomm" else 2)
            row[0].plot(xs, t, **style)
            row[0].fill_between(xs, tlo, thi, color=colors[m], alpha=0.15, lw=0)
            row[1].plot(xs, bw, **style)
            row[1].fill_between(xs, blo, bhi, color=colors[m], alpha=0.15, lw=0)
        xlabel = "mean message size (bytes)" if r["bench"] == "varlen" else \
            "bytes per rank (S)" if r["bench"] == "alltoall" else "message size (bytes)"
        for ax, yl in ((row[0], "time per op (us)"), (row[1], "algbw (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=2, numticks=10))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: fmt_bytes(v) if v >= 1 else ""))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(yl)
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.1)
        short = r.get("short") or r["title"]
        row[0].set_title(f"{short}: time per op", fontsize=10)
        row[1].set_title(f"{short}: algbw", fontsize=10)
        row[0].legend(fontsize=7.5, loc="best", framealpha=0.8)
    mc = doc["machine"]
    fig.suptitle(f"varcomm-bench {doc['subcommand']}  ({doc['date']}; {mc.get('cpu', '?')}, {mc.get('cores')} cores;"
                 f" median of repeats, band = min..max)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=100)
    plt.close(fig)
