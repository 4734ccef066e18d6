"""SM clock, power and utilization during each phase of a device call: device_check.sh's
smi.csv (nvidia-smi every 500 ms) read against bench_quant.sh's laps_utc.txt (when each
throughput point started and ended). Why: a decode kernel timed alone ran ~25% faster than
inside the 128/128 engine on the H100 (docs/performance.md, 2026-12-06); a lower clock under
the GEMMs' power draw is one explanation this tells apart.

    python3 scripts/clock_report.py OUT/smi.csv OUT/quant/laps_utc.txt [--out clocks.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from datetime import datetime, time
from pathlib import Path


def _number(text: str) -> float:
    """'1980 MHz' / '512.30 W' / '87 %' -> the number."""
    return float(text.strip().split()[0])


def read_smi(path: Path) -> list[dict]:
    """smi.csv's samples: time of day and each numeric column by its short name."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip().split(" [")[0] for h in next(reader)]
        for row in reader:
            if len(row) != len(header) or row[0].strip() == header[0]:
                continue  # a partial last line, or a header repeated
            sample = {"at": datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").time()}
            for name, cell in zip(header[1:], row[1:], strict=True):
                try:
                    sample[name] = _number(cell)
                except ValueError:
                    continue  # "[N/A]"
            rows.append(sample)
    return rows


def read_spans(path: Path) -> dict[str, tuple[time, time]]:
    """laps_utc.txt's 'start NAME HH:MM:SS' / 'end NAME HH:MM:SS' pairs -> NAME: (start, end)."""
    starts, spans = {}, {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ("start", "end"):
            continue  # the convert/build laps: one time each
        at = time.fromisoformat(parts[2])
        if parts[0] == "start":
            starts[parts[1]] = at
        elif parts[1] in starts:
            spans[parts[1]] = (starts.pop(parts[1]), at)
    return spans


# samples at least this busy are the point's steps (a span also holds the engine's load)
BUSY_UTILIZATION = 90.0


def _stats(samples: list[dict]) -> dict:
    stats: dict = {"samples": len(samples)}
    for key in sorted({k for s in samples for k in s if k != "at"}):
        values = [s[key] for s in samples if key in s]
        stats[key] = {"median": statistics.median(values), "min": min(values)}
    return stats


def summarize(samples: list[dict], spans: dict[str, tuple[time, time]]) -> dict[str, dict]:
    """Per span: the samples' count and the median and minimum of each numeric column, over
    all its samples and ("busy") over those with the GPU at least BUSY_UTILIZATION % busy."""
    out = {}
    for name, (start, end) in spans.items():
        inside = [s for s in samples if start <= s["at"] <= end]
        busy = [s for s in inside if s.get("utilization.gpu", 0.0) >= BUSY_UTILIZATION]
        out[name] = _stats(inside) | {"busy": _stats(busy)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("smi", type=Path)
    ap.add_argument("laps", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = summarize(read_smi(args.smi), read_spans(args.laps))
    for name, every in report.items():
        stats = every["busy"]
        # nvidia-smi names the queried clocks.sm "clocks.current.sm" in its header
        clock = next(
            (v for k, v in stats.items() if k.startswith("clocks") and k.endswith("sm")), {}
        )
        power = stats.get("power.draw", {})
        print(f"{name:40s} {stats['samples']:4d} busy samples  SM clock median "
              f"{clock.get('median', float('nan')):6.0f} MHz (min {clock.get('min', float('nan')):.0f})"
              f"  power median {power.get('median', float('nan')):5.0f} W")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
