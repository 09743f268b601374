"""The training loop: one readable step after another; features plug in around it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from titan_ckpt import Checkpointer, ModelState, OptimizerState
from titan_models import count_parameters, flops_per_token
from titan_parallel import clip_grad_norm_
from titan_train import build
from titan_train.config import JobConfig, config_to_dict
from titan_train.device_peaks import peak_flops
from titan_train.distributed import DistInfo
from titan_train.metrics import MetricsLogger, StepMetrics, device_memory
from titan_train.registry import get_model_spec
from titan_train.train_state import TrainState

logger = logging.getLogger(__name__)


class Trainer:
    """Builds every part of a job from its config, then trains: `Trainer(config, dist_info).train()`."""

    def __init__(self, config: JobConfig, info: DistInfo):
        self.config, self.info = config, info
        self.device = info.device
        seed = 0 if config.debug.seed is None else config.debug.seed
        torch.manual_seed(seed)
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True)

        self.dims = build.build_parallel_dims(config, info.world_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        dp_mesh = self.dims.submesh("dp")
        dp_rank, dp_degree = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh else (0, 1)
        self.grad_accum_steps = build.gradient_accumulation_steps(config, dp_degree)

        spec = get_model_spec(config.model.name)
        self.tokenizer = build.build_tokenizer_for(config)
        self.loader = build.build_loader(config, self.tokenizer, dp_rank, dp_degree)
        self.model = build.build_model(config, spec, self.tokenizer, self.dims, self.device, seed)
        self.loss_fn = spec.loss_fn
        self.optimizer = build.build_optimizer(config, self.model, self.device)
        self.lr_scheduler = build.build_lr_schedule(config, self.optimizer)
        self.state = TrainState()

        n_params = count_parameters(self.model)
        n_embedding = n_params - count_parameters(self.model, exclude_embedding=True)
        self.flops_per_token = flops_per_token(self.model.args, n_params, n_embedding, config.training.seq_len)
        self.peak_flops = peak_flops(self.device)
        logger.info(
            "model %s %s: %s parameters; %s on %s, world size %d, gradient accumulation %d",
            config.model.name, config.model.flavor, f"{n_params:,}", self.dims.degrees,
            self.device.type, info.world_size, self.grad_accum_steps,
        )  # fmt: skip

        dump = Path(config.job.dump_folder)
        if info.rank == 0:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / "config.json").write_text(json.dumps(config_to_dict(config), indent=2))
        self.checkpointer = None
        if config.checkpoint.enable:
            self.checkpointer = Checkpointer(
                dump / config.checkpoint.folder,
                {
                    "model": ModelState([self.model]),
                    "optimizer": OptimizerState([self.model], [self.optimizer]),
                    "lr_scheduler": self.lr_scheduler,
                    "dataloader": self.loader,
                    "train_state": self.state,
                },
                interval=config.checkpoint.interval,
                keep_latest_k=config.checkpoint.keep_latest_k,
            )
        m = config.metrics
        self.metrics = MetricsLogger(
            log_freq=m.log_freq,
            tb_folder=dump / m.save_tb_folder if m.enable_tensorboard else None,
            jsonl_path=dump / "metrics.jsonl",
            rank=info.rank,
            color=not m.disable_color_printing,
        )

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for inputs, labels in self.loader:
            yield inputs.to(self.device), labels.to(self.device)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, int, float]:
        """One optimizer step over `grad_accum_steps` micro-batches: (loss, grad norm, tokens, data seconds)."""
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        tokens, data_seconds = 0, 0.0
        for _ in range(self.grad_accum_steps):
            start = time.perf_counter()
            inputs, labels = next(batches)
            data_seconds += time.perf_counter() - start
            loss = self.loss_fn(self.model(inputs), labels) / self.grad_accum_steps
            loss.backward()
            loss_sum += loss.detach()
            tokens += labels.numel()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.training.max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss_sum, grad_norm, tokens, data_seconds

    def train(self) -> list[float]:
        """Train to `training.steps`, resuming from a checkpoint if there is one; return the logged losses."""
        if self.checkpointer is not None:
            self.checkpointer.load()
        batches = self._batches()
        losses: list[float] = []
        window_start, window_tokens, window_data = time.perf_counter(), 0, 0.0
        while self.state.step < self.config.training.steps:
            loss, grad_norm, tokens, data_seconds = self.train_step(batches)
            self.state.step += 1
            self.state.tokens_seen += tokens * self.dims.dp_degree
            window_tokens += tokens
            window_data += data_seconds
            if self.metrics.should_log(self.state.step):
                loss_avg, loss_max = _reduce_loss(loss)
                losses.append(loss_avg)
                elapsed = time.perf_counter() - window_start
                self._log(loss_avg, loss_max, grad_norm.item(), window_tokens / elapsed, 100 * window_data / elapsed)
                window_start, window_tokens, window_data = time.perf_counter(), 0, 0.0
            if self.checkpointer is not None:
                self.checkpointer.maybe_save(self.state.step, force=self.state.step == self.config.training.steps)
        self.metrics.close()
        logger.info("training done at step %d", self.state.step)
        return losses

    def _log(self, loss: float, loss_max: float, grad_norm: float, tps: float, data_pct: float) -> None:
        tflops = self.flops_per_token * tps / 1e12
        memory_gib, memory_pct = device_memory(self.device)
        self.metrics.log(
            StepMetrics(
                step=self.state.step,
                loss=loss,
                loss_max=loss_max,
                grad_norm=grad_norm,
                lr=self.lr_scheduler.get_last_lr()[0],
                tokens_seen=self.state.tokens_seen,
                tps=tps,
                tflops=tflops,
                mfu=100 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
                memory_gib=memory_gib,
                memory_pct=memory_pct,
                data_time_pct=data_pct,
            )
        )


def _reduce_loss(loss: torch.Tensor) -> tuple[float, float]:
    """Mean and max of the step loss over all ranks (ranks sharing a replica hold the same loss)."""
    pair = torch.stack([loss.detach().float(), loss.detach().float()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = pair[0].clone()
        dist.all_reduce(total)
        dist.all_reduce(pair[1:], op=dist.ReduceOp.MAX)
        return total.item() / dist.get_world_size(), pair[1].item()
    return pair[0].item(), pair[1].item()
