"""Run by tests/integration/test_sharded.py (and bench/sharded_overhead.py): CPU ranks on gloo.

Modes (``torchrun --standalone --nproc_per_node N sharded_monitor.py OUT MODE[,MODE...]``):

* ``fsdp``: FSDP2 (``fully_shard``) over a 1-D data-parallel mesh of all ranks;
* ``tp``: tensor parallelism on a ``(dp=1, tp=N)`` mesh: column-wise then row-wise linear;
* ``fsdp_fp8``: FSDP2 with torchao float8 (emulated GEMM) and FP8 all-gather of the weights;
* ``fsdp_tp``: both on a ``(dp=N/2, tp=2)`` mesh (FSDP2 over ``dp``, tensor parallel over ``tp``);
* ``lightning``: the same as ``fsdp_tp`` through Lightning's ``ModelParallelStrategy`` and
  ``FP8Monitor`` (run with plain ``python``, Lightning starts the other ranks; N = 2 or 4).

Besides the monitor's run directory, every rank saves ``rank<r>.pt``: the *global* tensors of each
sampled step (DTensors gathered with ``full_tensor()``), keyed ``(step, layer, tensor)``, plus the
global gradient norm and loss, so the test recomputes every statistic in one process. Needs tests/
on ``PYTHONPATH`` (its sizes come from ``helpers.dist_sizes``).
``--bench K [--width W]`` instead times K steps unmonitored, unsampled, sampled (global scales: the
two-phase amax) and sampled with local scales, on the model W times wider, and prints JSON on rank 0.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from helpers.dist_sizes import SHARDED_BATCH as BATCH
from helpers.dist_sizes import SHARDED_D_HID as D_HID
from helpers.dist_sizes import SHARDED_D_IN as D_IN
from helpers.dist_sizes import SHARDED_D_OUT as D_OUT
from helpers.dist_sizes import SHARDED_LAYERS as LAYERS
from helpers.dist_sizes import SHARDED_STEPS as STEPS


def batch(dp_rank: int, step: int, width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank ``dp_rank`` at ``step`` (tensor-parallel ranks share it)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(BATCH * width, D_IN * width, generator=g) * 3.0
    x[::3] *= 1e-4  # rows in the underflow range make the merged statistics non-trivial
    return x, torch.randn(BATCH * width, D_OUT * width, generator=g)


class Net(nn.Module):
    def __init__(self, width: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        w = width
        self.net = nn.Sequential(nn.Linear(D_IN * w, D_HID * w), nn.GELU(), nn.Linear(D_HID * w, D_OUT * w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def shard(model: nn.Module, mesh, mode: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mode == "fsdp_fp8":
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(
            model, config=dataclasses.replace(config, emulate=True)
        )  # CPU: emulated GEMM
    if mode in ("tp", "fsdp_tp"):
        parallelize_module(model.net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if mode in ("fsdp", "fsdp_tp", "fsdp_fp8"):
        fully_shard(model, mesh=mesh["dp"])


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    # A plain tensor copy: torchao's FP8 all-gather wraps weights in a subclass that clone() keeps.
    return torch.mul(full, 1.0).as_subclass(torch.Tensor) if type(full) is not torch.Tensor else full.clone()


class Reference:
    """Hooks that gather the global tensors the monitor judges (a collective per tensor: test only)."""

    def __init__(self, model: nn.Module) -> None:
        self.saved: dict = {}
        self.step = 0
        for name in LAYERS:
            model.get_submodule(name).register_forward_hook(self._hook(name), prepend=True)

    def _hook(self, name: str):
        def hook(module, args, out):
            if not torch.is_grad_enabled():
                return
            self.saved[(self.step, name, "activation")] = _full(args[0])
            step = self.step
            out.register_hook(lambda g: self.saved.__setitem__((step, name, "gradient"), _full(g)))

        return hook

    def begin_step(self, model: nn.Module) -> None:
        """The high-precision weights, gathered between steps (in the forward they may be FP8)."""
        for name in LAYERS:
            self.saved[(self.step, name, "weight")] = _full(model.get_submodule(name).weight)

    def end_step(self, model: nn.Module, loss: torch.Tensor) -> None:
        grads = [_full(p.grad) for p in model.parameters()]
        self.saved[(self.step, "grad_norm")] = torch.linalg.vector_norm(
            torch.stack([g.norm() for g in grads])
        )
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        self.saved[(self.step, "loss")] = mean_loss / dist.get_world_size()
        self.step += 1


def make_mesh(mode: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    tp = world if mode == "tp" else 2
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def train(out: str, modes: str) -> None:
    """Each mode of the comma-separated ``modes`` in turn (one process start for all), into ``OUT/<mode>``."""
    dist.init_process_group("gloo")
    for mode in modes.split(","):
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        train_one(os.path.join(out, mode), mode)
        dist.barrier()
    dist.destroy_process_group()


def train_one(out: str, mode: str) -> None:
    from fp8track import Monitor, MonitorConfig
    from fp8track.monitoring.sharding import ShardSpec

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(mode, world)
    dp_rank = mesh["dp"].get_local_rank()
    model = Net()
    shard(model, mesh, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = Monitor(
        model, MonitorConfig(every_n_steps=1), log_dir=out, sharding=ShardSpec(mesh, data_dims=("dp",))
    ).attach()
    ref = Reference(model)
    for step in range(STEPS):
        x, y = batch(dp_rank, step)
        ref.begin_step(model)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        ref.end_step(model, loss)
        opt.step()
        monitor.step(loss=loss)
        opt.zero_grad()
    monitor.close()
    torch.save({"saved": ref.saved, "dp_rank": dp_rank}, os.path.join(out, f"rank{rank}.pt"))


def bench(out: str, mode: str, steps: int, width: int) -> None:
    """Median wall time of a training step: unsampled, sampled (two-phase amax), sampled with local scales."""
    from fp8track import Monitor, MonitorConfig
    from fp8track.monitoring.sharding import ShardSpec

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = make_mesh(mode, world)
    dp_rank = mesh["dp"].get_local_rank()
    model = Net(width)
    shard(model, mesh, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    shapes = [tuple(model.get_submodule(n).weight.shape) for n in LAYERS]
    result: dict = {"mode": mode, "world": world, "steps": steps, "weights": shapes, "batch": BATCH * width}
    variants = [
        ("none", None, None),
        ("unsampled", MonitorConfig(every_n_steps=10**9, steps=()), "global"),
        ("sampled_global_scale", MonitorConfig(every_n_steps=1), "global"),
        ("sampled_local_scale", MonitorConfig(every_n_steps=1), "local"),
    ]
    for label, cfg, scale in variants:
        monitor = None
        if cfg is not None:
            spec = ShardSpec(mesh, data_dims=("dp",), scale=scale)
            monitor = Monitor(model, cfg, log_dir=out, sharding=spec, analyzers=[]).attach()
            if label == "unsampled":
                monitor.begin_step(1)  # step 0 is always sampled: start at step 1
        times = []
        for step in range(steps + 3):
            x, y = batch(dp_rank, step, width)
            dist.barrier()
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if monitor is not None:
                monitor.step(loss=loss)
            opt.zero_grad()
            dist.barrier()
            if step >= 3:  # warm-up: compilation, first collectives
                times.append(time.perf_counter() - t0)
        if monitor is not None:
            monitor.close()
        result[f"{label}_ms"] = 1e3 * sorted(times)[len(times) // 2]
    result["extra_ms_per_sampled_step"] = result["sampled_global_scale_ms"] - result["unsampled_ms"]
    result["two_phase_amax_ms"] = result["sampled_global_scale_ms"] - result["sampled_local_scale_ms"]
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def lightning(out: str, world: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, Dataset

    from fp8track.lightning import FP8Monitor

    class Batches(Dataset):
        """Data-parallel rank d gets batch(d, step) at each step (Lightning's sampler splits by dp)."""

        def __init__(self, dp: int) -> None:
            self.items = [batch(d, s) for s in range(STEPS) for d in range(dp)]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int):
            return self.items[i]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()
            self.ref: Reference | None = None

        def configure_model(self) -> None:
            mesh = self.device_mesh
            shard(self.model, {"tp": mesh["tensor_parallel"], "dp": mesh["data_parallel"]}, "fsdp_tp")
            self.ref = Reference(self.model)

        def training_step(self, b, i):
            x, y = b
            if self.ref is not None:
                self.ref.begin_step(self.model)
            self.last_loss = nn.functional.mse_loss(self.model(x[0]), y[0])
            return self.last_loss

        def on_before_optimizer_step(self, optimizer) -> None:
            if self.ref is not None:
                self.ref.end_step(self.model, self.last_loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    dp = world // 2
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
        callbacks=[FP8Monitor(every_n_steps=1, log_dir=out, trackers="none")],
        default_root_dir=out,
    )
    module = Module()
    trainer.fit(module, DataLoader(Batches(dp), batch_size=1, shuffle=False))
    dp_rank = module.device_mesh["data_parallel"].get_local_rank()
    torch.save(
        {"saved": module.ref.saved if module.ref else {}, "dp_rank": dp_rank},
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, run_mode = sys.argv[1], sys.argv[2]
    if run_mode == "lightning":
        lightning(out_dir, int(sys.argv[3]))
    elif "--bench" in sys.argv:
        width = int(sys.argv[sys.argv.index("--width") + 1]) if "--width" in sys.argv else 1
        bench(out_dir, run_mode, int(sys.argv[sys.argv.index("--bench") + 1]), width)
    else:
        train(out_dir, run_mode)
