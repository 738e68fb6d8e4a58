"""Training metrics: one console line and TensorBoard (optionally also Weights & Biases) scalars every
``log_freq`` steps.

Per logged step: loss, lr, grad norm, tokens/s per device (and for the whole job on the console),
achieved TFLOP/s per device, MFU against the device's dense BF16 peak (``device_peaks``), and peak
memory since the previous log (CUDA: max allocated, with max reserved on the console; CPU: the
process's peak resident set size, which never goes down). Throughput is averaged over the steps
since the previous log; time spent inside ``exclude_from_throughput()`` (validation, checkpoints)
is not counted.

TensorBoard tags: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_second``,
``train/tflops``, ``train/mfu`` (percent; omitted when the peak is unknown), ``train/memory_gib``,
``train/<key>`` for each extra value, and ``val/loss``; other components add their own tags through
``log_scalars`` (the loss-spike policy's ``spike/skipped_steps``, ``spike/rollbacks``, ``spike/z_score``).
The model's own statistics (MoE router balance: ``moe/<layer>/imbalance`` ..., see
models/common/moe/router_stats.py) come with each log as full tags and a short summary for the console line.
With ``fp8_stats_freq``, every FP8 / MX Linear's health on those steps goes to ``fp8/<layer fqn>/<stat>``
(components/quantization/fp8_stats.py), with the worst layers on the console and a warning naming each
layer whose cast crosses a threshold.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_lite.components import device_peaks
from torchtitan_lite.components.tensorboard_writer import FirstWriteSummaryWriter
from torchtitan_lite.config import Configurable
from torchtitan_lite.mesh import process_groups as dist_utils

logger = logging.getLogger("torchtitan_lite")

GIB = 1024**3

# One measurement per process: every MetricsProcessor built afterwards reuses it.
_MEASURED_CPU_TFLOPS: dict[str, float] = {}

_COLORS = {"step": "\033[31m", "loss": "\033[36m", "memory": "\033[33m", "throughput": "\033[34m",
           "mfu": "\033[35m", "reset": "\033[0m"}
_PLAIN = {key: "" for key in _COLORS}


class MetricsProcessor(Configurable):
    """Turns per-step numbers into throughput, MFU and memory figures on console and TensorBoard."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        log_freq: int = 10
        """Log every this many steps (and at step 1 and the last step)."""
        enable_tensorboard: bool = True
        """Write TensorBoard scalars to <dump_folder>/<save_tb_folder>."""
        save_tb_folder: str = "tb"
        """TensorBoard folder under the dump folder."""
        rank_0_only: bool = True
        """Only rank 0 writes TensorBoard; otherwise every rank writes to <save_tb_folder>/rank_<r>.
        The console line is printed by rank 0 either way."""
        enable_color: bool | None = None
        """Color the console line; None colors when stdout is a terminal."""
        enable_wandb: bool = False
        """Also log the same scalars to Weights & Biases (pip install -e .[wandb]); files go to
        <dump_folder>/wandb, and WANDB_MODE=offline keeps them local."""
        wandb_project: str = "torchtitan_lite"
        """Weights & Biases project of the run (with enable_wandb)."""
        fp8_stats_freq: int = 0
        """Every this many steps (0 = off), measure every FP8 / MX Linear on the step's first micro-batch: amax
        of input / weight / output gradient, the share of elements each cast saturates and flushes to zero,
        and the output SQNR against high precision. TensorBoard fp8/<layer>/<stat>, the worst layers on the
        console. Costs an eager forward + backward with the measurement on those steps, nothing on others."""
        fp8_saturation_warn: float = 1e-4
        """Warn naming the layer when a cast saturates more than this share of its elements (once per layer and
        cast, again when the share doubles). Dynamic amax scaling saturates nothing (MX with floor-rounded
        scales: a few per mille); see docs/mixed_precision.md."""
        fp8_underflow_warn: float = 1e-2
        """Warn naming the layer when a cast flushes more than this share of its elements (nonzero ones) to zero
        (once per layer and cast, again when the share doubles). A Gaussian tensor loses ~1e-5, the debug
        model's SwiGLU outputs up to ~5e-3; see docs/mixed_precision.md."""
        cpu_peak_tflops: float | None = None
        """Peak TFLOP/s of the whole CPU machine for MFU (its processes share it); None measures it on all cores
        once per machine (~0.5 s per dtype) and keeps it in $TORCHTITAN_LITE_CACHE/cpu_peak.json (default
        ~/.cache/torchtitan_lite), keyed by CPU model, flags, torch version and cores: the best matmul rate of
        the fastest dtype the CPU runs natively (float32; bfloat16 with AVX512-BF16/AMX)."""
        remeasure_cpu_peak: bool = False
        """Measure the CPU peak again (and replace the cached one) instead of reading it from the cache."""

        def __post_init__(self) -> None:
            if self.log_freq < 1:
                raise ValueError(f"metrics.log_freq must be >= 1, got {self.log_freq}")
            if not self.save_tb_folder:
                raise ValueError("metrics.save_tb_folder must be a folder name, got an empty string; the default is 'tb'")
            if self.enable_wandb and importlib.util.find_spec("wandb") is None:
                raise ValueError("metrics.enable_wandb=True needs the wandb package, which is not installed: "
                                 "pip install -e .[wandb] (or pip install wandb), or leave metrics.enable_wandb off")
            if self.fp8_stats_freq < 0:
                raise ValueError(f"metrics.fp8_stats_freq must be >= 0 (0 turns FP8 stats off), got {self.fp8_stats_freq}")
            for name in ("fp8_saturation_warn", "fp8_underflow_warn"):
                if not 0.0 <= getattr(self, name) <= 1.0:
                    raise ValueError(f"metrics.{name} is a share of elements between 0 and 1, got {getattr(self, name)}")
            if self.cpu_peak_tflops is not None and not self.cpu_peak_tflops > 0:
                raise ValueError(
                    f"metrics.cpu_peak_tflops must be > 0 or None (measure it), got {self.cpu_peak_tflops}"
                )

    config: MetricsProcessor.Config

    def __init__(
        self,
        config: MetricsProcessor.Config,
        *,
        dump_folder: str,
        device: torch.device | str,
        num_flops_per_token: float,
        attention_flops_per_token: float = 0.0,
        dp_degree: int = 1,
        tp_degree: int = 1,
        rank: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        processes_on_node: int | None = None,
    ) -> None:
        """
        Args:
            num_flops_per_token: training FLOPs (forward + backward) per token of the model.
            attention_flops_per_token: the part of it the attention over all earlier tokens of the window takes;
                scaled by the share of those pairs a document mask attends (``record_tokens``).
            dp_degree: data-parallel ranks; each sees different tokens (global tokens/s).
            tp_degree: ranks that compute on the same tokens (tensor parallel); per-device tokens/s
                divides by it.
            rank: this process's rank (default: from the process group).
            clock: seconds as a float; a fake clock makes throughput deterministic in tests.
            processes_on_node: CPU processes sharing this machine's cores, and so its peak (default:
                torchrun's LOCAL_WORLD_SIZE, 1 without it).
        """
        self.config = config
        self.device = torch.device(device)
        self.num_flops_per_token = num_flops_per_token
        self.attention_flops_per_token = attention_flops_per_token
        self.dp_degree = dp_degree
        self.tp_degree = tp_degree
        self.rank = dist_utils.rank() if rank is None else rank
        self.clock = clock
        self.processes_on_node = (int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if processes_on_node is None
                                  else processes_on_node)
        self.console = self.rank == 0
        self.writer = self._build_writer(dump_folder)
        self._tb_failed_since: int | None = None
        """First step whose TensorBoard values could not be written, while writing fails; None when it works."""
        self.wandb_run = self._build_wandb(dump_folder)
        self.peak_flops = self._peak_flops() if (self.console or self.writer or self.wandb_run) else None
        color = sys.stdout.isatty() if config.enable_color is None else config.enable_color
        self.colors = _COLORS if color else _PLAIN
        self._tokens = 0
        self._unattended_tokens = 0.0
        self._excluded_s = 0.0
        self._interval_start = clock()
        self._eta_origin: tuple[int, float] | None = None
        """(step, time) the ETA counts from: the end of the first step after ``begin``."""
        self._eta_first_step: int | None = None
        self._fp8_warned: dict[tuple[str, str, str], float] = {}
        self._total_steps: int | None = None

    # ----------------------------------------------------------------------------------------------
    # Construction

    def _build_writer(self, dump_folder: str) -> Any:
        cfg = self.config
        if not cfg.enable_tensorboard or (cfg.rank_0_only and self.rank != 0):
            return None
        folder = os.path.join(dump_folder, cfg.save_tb_folder)
        if not cfg.rank_0_only:
            folder = os.path.join(folder, f"rank_{self.rank}")
        logger.info("TensorBoard scalars go to %s", folder)
        return FirstWriteSummaryWriter(folder)

    def _tensorboard_failed(self, error: OSError, step: int) -> None:
        # A full or read-only disk must not end the run here, before it could resume or save; and a disk
        # that was full for a moment (a failed checkpoint's partial folder, since removed) must not cost
        # the rest of the run's values: each log step tries again.
        if self._tb_failed_since is None:
            self._tb_failed_since = step
            logger.warning("TensorBoard writing to %s failed at step %s (%s); its values are skipped until "
                           "writing works again", os.path.join("<dump_folder>", self.config.save_tb_folder),
                           step, error)

    def _tensorboard_works(self, step: int) -> None:
        if self._tb_failed_since is not None:
            logger.info("TensorBoard writing works again from step %s; steps %s-%s have no TensorBoard values",
                        step, self._tb_failed_since, step - 1)
            self._tb_failed_since = None

    def _build_wandb(self, dump_folder: str) -> Any:
        cfg = self.config
        if not cfg.enable_wandb or self.rank != 0:
            return None
        import wandb

        folder = os.path.join(dump_folder, "wandb")
        os.makedirs(folder, exist_ok=True)
        run = wandb.init(project=cfg.wandb_project, dir=folder)
        logger.info("Weights & Biases run %s logs to %s", run.name, folder)
        return run

    def _write_scalars(self, values: dict[str, float], step: int) -> None:
        """The same tags and values to TensorBoard and Weights & Biases (whichever are on)."""
        if self.writer is not None:
            try:
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
                self.writer.flush()
            except OSError as e:
                self._tensorboard_failed(e, step)
            else:
                self._tensorboard_works(step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def _peak_flops(self) -> float | None:
        if self.device.type == "cpu":
            # MFU against the machine's peak (all its cores), whatever threads the run uses: this process's
            # share of it, since the node's processes share the cores.
            if self.config.cpu_peak_tflops is not None:
                return device_peaks.process_share_flops(self.config.cpu_peak_tflops * 1e12, self.processes_on_node)
            if "cpu" not in _MEASURED_CPU_TFLOPS:
                cpu = device_peaks.cached_cpu_peak(remeasure=self.config.remeasure_cpu_peak)
                _MEASURED_CPU_TFLOPS["cpu"] = cpu.tflops
                if cpu.measured_now:
                    logger.info("CPU peak for MFU measured with a %s matmul benchmark (the fastest dtype this CPU "
                                "runs): %.4g TFLOP/s, kept for this machine's later runs in %s (set "
                                "metrics.cpu_peak_tflops to fix it)", cpu.dtype, cpu.tflops, cpu.path)
                else:
                    logger.info("CPU peak for MFU: %.4g TFLOP/s (%s), measured once on this machine and read from "
                                "%s; --metrics.remeasure_cpu_peak true measures it again", cpu.tflops, cpu.dtype,
                                cpu.path)
                logger.info("MFU is against that peak of all %d cores (the whole machine); this run computes on %d "
                            "thread(s) in each of %d process(es)", device_peaks.machine_cores(),
                            torch.get_num_threads(), self.processes_on_node)
            return device_peaks.process_share_flops(_MEASURED_CPU_TFLOPS["cpu"] * 1e12, self.processes_on_node)
        peak = device_peaks.device_peak_flops(self.device)
        if peak is None:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
            logger.warning(
                "no known BF16 peak for %s: MFU is not reported (TFLOP/s is); add the device to "
                "torchtitan_lite/components/device_peaks.py", name,
            )
        return peak

    # ----------------------------------------------------------------------------------------------
    # What the loop calls

    def record_tokens(self, n_tokens: int, *, attention_share: float = 1.0) -> None:
        """Count input tokens this rank processed (call once per micro-batch), and the share of the causal
        window's attention pairs their attention computed (document masking attends fewer)."""
        self._tokens += n_tokens
        self._unattended_tokens += n_tokens * (1.0 - attention_share)

    @contextlib.contextmanager
    def exclude_from_throughput(self) -> Iterator[None]:
        """Time spent inside (validation, checkpoint saves) does not count against tokens/s."""
        start = self.clock()
        try:
            yield
        finally:
            self._excluded_s += self.clock() - start

    def begin(self, step: int, total_steps: int) -> None:
        """Training goes from after ``step`` to ``total_steps``: each console line after the first step then
        shows the time left at the average wall time per step since the first step ended (validation and
        checkpoints included). The first step is not counted: it pays compilation and warm-up, which can
        take longer than the rest of a short run and would inflate the estimate by that much per step."""
        self._eta_origin = None
        self._eta_first_step = step + 1
        self._total_steps = total_steps

    def _eta_seconds(self, step: int, now: float) -> float | None:
        if self._eta_origin is None or self._total_steps is None or step <= self._eta_origin[0]:
            return None
        origin_step, origin_time = self._eta_origin
        return (now - origin_time) / (step - origin_step) * max(self._total_steps - step, 0)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.config.log_freq == 0

    def maybe_log(
        self, step: int, *, loss: float, grad_norm: float, lr: float,
        extra: dict[str, float] | None = None, force: bool = False,
    ) -> dict[str, float] | None:
        """``log`` on logging steps (step 1, every log_freq steps) or when forced (the last step)."""
        logged = self.log(step, loss=loss, grad_norm=grad_norm, lr=lr, extra=extra) \
            if force or self.should_log(step) else None
        if self._eta_origin is None and self._eta_first_step is not None and step >= self._eta_first_step:
            self._eta_origin = (step, self.clock())
        return logged

    def log(
        self, step: int, *, loss: float, grad_norm: float, lr: float, extra: dict[str, float] | None = None,
        scalars: dict[str, float] | None = None, summary: str | None = None,
    ) -> dict[str, float]:
        """Log one step's numbers with the throughput since the previous log; returns what was computed.
        ``scalars`` (full tags, e.g. ``moe/imbalance_max``) are written as they are; ``summary`` ends the
        console line.

        Every rank must call it on the same steps (it resets the throughput window and CUDA peak
        memory stats); only rank 0 prints and, unless rank_0_only=False, writes TensorBoard.
        """
        now = self.clock()
        elapsed = max(now - self._interval_start - self._excluded_s, 1e-9)
        tokens_per_s = self._tokens / elapsed / self.tp_degree
        # The attention the mask skipped is not counted (nothing is subtracted under the causal mask).
        flops = tokens_per_s * self.num_flops_per_token \
            - self._unattended_tokens / elapsed / self.tp_degree * self.attention_flops_per_token
        memory, reserved = self._peak_memory_gib()
        values = {
            "loss": float(loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "tokens_per_second": tokens_per_s,
            "tflops": flops / 1e12,
            "memory_gib": memory,
        }
        if self.peak_flops is not None:
            if flops > self.peak_flops and self.device.type == "cpu" and self.config.cpu_peak_tflops is None:
                # The peak measurement was slowed down (a busy host): what the run achieves is a lower bound.
                logger.warning("achieved %.4g TFLOP/s exceeds the measured CPU peak %.4g TFLOP/s (the host was busy "
                               "while it was measured); the achieved rate is the peak from now on; set "
                               "metrics.cpu_peak_tflops for a fixed one", flops / 1e12, self.peak_flops / 1e12)
                self.peak_flops = flops
                machine_tflops = flops * self.processes_on_node / 1e12
                device_peaks.raise_cached_cpu_peak(machine_tflops)
            values["mfu"] = 100.0 * flops / self.peak_flops
        for key, value in (extra or {}).items():
            if key in values:
                raise ValueError(f"extra metric {key!r} clashes with a built-in train/{key} metric; rename it")
            values[key] = float(value)

        self._write_scalars({f"train/{key}": value for key, value in values.items()} | (scalars or {}), step)
        if self.console:
            global_tokens_per_s = self._tokens * self.dp_degree / elapsed
            line = self._console_line(step, values, global_tokens_per_s, reserved, extra or {},
                                      self._eta_seconds(step, now))
            logger.info(f"{line}  {summary}" if summary else line)

        self._tokens = 0
        self._unattended_tokens = 0.0
        self._excluded_s = 0.0
        self._interval_start = now
        return values

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        """Write ``values`` (full tags, e.g. ``spike/rollbacks``) at ``step`` to TensorBoard / W&B as they are."""
        self._write_scalars(values, step)

    def log_fp8_stats(self, step: int, health: list[Any]) -> None:
        """Write one stats step's ``LayerHealth`` list (already reduced over ranks): every scalar to TensorBoard /
        W&B, the worst layers to the console, and a warning per layer and cast over a threshold (rank 0)."""
        from torchtitan_lite.components.quantization.fp8_stats_report import summary_line, threshold_crossings

        values: dict[str, float] = {}
        for layer in health:
            values |= layer.scalars()
        self._write_scalars(values, step)
        if not self.console:
            return
        logger.info(summary_line(step, health))
        cfg = self.config
        for crossing in threshold_crossings(step, health, saturation=cfg.fp8_saturation_warn,
                                            underflow=cfg.fp8_underflow_warn):
            # Once per layer and cast, and again each time the share has doubled: a steady share that is
            # over the threshold stays on the console summary instead of repeating every stats step.
            last = self._fp8_warned.get(crossing.key)
            if last is not None and crossing.share < 2 * last:
                continue
            self._fp8_warned[crossing.key] = crossing.share
            since = "" if last is None else f"; up from {100 * last:.3g}% when last reported"
            logger.warning(crossing.message + since)

    def log_validation(self, step: int, loss: float, by_source: dict[str, float] | None = None) -> None:
        """``val/loss``, and ``val/loss/<source>`` for each source of a mixture (``by_source``)."""
        by_source = by_source or {}
        self._write_scalars({"val/loss": float(loss)} | {f"val/loss/{n}": float(v) for n, v in by_source.items()},
                            step)
        if self.console:
            c = self.colors
            sources = f" ({', '.join(f'{n} {v:.4f}' for n, v in by_source.items())})" if by_source else ""
            logger.info(f"{c['step']}step {step:>6}{c['reset']}  {c['loss']}validation loss {loss:8.4f}{c['reset']}"
                        f"{sources}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    # ----------------------------------------------------------------------------------------------

    def _peak_memory_gib(self) -> tuple[float, float | None]:
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(self.device) / GIB
            reserved = torch.cuda.max_memory_reserved(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
            return allocated, reserved
        # ru_maxrss is KiB on Linux and bytes on macOS.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return rss / GIB, None

    def _console_line(
        self, step: int, values: dict[str, float], global_tokens_per_s: float, reserved: float | None,
        extra: dict[str, float], eta_s: float | None = None,
    ) -> str:
        c = self.colors
        memory = f"memory {values['memory_gib']:.2f}GiB"
        if reserved is not None:
            memory += f" (reserved {reserved:.2f}GiB)"
        parts = [
            f"{c['step']}step {step:>6}{c['reset']}",
            f"{c['loss']}loss {values['loss']:8.4f}{c['reset']}",
            f"grad_norm {values['grad_norm']:7.4f}",
            f"lr {values['lr']:.3e}",
            f"{c['memory']}{memory}{c['reset']}",
            f"{c['throughput']}tok/s {values['tokens_per_second']:,.0f} (global {global_tokens_per_s:,.0f})"
            f"  tflops {values['tflops']:.3g}{c['reset']}",
        ]
        if "mfu" in values:
            parts.append(f"{c['mfu']}mfu {values['mfu']:.2f}%{c['reset']}")
        parts += [f"{key} {value:.4g}" for key, value in extra.items()]
        if eta_s is not None:
            parts.append(f"eta {format_duration(eta_s)}")
        return "  ".join(parts)


def format_duration(seconds: float) -> str:
    """'45s', '3m05s', '2h07m': the time left on a console line."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
