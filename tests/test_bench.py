"""`ingot bench` on a tiny CPU engine: every mode runs, every field is present and consistent.

These check invariants (token counts, ordered percentiles, ratios against raw figures, files
written), never speed: timings on a shared CI machine are noise.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import typer
from model_shapes import LLAMA_3_1_8B
from typer.testing import CliRunner

from ingot.cli.bench import Options
from ingot.cli.bench.hf_model import model_from_engine
from ingot.cli.bench.points import build_points
from ingot.cli.bench.workload import (
    from_jsonl,
    point_seed,
    synthetic,
    with_poisson_arrivals,
)
from ingot.cli.bench_cmd import bench_cmd
from ingot.cli.main import user_errors
from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.runtime.config import BuildConfig
from ingot.runtime.engine import load_engine

app = typer.Typer()


@app.callback()
def _group() -> None:
    """Keeps `bench` a named subcommand, as in the real app."""


app.command("bench")(user_errors(bench_cmd))


def _engine(hf: Path, out: Path) -> Path:
    ckpt = convert_checkpoint(hf, out / "ckpt", dtype="float32")
    overrides = {"max_seq_len": 64, "max_batch_size": 8, "max_num_tokens": 256}
    return build_engine(ckpt, out / "engine", target="cpu", overrides=overrides)


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory) -> Path:
    return _engine(tiny_hf_dir("llama", seed=3), tmp_path_factory.mktemp("bench"))


def _bench(engine: Path, out: Path, *args):
    argv = ["bench", "--engine-dir", str(engine), "--output-dir", str(out), *map(str, args)]
    return CliRunner().invoke(app, argv)


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def _check_dist(d: dict | None) -> None:
    assert d is not None
    assert 0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert d["mean"] <= d["max"]


def _check_figures(m: dict, point: dict, system: str) -> None:
    n = m["num_requests"]
    w = point["workload"]
    assert n == (w["num_requests"] if system == "ingot" else point["hf_num_requests"])
    # every requested token was generated, streamed (timestamped) and counted once
    assert m["output_tokens"] == m["output_tokens_generated"] == m["output_tokens_requested"]
    if system == "ingot":
        assert m["output_tokens"] == w["output_tokens"] and m["input_tokens"] == w["input_tokens"]
    t = m["elapsed_s"]
    assert t > 0
    assert _close(m["output_tok_s"] * t, m["output_tokens"])
    assert _close(m["total_tok_s"] * t, m["input_tokens"] + m["output_tokens"])
    assert _close(m["requests_per_s"] * t, n)
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms", "decode_tok_s_per_request"):
        _check_dist(m[key])
    assert m["ttft_ms"]["max"] <= m["e2e_latency_ms"]["max"]
    if system == "ingot":
        # each request's queue wait ends before its first token: so does every percentile
        q, t = m["queue_ms"], m["ttft_ms"]
        _check_dist(q)
        assert q["p50"] >= 0 and all(q[k] <= t[k] for k in ("mean", "p50", "p90", "p99", "max"))
    else:
        assert m["queue_ms"] is None  # the baseline does not say when a request started
    dec = m["decode"]
    assert dec["steps"] > 0 and dec["tokens"] >= dec["steps"]
    assert _close(dec["tok_s"], dec["tokens"] / dec["seconds"])
    assert dec["roofline_tok_s"] > 0 and 0 < dec["fraction_of_roofline"]
    assert _close(dec["fraction_of_roofline"], dec["tok_s"] / dec["roofline_tok_s"])
    mem = m["memory"]
    assert mem["gpu_peak_allocated_bytes"] is None and mem["process_peak_rss_bytes"] > 0
    assert "RSS" in mem["kind"]
    if system == "ingot":
        kv = m["kv_cache"]
        assert 0 < kv["peak_used_blocks"] <= kv["num_blocks"]
        assert 0 <= kv["mean_utilization"] <= kv["peak_utilization"] <= 1
        assert set(m["prefix_cache"]) >= {"hit_blocks", "miss_blocks", "hit_rate"}
        assert m["allocator"] is None  # a CPU run: no caching allocator to count
        mix = m["step_mix"]
        # every step is of one kind: the kinds' steps add up to the run's, and every prompt
        # and decode token not found in the prefix cache was computed in one of them
        assert sum(k["steps"] for k in mix.values()) == m["steps"]
        assert mix["decode"]["steps"] == dec["steps"]
        assert _close(mix["decode"]["seconds"], dec["seconds"])
        computed = sum(k["tokens"] for k in mix.values())
        hits = m["prefix_cache"]["hit_tokens"]
        assert computed == m["input_tokens"] + m["output_tokens"] - n - hits
        assert mix["prefill"]["steps"] + mix["mixed"]["steps"] > 0
        # the executor's host phases of a step fit inside its wall time
        for k in mix.values():
            if k["steps"]:
                ph = k["phase_mean_ms"]
                assert all(v >= 0 for v in ph.values())
                inside = sum(v for p, v in ph.items() if p != "between")
                assert 0 < inside <= k["mean_ms"] * (1 + 1e-6)
    else:
        assert m["kv_cache"] is None and m["prefix_cache"] is None


def _check_ratios(r: dict, ours: dict, hf: dict) -> None:
    assert _close(r["output_tok_s_ratio"], ours["output_tok_s"] / hf["output_tok_s"])
    assert _close(r["ttft_p50_speedup"], hf["ttft_ms"]["p50"] / ours["ttft_ms"]["p50"])
    assert _close(r["itl_p99_speedup"], hf["itl_ms"]["p99"] / ours["itl_ms"]["p99"])


def _load(out: Path, stem: str) -> dict:
    for ext in ("json", "md", "png"):
        assert (out / f"{stem}.{ext}").stat().st_size > 0
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / f"{stem}.json").read_text())
    assert doc["schema"] == "ingot-bench" and doc["schema_version"] == 1
    assert doc["bandwidth"]["bytes_per_s"] > 0 and doc["device"]["type"] == "cpu"
    roof = doc["roofline"]
    assert roof["weight_bytes_per_step"] > 0 and roof["kv_bytes_per_token"] > 0
    md = (out / f"{stem}.md").read_text()
    for p in doc["results"]:
        assert p["name"] in md
    # the table: every row (ingot, hf, the ratios) has a cell under each column
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert "| queue p50 / p99 ms |" in table[0]
    assert len({line.count(" | ") for line in table}) == 1, table
    for p in doc["results"]:  # ingot's queue cell: its p50 / p99
        row = next(line for line in table if line.startswith(f"| {p['name']} | ingot |"))
        q = p["ingot"]["queue_ms"]
        assert f"| {q['p50']:.1f} / {q['p99']:.1f} |" in row, row
    return doc


def test_latency_with_hf_baseline(engine, tmp_path):
    r = _bench(engine, tmp_path, "latency", "--input-len", 20, "--output-len", 6,
               "--num-requests", 3, "--baseline", "hf")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = _load(tmp_path, "latency")
    assert doc["mode"] == "latency" and doc["baseline"]["name"] == "hf"
    (p,) = doc["results"]
    assert p["batch_size"] == 1 and p["workload"]["input_len"]["mean"] == 20
    for system in ("ingot", "hf"):
        _check_figures(p[system], p, system)
        assert p[system]["decode"]["mean_batch"] == 1  # batch 1: one sequence per step
        assert len(p[system]["itl_ms"]) == 5
    _check_ratios(p["vs_hf"], p["ingot"], p["hf"])
    assert "| latency_in20_out6 | ingot |" in r.stdout


def test_throughput_batch_sweep_with_reduced_baseline(engine, tmp_path):
    r = _bench(engine, tmp_path, "throughput", "--input-len", 12, "--output-len", 5,
               "--batch-sizes", "1,4", "--num-requests", 4, "--baseline", "hf",
               "--hf-num-requests", 2)  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = _load(tmp_path, "throughput")
    assert [p["batch_size"] for p in doc["results"]] == [1, 4]
    for p in doc["results"]:
        assert p["hf_num_requests"] == 2 and p["hf"]["num_requests"] == 2
        _check_figures(p["ingot"], p, "ingot")
        _check_figures(p["hf"], p, "hf")
        _check_ratios(p["vs_hf"], p["ingot"], p["hf"])
        assert p["ingot"]["decode"]["mean_batch"] <= p["batch_size"]
    # the baseline's outputs capped at 3 tokens: it made 3 per request; whole-request ratios
    # (requests/s, end-to-end latency) are left out, token rates kept
    r = _bench(engine, tmp_path / "capped", "throughput", "--input-len", 12, "--output-len", 5,
               "--num-requests", 4, "--baseline", "hf", "--hf-max-output-len", 3)  # fmt: skip
    assert r.exit_code == 0, r.output
    p = _load(tmp_path / "capped", "throughput")["results"][0]
    assert p["hf_max_output_len"] == 3 and p["hf"]["output_tokens"] == 3 * p["hf"]["num_requests"]
    assert (
        p["vs_hf"]["requests_per_s_ratio"] is None and p["vs_hf"]["e2e_latency_p50_speedup"] is None
    )
    assert p["vs_hf"]["output_tok_s_ratio"] > 0
    # the two points drew different prompts (no prefix hits between points)
    assert all(p["ingot"]["prefix_cache"]["hit_blocks"] == 0 for p in doc["results"])
    assert "ingot vs hf" in (tmp_path / "throughput.md").read_text()


def test_serve_poisson_rates_and_prefix_cache(engine, tmp_path):
    r = _bench(engine, tmp_path, "serve", "--input-len", 40, "--output-len", 4,
               "--shared-prefix-len", 32, "--request-rates", "50,400",
               "--num-requests", 6)  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = _load(tmp_path, "serve")
    assert doc["baseline"] is None
    assert [p["request_rate"] for p in doc["results"]] == [50, 400]
    for p in doc["results"]:
        assert p["hf"] is None and p["vs_hf"] is None
        _check_figures(p["ingot"], p, "ingot")
        pc = p["ingot"]["prefix_cache"]
        # the shared 32-token prefix is two full blocks: every request after the first hits
        assert pc["hit_blocks"] >= 2 * 5 and 0 < pc["hit_rate"] <= 1


def test_throughput_from_dataset(engine, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"input_len": 9, "output_len": 3}, {"prompt_ids": [5, 6, 7], "output_len": 7}]
    data.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    r = _bench(engine, tmp_path, "throughput", "--dataset", data, "--baseline", "hf",
               "--no-pipeline")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = _load(tmp_path, "throughput")
    assert doc["engine"]["executor"]["pipeline"] is False
    (p,) = doc["results"]
    assert p["workload"]["output_tokens"] == 10 and p["workload"]["input_tokens"] == 12
    _check_figures(p["ingot"], p, "ingot")
    _check_figures(p["hf"], p, "hf")  # padded static batch: only requested tokens count
    assert p["hf"]["hf_wasted_tokens"] == 4


def test_user_errors_are_one_line(engine, tmp_path, tiny_hf_dir):
    cases = [
        ((), "no MODE"),
        (("fastest",), "unknown mode"),
        (("latency", "--input-len", 60, "--output-len", 10), "max_seq_len"),
        (("throughput", "--batch-sizes", "4,99"), "max_batch_size"),
        (("serve", "--request-rates", "-1"), "> 0"),
        (("latency", "--baseline", "vllm"), "--baseline"),
        (("latency", "--grid", "standard"), "not both"),
        (("latency", "--grid", "huge"), "not both"),
        (("latency", "--input-len", 0, "--output-len", 4), "--input-len must be > 0, got 0"),
        (("throughput", "--output-len", -2), "--output-len must be > 0, got -2"),
        (("throughput", "--dataset", tmp_path), "is a directory"),
    ]
    for args, needle in cases:
        r = _bench(engine, tmp_path / "x", *args)
        assert r.exit_code == 2, (args, r.output)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    r = _bench(engine, tmp_path / "x", "--grid", "huge")
    assert r.exit_code == 2 and "unknown --grid" in r.stderr
    assert not (tmp_path / "x").exists()  # checked writable, and not left behind
    # an output dir that cannot be made (a file in the way), before any work
    (tmp_path / "file").write_text("x")
    r = _bench(engine, tmp_path / "file" / "sub", "latency", "--input-len", 8, "--output-len", 4)
    assert r.exit_code == 2 and "cannot create" in r.stderr and "ingot latency" not in r.output
    # an engine for another device: the engine's own line, before the bandwidth is measured
    gpu = tmp_path / "gpu-engine"
    shutil.copytree(engine, gpu)
    cfg = json.loads((gpu / "config.json").read_text())
    cfg["target"] = cfg["build"]["target"] = "sm_80"
    (gpu / "config.json").write_text(json.dumps(cfg))
    r = _bench(gpu, tmp_path / "z", "latency", "--input-len", 8, "--output-len", 4)
    (line,) = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and "built for" in line and "sm_80" in line, r.output
    # a baseline dir that is not the engine's source model, refused before ingot's own run
    short = ("latency", "--input-len", 8, "--output-len", 4, "--baseline", "hf", "--hf-model-dir")
    for hf_dir, needle in ((engine.parent / "ckpt", "names no architecture"),
                           (tiny_hf_dir("qwen2"), "holds Qwen2ForCausalLM, the engine Llama")):  # fmt: skip
        r = _bench(engine, tmp_path / "w", *short, hf_dir)
        (line,) = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and needle in line and "ingot latency" not in r.output, r.output
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "latency.md").write_text("keep me")
    r = _bench(engine, tmp_path / "y", "latency", "--num-requests", 1)
    assert r.exit_code == 2 and "--force" in r.stderr
    assert (tmp_path / "y" / "latency.md").read_text() == "keep me"


def test_a_failed_write_leaves_no_outputs(engine, tmp_path, monkeypatch):
    """The plot fails after the JSON and the table were rendered: none of the three is left,
    the error is one line (a bug, exit 1) and the earlier files are untouched with --force."""
    import tempfile

    import ingot.cli.bench.report as report

    def broken_plot(doc, path):
        path.write_bytes(b"half a png")
        raise ValueError("plot broke")

    monkeypatch.setattr(report, "plot", broken_plot)
    monkeypatch.delenv("INGOT_TRACEBACK", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the crash reports
    out = tmp_path / "out"
    args = ("latency", "--input-len", 8, "--output-len", 2, "--num-requests", 1)
    r = _bench(engine, out, *args)
    assert r.exit_code == 1 and "ValueError: plot broke" in r.stderr, r.output
    assert list(out.iterdir()) == []
    (out / "latency.md").write_text("keep me")
    r = _bench(engine, out, *args, "--force")
    assert r.exit_code == 1
    assert sorted(p.name for p in out.iterdir()) == ["latency.md"]
    assert (out / "latency.md").read_text() == "keep me"


def test_workloads_are_reproducible(tmp_path):
    a = synthetic(4, 10, 3, vocab_size=100, seed=7, shared_prefix_len=4)
    assert a == synthetic(4, 10, 3, vocab_size=100, seed=7, shared_prefix_len=4)
    assert a != synthetic(4, 10, 3, vocab_size=100, seed=8, shared_prefix_len=4)
    assert len({it.prompt_ids[:4] for it in a.items}) == 1
    assert len({it.prompt_ids for it in a.items}) == 4
    assert point_seed(0, "latency_in1_out1") == point_seed(0, "latency_in1_out1")
    assert point_seed(0, "a") != point_seed(0, "b")
    s = with_poisson_arrivals(a, rate=10.0, seed=1)
    assert s.arrivals == with_poisson_arrivals(a, rate=10.0, seed=1).arrivals
    assert s.arrivals[0] == 0 and list(s.arrivals) == sorted(s.arrivals)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_len": 5, "output_len": 2}\n\n{"input_len": 3, "output_len": 1}\n')
    d = from_jsonl(data, vocab_size=50, seed=3)
    assert [it.input_len for it in d.items] == [5, 3] and d == from_jsonl(data, 50, 3)


def test_standard_grid_is_the_h200_grid():
    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=256, max_seq_len=8192, target="sm_90")
    points = build_points(Options(mode="grid"), m, b, grid="standard")
    modes = [p.mode for p in points]
    assert modes == ["latency"] + ["throughput"] * 4 + ["serve"] * 3
    shapes = [
        (p.workload.items[0].input_len, p.workload.items[0].output_len)
        for p in points
        if p.mode == "throughput"
    ]
    assert shapes == [(128, 128), (128, 2048), (2048, 128), (2048, 2048)]
    assert points[0].max_concurrency == 1
    assert [p.request_rate for p in points if p.mode == "serve"] == [4.0, 16.0, 64.0]
    assert all(p.hf_num_requests <= len(p.workload) for p in points)
    assert len({p.workload.seed for p in points}) == len(points)
    # the baseline's 2,048-token outputs stop at 128 tokens; the others run whole
    capped = [p.name for p in points if p.hf_outputs_capped]
    assert capped == ["throughput_in128_out2048", "throughput_in2048_out2048"], capped
    assert all(it.output_len == 128 for p in points for it in p.hf_workload().items)


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {"rope_scaling_llama3": True}),
        ("llama", {"tie_word_embeddings": True}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen3", {}),
    ],  # fmt: skip
)
def test_hf_model_rebuilt_from_engine_matches_source(family, kw, tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_dir(family, **kw)
    eng = load_engine(_engine(hf, tmp_path))
    cfg = eng.config
    rebuilt = model_from_engine(eng.weights(), cfg.model, cfg.quant.mode, torch.device("cpu"))
    source = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, source(ids).logits)


def test_allocator_delta_counts_what_grew_during_a_run():
    from ingot.cli.bench.metrics import ALLOCATOR_COUNTERS, allocator_delta

    before = dict.fromkeys(ALLOCATOR_COUNTERS, 3)
    after = {k: 3 + i for i, k in enumerate(ALLOCATOR_COUNTERS)}
    assert allocator_delta(before, after) == {k: i for i, k in enumerate(ALLOCATOR_COUNTERS)}
    assert allocator_delta(None, after) is None and allocator_delta(before, None) is None


def test_warm_up_fills_one_step_of_the_points_shape():
    """The untimed warm-up before a point runs as many of its longest prompts as its first
    step takes: bounded by the token budget, the batch, the point's concurrency and size."""
    from types import SimpleNamespace

    from ingot.cli.bench.points import Point
    from ingot.cli.bench.runner import warm_workload

    build = SimpleNamespace(max_batch_size=512, max_num_tokens=8192)

    def warm_requests(p, build, limit=None):
        w = warm_workload(p, build, 100, limit)
        assert {it.input_len for it in w.items} == {max(it.input_len for it in p.workload.items)}
        return len(w)

    def point(n, inp, concurrency=None):
        return Point("p", "throughput", synthetic(n, inp, 2, 100, seed=1), concurrency, n)

    assert warm_requests(point(4096, 128), build) == 64  # 128/128: the token budget
    assert warm_requests(point(512, 2048), build) == 4
    assert warm_requests(point(4096, 16), build) == 512  # the batch
    assert warm_requests(point(8, 128, concurrency=1), build) == 1  # a latency point
    assert warm_requests(point(3, 128), build) == 3  # the point's size
    assert warm_requests(point(10, 9000), build) == 1  # a prompt longer than the budget
    assert warm_requests(point(4096, 128), build, limit=8) == 8  # the baseline's share
