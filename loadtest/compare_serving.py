"""Side-by-side table of two `bench_serving.py --json` results (ours, then a peer such as
llama-server), with the ratios issue #4 sets targets for.

    python loadtest/bench_serving.py --json --out ours.json
    python loadtest/bench_serving.py --base http://127.0.0.1:8090 --json --out peer.json
    python loadtest/compare_serving.py ours.json peer.json
"""
from __future__ import annotations

import argparse
import json
import sys


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def compare(ours: dict, peer: dict) -> str:
    lines = ["| c | output tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|"]
    for key in sorted((k for k in ours if k.startswith("c") and k[1:].isdigit() and k in peer), key=lambda k: int(k[1:])):
        a, b = ours[key], peer[key]
        lines.append(f"| {key[1:]} | {a['output_tok_s']:.1f} / {b['output_tok_s']:.1f} "
                     f"({_ratio(a['output_tok_s'], b['output_tok_s'])}) | {a['ttft_p50_s']:.2f} / {b['ttft_p50_s']:.2f} "
                     f"| {a['ttft_p99_s']:.2f} / {b['ttft_p99_s']:.2f} | {a['itl_p50_s'] * 1e3:.0f} / "
                     f"{b['itl_p50_s'] * 1e3:.0f} | {a['itl_p99_s'] * 1e3:.0f} / {b['itl_p99_s'] * 1e3:.0f} "
                     f"({_ratio(a['itl_p99_s'], b['itl_p99_s'])}) |")
    if "shared_prefix" in ours and "shared_prefix" in peer:
        a, b = ours["shared_prefix"], peer["shared_prefix"]
        lines.append("")
        lines.append(f"shared prefix: cold {a['ttft_cold_s']:.3f} / {b['ttft_cold_s']:.3f} s, "
                     f"warm {a['ttft_warm_s']:.3f} / {b['ttft_warm_s']:.3f} s "
                     f"({_ratio(a['ttft_warm_s'], b['ttft_warm_s'])}), our warm/cold {a['warm_over_cold']:.3f}")
    if "c32" in ours and "c32" in peer and "shared_prefix" in ours and "shared_prefix" in peer:
        a32, b32, a, b = ours["c32"], peer["c32"], ours["shared_prefix"], peer["shared_prefix"]
        checks = [("c32 output tok/s >= 1.3x", a32["output_tok_s"] >= 1.3 * b32["output_tok_s"]),
                  ("c32 ITL p99 <= 0.5x", a32["itl_p99_s"] <= 0.5 * b32["itl_p99_s"]),
                  ("warm TTFT <= peer's", a["ttft_warm_s"] <= b["ttft_warm_s"]),
                  ("warm TTFT <= 0.05x our cold", a["ttft_warm_s"] <= 0.05 * a["ttft_cold_s"])]
        lines.append("")
        lines += [f"{'met' if ok else 'NOT met'}: {name}" for name, ok in checks]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ours")
    ap.add_argument("peer")
    args = ap.parse_args()
    with open(args.ours) as f, open(args.peer) as g:
        print(f"ours: {args.ours}, peer: {args.peer} (each cell: ours / peer)")
        print(compare(json.load(f), json.load(g)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
