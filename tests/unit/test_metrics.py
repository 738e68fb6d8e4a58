import logging
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_lite.components import device_peaks, metrics
from torchtitan_lite.components.device_peaks import gpu_bf16_peak_flops, measure_cpu_matmul_tflops
from torchtitan_lite.components.metrics import MetricsProcessor


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _build(tmp_path, clock=None, **config_kwargs):
    config_kwargs.setdefault("cpu_peak_tflops", 10.0)
    config_kwargs.setdefault("enable_tensorboard", False)
    return MetricsProcessor.Config(**config_kwargs).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=6e9, dp_degree=4, rank=0,
        clock=clock or FakeClock(),
    )


def test_tokens_per_second_tflops_and_mfu_arithmetic(tmp_path, caplog):
    clock = FakeClock()
    processor = _build(tmp_path, clock)
    processor.record_tokens(600)
    processor.record_tokens(400)
    clock.now += 2.0
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        values = processor.log(1, loss=2.0, grad_norm=0.5, lr=1e-3)
    # 1000 tokens in 2 s = 500 tok/s per device; x 6e9 FLOPs/token = 3 TFLOP/s; of a 10 TFLOP/s peak = 30%.
    # Exact binary-representable arithmetic except the 1e12 scalings: compare at 1e-12.
    assert values["tokens_per_second"] == pytest.approx(500.0, rel=1e-12)
    assert values["tflops"] == pytest.approx(3.0, rel=1e-12)
    assert values["mfu"] == pytest.approx(30.0, rel=1e-12)
    assert values["memory_gib"] > 0  # peak RSS of this process
    assert "tok/s 500 (global 2,000)" in caplog.text  # 4 data-parallel ranks
    assert "mfu 30.00%" in caplog.text and "loss   2.0000" in caplog.text

    # The window restarts after each log.
    processor.record_tokens(100)
    clock.now += 1.0
    assert processor.log(2, loss=2.0, grad_norm=0.5, lr=1e-3)["tokens_per_second"] == pytest.approx(100.0)


def test_a_document_mask_counts_only_the_attention_it_does(tmp_path):
    clock = FakeClock()
    processor = MetricsProcessor.Config(cpu_peak_tflops=10.0, enable_tensorboard=False).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=6e9, attention_flops_per_token=2e9, rank=0,
        clock=clock)
    processor.record_tokens(600, attention_share=0.5)
    processor.record_tokens(400)  # causal: all of its attention
    clock.now += 2.0
    values = processor.log(1, loss=2.0, grad_norm=0.5, lr=1e-3)
    # 500 tok/s x 6e9 = 3 TFLOP/s, less the skipped half of 600 tokens' attention: 300 / 2 s x 2e9 = 0.3.
    assert values["tflops"] == pytest.approx(2.7, rel=1e-12)
    processor.record_tokens(1000)
    clock.now += 2.0
    assert processor.log(2, loss=2.0, grad_norm=0.5, lr=1e-3)["tflops"] == pytest.approx(3.0, rel=1e-12)


def test_tensor_parallel_ranks_share_tokens(tmp_path):
    clock = FakeClock()
    processor = MetricsProcessor.Config(cpu_peak_tflops=10.0, enable_tensorboard=False).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=6e9, tp_degree=2, rank=0, clock=clock
    )
    processor.record_tokens(1000)
    clock.now += 1.0
    values = processor.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert values["tokens_per_second"] == pytest.approx(500.0)
    assert values["mfu"] == pytest.approx(30.0)


def test_excluded_time_does_not_count(tmp_path):
    clock = FakeClock()
    processor = _build(tmp_path, clock)
    processor.record_tokens(1000)
    clock.now += 1.0
    with processor.exclude_from_throughput():
        clock.now += 5.0  # e.g. validation
    values = processor.log(10, loss=1.0, grad_norm=1.0, lr=1.0)
    assert values["tokens_per_second"] == pytest.approx(1000.0)


def test_tensorboard_scalars_read_back(tmp_path):
    clock = FakeClock()
    processor = _build(tmp_path, clock, enable_tensorboard=True)
    logged = {}
    for step, loss in ((1, 4.0), (10, 3.0), (20, 2.5)):
        processor.record_tokens(2000)
        clock.now += 4.0
        logged[step] = processor.log(step, loss=loss, grad_norm=loss / 10, lr=1e-3 * step,
                                     extra={"loss_scale": 2.0**step})
    processor.log_validation(20, 2.75)
    processor.close()

    events = EventAccumulator(os.path.join(str(tmp_path), "tb"))
    events.Reload()
    expected_tags = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_second", "train/tflops",
                     "train/mfu", "train/memory_gib", "train/loss_scale", "val/loss"}
    assert set(events.Tags()["scalars"]) == expected_tags

    def read(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    # TensorBoard stores float32: compare at float32 resolution.
    assert read("train/loss") == {1: 4.0, 10: 3.0, 20: 2.5}
    assert read("train/lr") == pytest.approx({1: 1e-3, 10: 1e-2, 20: 2e-2}, rel=1e-6)
    assert read("train/grad_norm") == pytest.approx({1: 0.4, 10: 0.3, 20: 0.25}, rel=1e-6)
    assert read("train/tokens_per_second") == {1: 500.0, 10: 500.0, 20: 500.0}
    assert read("train/tflops") == pytest.approx({1: 3.0, 10: 3.0, 20: 3.0}, rel=1e-6)
    assert read("train/mfu") == pytest.approx({1: 30.0, 10: 30.0, 20: 30.0}, rel=1e-6)
    assert read("train/memory_gib") == pytest.approx({s: v["memory_gib"] for s, v in logged.items()}, rel=1e-6)
    assert read("train/loss_scale") == {1: 2.0, 10: 1024.0, 20: 2.0**20}
    assert read("val/loss") == {20: 2.75}


def test_log_schedule_step_one_every_log_freq_and_forced(tmp_path):
    processor = _build(tmp_path, log_freq=5)
    logged = [s for s in range(1, 13) if processor.maybe_log(s, loss=1.0, grad_norm=1.0, lr=1.0) is not None]
    assert logged == [1, 5, 10]
    assert processor.maybe_log(12, loss=1.0, grad_norm=1.0, lr=1.0, force=True) is not None


def test_extra_keys_may_not_shadow_builtin_metrics(tmp_path):
    processor = _build(tmp_path)
    with pytest.raises(ValueError, match=r"extra metric 'loss' clashes with a built-in train/loss"):
        processor.log(1, loss=1.0, grad_norm=1.0, lr=1.0, extra={"loss": 2.0})


def test_console_colors(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        _build(tmp_path, enable_color=True).log(1, loss=1.0, grad_norm=1.0, lr=1.0)
        assert "\033[31mstep      1\033[0m" in caplog.records[-1].getMessage()  # caplog.text strips colors
        _build(tmp_path, enable_color=False).log_validation(3, 1.5)
        assert caplog.records[-1].getMessage() == "step      3  validation loss   1.5000"


def test_other_ranks_stay_silent_unless_tensorboard_is_per_rank(tmp_path, caplog):
    quiet = MetricsProcessor.Config(cpu_peak_tflops=1.0).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=1.0, rank=1
    )
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        quiet.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert quiet.writer is None and caplog.text == "" and not (tmp_path / "tb").exists()

    per_rank = MetricsProcessor.Config(cpu_peak_tflops=1.0, rank_0_only=False).build(
        dump_folder=str(tmp_path), device="cpu", num_flops_per_token=1.0, rank=1
    )
    per_rank.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    per_rank.close()
    assert os.listdir(tmp_path / "tb" / "rank_1")


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    """An empty peak cache, no peak remembered by this process, and a matmul benchmark that counts its calls."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(cache))
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {})
    calls = []
    monkeypatch.setattr(device_peaks, "measure_cpu_matmul_tflops", lambda dtype: calls.append(dtype) or
                        {torch.float32: 2.0, torch.bfloat16: 6.0}[dtype])
    monkeypatch.setattr(device_peaks, "cpu_dense_dtypes", lambda: [torch.float32, torch.bfloat16])
    return cache, calls


def test_cpu_peak_is_measured_once_when_not_given(tmp_path, peak_cache, caplog):
    cache, calls = peak_cache
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        first = _build(tmp_path, cpu_peak_tflops=None)
        second = _build(tmp_path, cpu_peak_tflops=None)
    assert calls == [torch.float32, torch.bfloat16]  # once per process, every native dtype
    assert first.peak_flops == second.peak_flops == 6e12  # the fastest one
    assert ("CPU peak for MFU measured with a bfloat16 matmul benchmark (the fastest dtype this CPU runs): 6 TFLOP/s, "
            f"kept for this machine's later runs in {cache / 'cpu_peak.json'}") in caplog.text


def test_cpu_peak_is_measured_once_per_machine(tmp_path, peak_cache, monkeypatch, caplog):
    cache, calls = peak_cache
    _build(tmp_path, cpu_peak_tflops=None)
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {})  # a later process on the same machine
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        later = _build(tmp_path, cpu_peak_tflops=None)
    assert calls == [torch.float32, torch.bfloat16]  # not measured again
    assert later.peak_flops == 6e12
    assert (f"CPU peak for MFU: 6 TFLOP/s (bfloat16), measured once on this machine and read from "
            f"{cache / 'cpu_peak.json'}; --metrics.remeasure_cpu_peak true measures it again") in caplog.text
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {})
    _build(tmp_path, cpu_peak_tflops=None, remeasure_cpu_peak=True)
    assert calls == [torch.float32, torch.bfloat16] * 2


def test_cpu_peak_cache_is_keyed_by_what_the_peak_depends_on(peak_cache, monkeypatch):
    cache, calls = peak_cache
    base = dict(model="AMD EPYC", flags={"avx512f", "avx512_bf16"}, torch_version="2.13.0", cores=2)
    key = device_peaks.cpu_peak_key(**base)
    assert key.startswith("AMD EPYC | flags ") and key.endswith(" | torch 2.13.0 | 2 cores")
    assert device_peaks.cpu_peak_key(**dict(base, flags={"avx512_bf16", "avx512f"})) == key  # order does not matter
    for change in ({"model": "Intel Xeon"}, {"flags": {"avx512f"}}, {"torch_version": "2.12.0"}, {"cores": 1}):
        assert device_peaks.cpu_peak_key(**dict(base, **change)) != key, change
    device_peaks.cached_cpu_peak()
    monkeypatch.setattr(device_peaks, "machine_cores", lambda: 97)  # other cores (a wider affinity): a peak of its own
    assert device_peaks.cached_cpu_peak().measured_now
    assert len(calls) == 4


@pytest.fixture
def fake_threads(monkeypatch):
    """torch's thread count as a plain variable, on a fake 8-core machine: no figure depends on this CPU."""
    threads = {"now": 1}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["now"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(now=n))
    monkeypatch.setattr(device_peaks, "machine_cores", lambda: 8)
    return threads


def test_the_cpu_peak_is_the_whole_machines_whatever_threads_the_run_uses(tmp_path, peak_cache, fake_threads,
                                                                          monkeypatch):
    cache, calls = peak_cache
    measured_on = []
    monkeypatch.setattr(device_peaks, "measure_cpu_matmul_tflops", lambda dtype: measured_on.append(
        torch.get_num_threads()) or {torch.float32: 2.0, torch.bfloat16: 6.0}[dtype])
    one_thread = _build(tmp_path, cpu_peak_tflops=None)  # a run on 1 thread measures the machine: all 8 cores
    assert measured_on == [8, 8] and fake_threads["now"] == 1  # and keeps its own thread count
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {})  # a later process, on all 8 threads
    fake_threads["now"] = 8
    eight_threads = _build(tmp_path, cpu_peak_tflops=None)
    assert measured_on == [8, 8]  # the same key: read from the cache, not measured per thread count
    assert one_thread.peak_flops == eight_threads.peak_flops == 6e12
    for processor in (one_thread, eight_threads):  # the same rate is the same MFU: one scale for both runs
        processor.record_tokens(100)  # 100 tok/s x 6e9 FLOPs/token = 0.6 TFLOP/s = 10% of 6 TFLOP/s
        processor.clock.now += 1.0
        assert processor.log(1, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(10.0, rel=1e-12)


def test_the_processes_of_a_node_share_its_peak(tmp_path, fake_threads, caplog):
    # Two CPU processes on one machine each get half its peak: each rank's MFU is then the node's rate
    # against the whole machine (two ranks at 0.6 TFLOP/s on a 6 TFLOP/s machine: 20%, not 10% each).
    assert device_peaks.process_share_flops(6e12, 2) == 3e12
    assert device_peaks.process_share_flops(6e12, 1) == 6e12
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        rank = MetricsProcessor.Config(cpu_peak_tflops=6.0, enable_tensorboard=False).build(
            dump_folder=str(tmp_path), device="cpu", num_flops_per_token=6e9, dp_degree=2, rank=0, clock=clock,
            processes_on_node=2)
    assert rank.peak_flops == 3e12
    rank.record_tokens(100)
    clock.now += 1.0
    assert rank.log(1, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(20.0, rel=1e-12)


def test_a_damaged_peak_cache_is_measured_again(peak_cache):
    cache, calls = peak_cache
    cache.mkdir()
    (cache / "cpu_peak.json").write_text("{not json")
    peak = device_peaks.cached_cpu_peak()
    assert (peak.tflops, peak.measured_now, len(calls)) == (6.0, True, 2)
    assert device_peaks.cached_cpu_peak().measured_now is False


def test_cpu_dense_dtypes_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert device_peaks.cpu_dense_dtypes({"avx2", "fma"}) == [torch.float32]
    assert device_peaks.cpu_dense_dtypes({"avx512f", "avx512_bf16"}) == [torch.float32, torch.bfloat16]
    assert device_peaks.cpu_dense_dtypes({"amx_bf16", "amx_fp16"}) == [torch.float32, torch.bfloat16, torch.float16]


def test_mfu_never_exceeds_100_percent_of_a_measured_cpu_peak(tmp_path, peak_cache, monkeypatch, caplog):
    # A peak measured while the host was busy is too low: the achieved rate then becomes the peak, also for
    # this machine's later runs (the cache keeps the higher figure).
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {"cpu": 1e-3})
    clock = FakeClock()
    processor = _build(tmp_path, clock, cpu_peak_tflops=None)
    processor.record_tokens(1000)
    clock.now += 1.0  # 1000 tok/s * 6e9 FLOPs = 6 TFLOP/s against a 0.001 TFLOP/s "peak"
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        values = processor.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert values["mfu"] == pytest.approx(100.0)
    assert "achieved 6 TFLOP/s exceeds the measured CPU peak 0.001 TFLOP/s" in caplog.text
    processor.record_tokens(500)
    clock.now += 1.0
    assert processor.log(2, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(50.0)
    monkeypatch.setattr(metrics, "_MEASURED_CPU_TFLOPS", {})
    assert _build(tmp_path, cpu_peak_tflops=None).peak_flops == pytest.approx(6e12)
    assert peak_cache[1] == []  # read from the cache, never measured


def test_console_line_shows_the_time_left(tmp_path, caplog):
    clock = FakeClock()
    processor = _build(tmp_path, clock)
    processor.begin(100, 400)  # resumed at step 100 of 400
    clock.now += 60.0  # the first step compiles: not part of the estimate
    processor.maybe_log(101, loss=1.0, grad_norm=1.0, lr=1.0)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        for step in range(102, 111):
            clock.now += 5.0  # 9 steps in 45 s after the first -> 290 steps left take 1450 s
            processor.maybe_log(step, loss=1.0, grad_norm=1.0, lr=1.0)
    assert caplog.text.rstrip().endswith("eta 24m10s")
    assert [metrics.format_duration(s) for s in (9.6, 65, 7260)] == ["10s", "1m05s", "2h01m"]


def test_the_first_step_compile_does_not_count_in_the_time_left(tmp_path, caplog):
    clock = FakeClock()
    processor = _build(tmp_path, clock)
    processor.begin(0, 200)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        clock.now += 73.0  # a cold compile
        processor.maybe_log(1, loss=1.0, grad_norm=1.0, lr=1.0)
        first_line = caplog.text
        for step in range(2, 11):
            clock.now += 1.0
            processor.maybe_log(step, loss=1.0, grad_norm=1.0, lr=1.0)
    assert "step      1" in first_line and "eta" not in first_line  # no steady step measured yet
    # 9 steps in 9 s after the first -> 190 steps left take 190 s (counting the compile: 82 s / 10 * 190 = 26 min).
    assert caplog.text.rstrip().endswith("eta 3m10s")


def test_unknown_device_peak_warns_and_omits_mfu(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        processor = MetricsProcessor.Config(enable_tensorboard=False).build(
            dump_folder=str(tmp_path), device="meta", num_flops_per_token=1.0, rank=0
        )
    assert "no known BF16 peak for meta: MFU is not reported" in caplog.text
    values = processor.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert "mfu" not in values and "tflops" in values


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("AMD Instinct MI300X", 1307.0),
        ("NVIDIA A10G", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_gpu_peak_table(name, tflops):
    expected = None if tflops is None else tflops * 1e12
    assert gpu_bf16_peak_flops(name) == expected


def test_device_peak_flops_has_no_cpu_entry():
    assert device_peaks.device_peak_flops("cpu") is None


def test_cpu_matmul_benchmark_times_the_fastest_matmul(monkeypatch):
    # Host load only slows matmuls down; the rate comes from the fastest, whatever the others took.
    # A fake clock makes this independent of the machine: the 512 x 512 matmul "takes" 0.1 s, except one 0.01 s.
    durations = iter([0.1, 0.1, 0.1] + [0.5, 0.01, 0.2, 0.3, 0.4] + [0.1] * 1000)
    now = [0.0]

    def fake_clock() -> float:
        return now[0]

    monkeypatch.setattr(device_peaks.time, "perf_counter", fake_clock)
    real_mm = torch.mm

    def timed_mm(a, b, out=None):
        now[0] += next(durations)
        return real_mm(a, b, out=out) if out is not None else real_mm(a, b)

    monkeypatch.setattr(device_peaks.torch, "mm", timed_mm)
    tflops = measure_cpu_matmul_tflops(torch.float32, budget_s=1.0)
    assert tflops == pytest.approx(2 * 512**3 / 0.01 / 1e12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"log_freq": 0}, r"metrics.log_freq must be >= 1, got 0"),
        ({"save_tb_folder": ""}, r"metrics.save_tb_folder must be a folder name"),
        ({"cpu_peak_tflops": 0.0}, r"metrics.cpu_peak_tflops must be > 0 or None"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MetricsProcessor.Config(**kwargs)


def test_tensorboard_disk_errors_skip_values_until_writing_works_again(tmp_path, caplog, monkeypatch):
    import errno

    from torch.utils.tensorboard import SummaryWriter

    processor = _build(tmp_path, enable_tensorboard=True)
    full = {"disk": False}
    real_add_scalar = SummaryWriter.add_scalar

    def add_scalar(self, *args, **kwargs):
        if full["disk"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add_scalar(self, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    with caplog.at_level(logging.INFO):
        processor.log(1, loss=4.0, grad_norm=1.0, lr=1e-3)
        full["disk"] = True  # a failed checkpoint filled the disk for a while
        values = processor.log(2, loss=3.0, grad_norm=1.0, lr=1e-3)
        processor.log(3, loss=2.5, grad_norm=1.0, lr=1e-3)
        full["disk"] = False  # its partial folder was removed
        processor.log(4, loss=2.0, grad_norm=1.0, lr=1e-3)
        processor.log_validation(4, 2.2)
    processor.close()
    assert values["loss"] == 3.0  # the run goes on
    assert caplog.text.count("TensorBoard writing to <dump_folder>/tb failed at step 2 ([Errno 28] No space left "
                             "on device); its values are skipped until writing works again") == 1
    assert "TensorBoard writing works again from step 4; steps 2-3 have no TensorBoard values" in caplog.text
    events = EventAccumulator(os.path.join(str(tmp_path), "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 4]
    assert [e.step for e in events.Scalars("val/loss")] == [4]
