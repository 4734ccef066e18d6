"""scripts/clock_report.py: nvidia-smi samples summarized per throughput point."""

from tests.scripts_import import load_script

clock_report = load_script("clock_report")

SMI = """timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, utilization.gpu [%]
2026/12/06 10:00:00.100, 1980 MHz, 2619 MHz, 120.50 W, 40, 0 %
2026/12/06 10:00:01.100, 1755 MHz, 2619 MHz, 690.00 W, 60, 100 %
2026/12/06 10:00:01.600, 1650 MHz, 2619 MHz, 700.00 W, 61, 100 %
2026/12/06 10:00:02.100, 1830 MHz, 2619 MHz, [N/A], 62, 100 %
2026/12/06 10:00:03.100, 1980 MHz, 2619 MHz, 100.00 W, 50, 0 %
2026/12/06 10:00:03.6
"""
LAPS = """make_model 09:59:00
build_fp8 09:59:50
start fp8/tput_128_128 10:00:01
end fp8/tput_128_128 10:00:02
start fp8/tput_2048_128 10:00:05
"""


def test_samples_inside_each_point_are_summarized(tmp_path):
    (tmp_path / "smi.csv").write_text(SMI)
    (tmp_path / "laps.txt").write_text(LAPS)
    samples = clock_report.read_smi(tmp_path / "smi.csv")
    assert len(samples) == 5  # the cut-off last line dropped
    spans = clock_report.read_spans(tmp_path / "laps.txt")
    assert list(spans) == ["fp8/tput_128_128"]  # a point never ended is left out
    (point,) = clock_report.summarize(samples, spans).values()
    assert point["samples"] == 2  # 10:00:01.100 and 10:00:01.600; 02.100 is past the end
    assert point["clocks.current.sm"] == {"median": 1702.5, "min": 1650.0}
    assert point["power.draw"] == {"median": 695.0, "min": 690.0}
    assert point["utilization.gpu"]["min"] == 100.0
    assert point["busy"]["samples"] == 2 and point["busy"]["power.draw"]["min"] == 690.0


def test_busy_samples_leave_out_the_engine_load():
    at = clock_report.time.fromisoformat
    samples = [{"at": at("10:00:01"), "clocks.current.sm": 345.0, "utilization.gpu": 0.0},
               {"at": at("10:00:02"), "clocks.current.sm": 1590.0, "utilization.gpu": 100.0},
               {"at": at("10:00:03"), "clocks.current.sm": 1640.0, "utilization.gpu": 95.0}]  # fmt: skip
    (point,) = clock_report.summarize(samples, {"p": (at("10:00:00"), at("10:00:04"))}).values()
    assert point["clocks.current.sm"]["median"] == 1590.0
    assert point["busy"]["clocks.current.sm"] == {"median": 1615.0, "min": 1590.0}
