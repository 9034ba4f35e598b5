"""Activation checkpointing changes neither the training nor what the monitor records.

A checkpointed region runs its forward again during backward. With ``torch.utils.checkpoint``
(reentrant and non-reentrant) and Hugging Face's ``gradient_checkpointing_enable()`` on a Llama
built from a small config, emulated FP8 with delayed scaling must give the same losses as the
run without checkpointing (the recompute replays the original scales and updates no amax
history, as Transformer Engine does), and the monitor must count every GEMM once per step: the
same (step, layer, tensor) rows with the same element counts and the same statistics.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fp8track import Monitor, apply_fp8
from fp8track.monitoring.records import RunReader
from fp8track.monitoring.run_meta import precision_setup

STEPS = 4
MODES = [None, False, True]  # no checkpointing, non-reentrant, reentrant


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 8)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = (
                block(x)
                if self.use_reentrant is None
                else checkpoint(block, x, use_reentrant=self.use_reentrant)
            )
        return self.head(x)


def _rows(run_dir) -> dict[tuple[int, str, str, str], dict[str, float]]:
    return {(r.step, r.layer, r.tensor, r.variant): r.stats for r in RunReader(run_dir).tensor_stats()}


def _history_entries(model: nn.Module) -> dict[str, int]:
    """Non-zero amax-history slots per delayed scaler: one per update that saw a nonzero tensor."""
    return {
        f"{name}/{kind}": int((scaler.amax_history != 0).sum())
        for name, m in model.named_modules()
        for kind, scaler in getattr(m, "delayed_scalers", {}).items()
    }


def _train_net(tmp_path, use_reentrant: bool | None, micro_batches: int):
    torch.manual_seed(0)
    net = Net(use_reentrant)
    apply_fp8(net, "delayed", backend="emulated")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = Monitor(net, {"every_n_steps": 2}, log_dir=tmp_path / f"net-{use_reentrant}").attach()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(micro_batches):
            # Reentrant checkpointing needs an input that requires grad to build any graph.
            x = torch.randn(16, 32, generator=g).requires_grad_(use_reentrant is True)
            loss = net(x).pow(2).mean()
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        mon.step(loss=total)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    mon.close()
    return losses, _rows(mon.run_dir), _history_entries(net)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_torch_checkpoint_changes_no_loss_and_no_count(tmp_path, micro_batches):
    plain, non_reentrant, reentrant = (_train_net(tmp_path, mode, micro_batches) for mode in MODES)
    losses, rows, history = plain
    # one delayed-scaling update per training forward: STEPS x micro-batches (slots hold nonzero amaxes)
    assert set(history.values()) == {STEPS * micro_batches}
    assert len(rows) == 2 * 7 * 3  # steps 0 and 2, 7 GEMM layers, 3 tensors each
    assert rows[(0, "blocks.0.up", "activation", "actual")]["numel"] == 16 * 32 * micro_batches
    for other in (non_reentrant, reentrant):
        assert other[0] == losses  # bit for bit: the recompute used the original scales
        assert other[2] == history
        assert other[1].keys() == rows.keys()
        for key, stats in rows.items():
            assert other[1][key]["numel"] == stats["numel"], key
            assert other[1][key] == pytest.approx(stats, rel=1e-6, abs=1e-12), key


def _llama(checkpointing: bool | None):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    apply_fp8(model, "delayed", backend="emulated")
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing_on_llama(tmp_path, use_reentrant):
    def run(checkpointing: bool | None):
        model = _llama(checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = Monitor(model, {"every_n_steps": 1}, log_dir=tmp_path / f"llama-{checkpointing}").attach()
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(STEPS):
            ids = torch.randint(0, 96, (2, 16), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            mon.step(loss=loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        mon.close()
        return losses, _rows(mon.run_dir), _history_entries(model), model

    losses, rows, history, model = run(None)
    ck_losses, ck_rows, ck_history, ck_model = run(use_reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read without the deprecated model property's warning
        assert precision_setup(ck_model)["activation_checkpointing"]
        assert not precision_setup(model)["activation_checkpointing"]
    gemm_layers = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {k[1] for k in rows} == gemm_layers  # 7 per decoder layer and lm_head
    assert len(gemm_layers) == 2 * 7 + 1
    assert ck_losses == losses
    assert ck_history == history and set(history.values()) == {STEPS}
    assert {k: v["numel"] for k, v in ck_rows.items()} == {k: v["numel"] for k, v in rows.items()}
    assert rows[(0, "model.layers.0.self_attn.q_proj", "activation", "actual")]["numel"] == 2 * 16 * 32
    for key, stats in rows.items():
        assert ck_rows[key] == pytest.approx(stats, rel=1e-6, abs=1e-12), key


@pytest.mark.slow
def test_compiled_model_with_checkpointing(tmp_path):
    # Unsampled steps run the checkpointed region inside the compiled graph; sampled steps break
    # out of it at the hooks and recompute eagerly, where the recompute is recognised.
    def run(compiled: bool):
        torch.manual_seed(0)
        net = Net(use_reentrant=False if compiled else None)
        apply_fp8(net, "current", backend="emulated")
        model = torch.compile(net, backend="aot_eager") if compiled else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        mon = Monitor(model, {"every_n_steps": 2}, log_dir=tmp_path / f"compiled-{compiled}").attach()
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
            loss.backward()
            mon.step(loss=loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        mon.close()
        rows = {
            (s, layer.replace("_orig_mod.", ""), t, v): st["numel"]
            for (s, layer, t, v), st in _rows(mon.run_dir).items()
        }
        return losses, rows

    losses, rows = run(False)
    ck_losses, ck_rows = run(True)
    assert ck_rows == rows and len(rows) == 3 * 7 * 3  # steps 0, 2, 4; 7 layers; 3 tensors
    assert ck_losses == pytest.approx(losses, rel=1e-5)
