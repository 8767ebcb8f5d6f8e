"""The conditional-disaggregation rows of issue #55 from a `vs_vllm.py --rounds N` JSON: each
server's median over the rounds with the lowest and highest round as the error bar, for the
figures the issue's bars name (batch-1 and 2,000-token TTFT p50, the mixed trace's TPOT p99 and
goodput), and the ratios against colocated paired by round.

Run:  .venv/bin/python benchmarks/plot_disaggregation.py RESULT.json [--out benchmarks/figures/disaggregation.png]
(needs matplotlib: pip install -e '.[plots]').
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PANELS = (
    ("batch1", "ttft_p50_s", "batch 1, 128-token prompt: TTFT p50 (s)"),
    ("long", "ttft_p50_s", "2,000-token prompt: TTFT p50 (s)"),
    ("mixed", "tpot_p99_ms", "mixed trace: TPOT p99 (ms)"),
    ("mixed", "goodput_rps", "mixed trace: goodput (req/s)"),
)


def spread(rounds: list[dict], server: str, scenario: str, key: str) -> tuple[float, float, float]:
    values = [r[server][scenario][key] for r in rounds]
    return statistics.median(values), min(values), max(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "figures" / "disaggregation.png")
    args = ap.parse_args()
    data = json.loads(args.result.read_text())
    rounds, servers = data["rounds"], list(data["rounds"][0])
    for scenario, key, label in PANELS:
        row = []
        for server in servers:
            mid, lo, hi = spread(rounds, server, scenario, key)
            ratios = [r[server][scenario][key] / r["colocated"][scenario][key] for r in rounds]
            row.append(f"{server} {mid:.3g} ({lo:.3g}-{hi:.3g}) = {statistics.median(ratios):.2f}x colocated")
        print(f"{label}: " + "; ".join(row))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 4))
    for ax, (scenario, key, label) in zip(axes, PANELS):
        stats = [spread(rounds, s, scenario, key) for s in servers]
        mids = [m for m, _, _ in stats]
        errors = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
        ax.bar(servers, mids, yerr=errors, capsize=4, color=["#777", "#4a7", "#27c", "#c72"][: len(servers)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(
        f"pdserve: conditional disaggregation, median of {len(rounds)} rounds — {data['machine']}, {data['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    args.out.parent.mkdir(exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
