"""The three outputs of a benchmark: JSON (everything), a markdown table, a PNG plot.

JSON layout (schema "ingot-bench", version 1): schema, schema_version, ingot_version, mode,
engine, device, seed, bandwidth {bytes_per_s, method}, roofline {weight_bytes_per_step,
kv_bytes_per_token, bandwidth_bytes_per_s}, baseline (null or {name, weights, ratio_basis, ...}),
results: one per point {name, mode, batch_size, max_concurrency, request_rate, workload,
hf_num_requests, ingot: figures, hf: figures or null, vs_hf: ratios or null}. Figures
(metrics.summarize): num_requests, input/output token counts, elapsed_s, requests_per_s,
output_tok_s, total_tok_s, ttft_ms / itl_ms / e2e_latency_ms {mean, p50, p90, p99, max},
queue_ms (same; arrival to the launch of the request's first prompt chunk: ingot only),
decode_tok_s_per_request, decode {tok_s, roofline_tok_s, fraction_of_roofline, ...}, memory,
kv_cache, prefix_cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ingot.compiler.atomic import check_writable_dir
from ingot.runtime.errors import OutputExistsError


def output_paths(out_dir: Path, stem: str) -> dict[str, Path]:
    return {ext: Path(out_dir) / f"{stem}.{ext}" for ext in ("json", "md", "png")}


def check_outputs(out_dir: Path, stem: str, force: bool) -> dict[str, Path]:
    """The output paths; OutputExistsError (before any work) if one exists without --force,
    ConfigError if the dir cannot be written."""
    check_writable_dir(out_dir)
    paths = output_paths(out_dir, stem)
    taken = [str(p) for p in paths.values() if p.exists()]
    if taken and not force:
        raise OutputExistsError(f"{taken[0]} already exists; it was kept", "pass --force")
    return paths


def write_all(doc: dict, paths: dict[str, Path]) -> None:
    """All three or none: each is written under a hidden name beside its own, then renamed."""
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    # NOTE: the hidden name keeps the suffix, from which matplotlib takes the image format
    tmp = {k: p.with_name(f".{p.stem}.tmp-{os.getpid()}{p.suffix}") for k, p in paths.items()}
    try:
        tmp["json"].write_text(json.dumps(doc, indent=2) + "\n")
        tmp["md"].write_text(markdown(doc))
        plot(doc, tmp["png"])
        for k, p in tmp.items():
            p.replace(paths[k])
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _pq(m: dict, key: str) -> str:
    d = m.get(key)
    return "–" if not d else f"{d['p50']:.1f} / {d['p99']:.1f}"


def _mem(m: dict) -> str:
    mem = m["memory"]
    if mem.get("gpu_peak_allocated_bytes") is not None:
        return f"{mem['gpu_peak_allocated_bytes'] / 2**30:.2f} GiB"
    return f"RSS {mem['process_peak_rss_bytes'] / 2**30:.2f} GiB"


COLUMNS = (
    "point",
    "system",
    "reqs",
    "in / out",
    "out tok/s",
    "total tok/s",
    "req/s",
    "TTFT p50 / p99 ms",
    "queue p50 / p99 ms",
    "ITL p50 / p99 ms",
    "decode tok/s",
    "of roofline",
    "peak memory",
    "KV util peak",
    "prefix hit",
)


def _row(point: dict, system: str, m: dict) -> list[str]:
    w = point["workload"]
    dec = m.get("decode") or {}
    kv, pc = m.get("kv_cache") or {}, m.get("prefix_cache") or {}
    frac = dec.get("fraction_of_roofline")
    return [
        point["name"],
        system,
        str(m["num_requests"]),
        f"{w['input_len']['mean']:.0f} / {w['output_len']['mean']:.0f}",
        _f(m["output_tok_s"]),
        _f(m["total_tok_s"]),
        _f(m["requests_per_s"], "{:.2f}"),
        _pq(m, "ttft_ms"),
        _pq(m, "queue_ms"),
        _pq(m, "itl_ms"),
        _f(dec.get("tok_s")),
        _f(None if frac is None else 100 * frac, "{:.0f}%"),
        _mem(m),
        _f(kv.get("peak_utilization"), "{:.2f}"),
        _f(pc.get("hit_rate"), "{:.2f}"),
    ]


def _ratio_row(point: dict, r: dict) -> list[str]:
    x = lambda k: _f(r.get(k), "{:.2f}x")  # noqa: E731
    ran = f"hf ran {point['hf_num_requests']}"
    if point.get("hf_max_output_len"):
        ran += f", ≤ {point['hf_max_output_len']} out"
    row = ["", "ingot vs hf", ran, ""]
    row += [x("output_tok_s_ratio"), x("total_tok_s_ratio"), x("requests_per_s_ratio")]
    row += [f"{x('ttft_p50_speedup')} / {x('ttft_p99_speedup')}", ""]
    row += [f"{x('itl_p50_speedup')} / {x('itl_p99_speedup')}"]
    return row + [x("decode_tok_s_per_request_ratio"), "", "", "", ""]


def markdown(doc: dict) -> str:
    e, d = doc["engine"], doc["device"]
    lines = [
        f"# ingot bench: {doc['mode']}",
        "",
        f"engine `{e['dir']}` ({e['architecture']}, {e['dtype']}, quant {e['quant']}, "
        f"target {e['target']}) on {d['type']} {d['name']}; ingot {doc['ingot_version']}, "
        f"seed {doc['seed']}; bandwidth {doc['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s "
        f"({doc['bandwidth']['method']})",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for p in doc["results"]:
        lines.append("| " + " | ".join(_row(p, "ingot", p["ingot"])) + " |")
        if p.get("hf"):
            lines.append("| " + " | ".join(_row(p, "hf", p["hf"])) + " |")
            lines.append("| " + " | ".join(_ratio_row(p, p["vs_hf"])) + " |")
    lines += [
        "",
        "Ratios: rates are ingot / hf, latencies hf / ingot (> 1: ingot is better). decode "
        "tok/s covers decode-only steps; 'of roofline' is the time those steps must take at "
        "the measured bandwidth (weights + KV read) over the time they took.",
    ]
    if doc["device"]["type"] == "cpu":
        lines.append("Peak memory on the CPU is the process's peak RSS (not per run).")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """Serve: latency against throughput over the request rates. Throughput: tok/s against
    batch size (a sweep) or per point. Latency: decode tok/s against its roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    groups = [(m, [p for p in res if p["mode"] == m]) for m in ("latency", "throughput", "serve")]
    groups = [(m, ps) for m, ps in groups if ps]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    systems = ["ingot"] + (["hf"] if any(p.get("hf") for p in res) else [])
    for ax, (mode, ps) in zip(axes[0], groups, strict=True):
        {"latency": _plot_latency, "throughput": _plot_throughput, "serve": _plot_serve}[mode](
            ax, ps, systems
        )
    fig.suptitle(f"ingot bench ({doc['mode']}) on {doc['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_latency(ax, ps: list[dict], systems: list[str]) -> None:
    names = [p["name"] for p in ps]
    for k, s in enumerate(systems):
        vals = [((p[s] or {}).get("decode") or {}).get("tok_s") or 0 for p in ps]
        ax.bar([i + 0.4 * k for i in range(len(ps))], vals, width=0.4, label=s)
    roof = [(p["ingot"].get("decode") or {}).get("roofline_tok_s") or 0 for p in ps]
    ax.scatter(range(len(ps)), roof, marker="_", s=400, color="k", label="roofline (ingot)")
    ax.set_xticks(range(len(ps)), names, fontsize=7)
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title("latency")
    ax.legend()


def _plot_throughput(ax, ps: list[dict], systems: list[str]) -> None:
    sizes = [p["batch_size"] for p in ps]
    sweep = len(set(sizes)) > 1 and len({p["name"].rsplit("_b", 1)[0] for p in ps}) == 1
    for k, s in enumerate(systems):
        vals = [(p[s] or {}).get("output_tok_s") or 0 for p in ps]
        if sweep:  # the baseline may have run fewer requests, so smaller batches: plot those
            xs = sizes if s == "ingot" else [p["hf"]["hf_mean_batch_size"] for p in ps]
            ax.plot(xs, vals, marker="o", label=s)
        else:
            ax.bar([i + 0.4 * k for i in range(len(ps))], vals, width=0.4, label=s)
    if sweep:
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
    else:
        ax.set_xticks(
            range(len(ps)), [p["name"].removeprefix("throughput_") for p in ps], fontsize=7
        )
    ax.set_ylabel("output tok/s")
    ax.set_title("throughput")
    ax.legend()


def _plot_serve(ax, ps: list[dict], systems: list[str]) -> None:
    for s in systems:
        runs = [p for p in ps if p.get(s)]
        x = [p[s]["output_tok_s"] or 0 for p in runs]
        for key, style in (("ttft_ms", "-o"), ("itl_ms", "--s")):
            y = [(p[s].get(key) or {}).get("p50") or 0 for p in runs]
            ax.plot(x, y, style, label=f"{s} {key.removesuffix('_ms').upper()} p50")
        for p, xi in zip(runs, x, strict=True):
            ax.annotate(
                f"{p['request_rate']:g}/s",
                (xi, (p[s].get("ttft_ms") or {}).get("p50") or 0),
                fontsize=7,
            )
    ax.set_xlabel("output tok/s")
    ax.set_ylabel("latency ms (p50)")
    ax.set_yscale("log")
    ax.set_title("serve: latency vs throughput over request rates")
    ax.legend(fontsize=7)
