"""Router and load-balance statistics of mixture-of-experts blocks, on sampled steps.

From the router's input ``h [T, H]`` and weight ``W [E, H]`` (bias included) the capture
recomputes the logits ``z = h W^T + b`` in float32 (one small GEMM, sampled steps only; the
router itself runs as the model wrote it) and measures, per block:

==================  =============================================================================
``logit_amax``      ``max |z|``
``logit_std``       standard deviation of all logits
``entropy``         mean over tokens of the entropy of ``softmax(z)`` (nats; ``log E`` is uniform)
``topk_margin``     mean over tokens of ``z_(k) - z_(k+1)``: the gap between the last chosen and the
                    first unchosen logit (k the block's top-k); near-ties flip under rounding
``flip_pct``        share of tokens whose top-k set from logits computed in the model's dtype
                    (``h`` and ``W`` as the model holds them) differs from the float32 one, in %
``load_cv``         coefficient of variation of the routed slots per expert (``std / mean``)
``load_max_over_mean``  the busiest expert's slots over the mean
``aux_loss``        the Switch Transformer load-balancing loss of the block (eqs. 4-6), as
                    ``transformers``' ``load_balancing_loss_func`` computes it for one layer:
                    ``E * sum_e f_e P_e`` with ``f_e`` the share of tokens routed to ``e`` (over the
                    k choices) and ``P_e`` the mean router probability of ``e``
``z_loss``          the router z-loss, ``mean(logsumexp(z)^2)``
``dropped_pct``     share of routed (token, expert) slots dropped over an expert's capacity, in %
                    (only for routers with an ``expert_capacity`` that return their dispatch mask,
                    as SwitchTransformers' ``Top1Router``: capacity counted per sequence)
==================  =============================================================================

The routed slots per expert are the experts' real routing (the grouped GEMM's group sizes, from
:class:`fp8track.monitoring.expert_capture.ExpertGroupCapture`) where the block has fused experts,
the router's own dispatch mask where it returns one (capacity drops included), else the top-k of
the recomputed logits. Every number is a sum or a max over tokens, so micro-batches
and data-parallel ranks combine in the monitor's one SUM and one MAX all-reduce.

Metric names: ``fp8/router/<block>/<stat>``; run level ``fp8/router/aux_loss`` and
``fp8/router/z_loss`` (means over blocks) and ``fp8/router/worst_load_cv`` (max over blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fp8track.execution.checkpointing import RecomputeFilter
from fp8track.execution.experts import MoEBlock
from fp8track.monitoring.naming import run_metric
from fp8track.monitoring.plans import RowlessCapture

ROUTER_STATS = (
    "logit_amax", "logit_std", "entropy", "topk_margin", "flip_pct", "load_cv", "load_max_over_mean",
    "aux_loss", "z_loss", "dropped_pct",
)
_SCALAR_SUMS = ("tokens", "entropy", "margin", "logit_sum", "logit_sq", "flips", "z2", "dropped")


class RouterCapture(RowlessCapture):
    """The statistics above for one MoE block (see the module docstring).

    Args:
        name: the block's canonical name (metric names use it).
        block: the block's structure.
        router: the router module (hooked) and the module holding its ``[E, H]`` weight.
        counts: returns the routed slots per expert this step from the block's expert capture
            (``None`` when it has none: the recomputed top-k counts instead).
    """

    def __init__(
        self, name: str, block: MoEBlock, router: nn.Module, gemm: nn.Module,
        counts: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(name)
        self.name = name
        self.num_experts = block.experts.num_experts
        self.top_k = max(
            1, min(block.experts.top_k or 1, self.num_experts - 1 if self.num_experts > 1 else 1)
        )
        self.router = router
        self.gemm = gemm
        self._counts = counts
        self._sums: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._recompute = RecomputeFilter()  # activation checkpointing's recomputes, per step
        self.count_flops = True  # False when the router's GEMM is a monitored layer of its own

    @property
    def n_sums(self) -> int:
        return len(_SCALAR_SUMS) + 2 * self.num_experts

    def attach(self) -> None:
        if self._handle is None:
            self._handle = self.router.register_forward_hook(self._hook)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.active = False

    def begin_step(self, sampled: bool) -> None:
        self.active = sampled
        self._recompute.reset()

    def _hook(self, module: nn.Module, args: tuple, output: object) -> None:
        if not (self.active and torch.is_grad_enabled()) or not args or not isinstance(args[0], torch.Tensor):
            return
        if self._recompute.is_recompute():  # of a forward already observed
            return
        self.observe(args[0], dispatch_mask(output, self.num_experts) if self.capacity else None)

    @property
    def capacity(self) -> int | None:
        """The router's ``expert_capacity`` (tokens per expert and sequence), if it has one."""
        cap = getattr(self.router, "expert_capacity", None)
        return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None

    @torch.no_grad()
    def observe(self, hidden: torch.Tensor, dispatch: torch.Tensor | None = None) -> None:
        """Add one forward's router input ``hidden [..., H]`` (and its dispatch mask
        ``[..., E]``, 1 where a token goes to an expert after capacity, when the router gives one)."""
        weight: torch.Tensor = self.gemm.weight  # type: ignore[assignment]
        bias: torch.Tensor | None = getattr(self.gemm, "bias", None)
        h = hidden.detach().reshape(-1, hidden.shape[-1])
        if self.count_flops:
            self.flops += 6 * h.shape[0] * int(weight.shape[0]) * int(weight.shape[1])
        z = F.linear(h.float(), weight.detach().float(), None if bias is None else bias.detach().float())
        z_model = F.linear(
            h, weight.detach().to(h.dtype), None if bias is None else bias.detach().to(h.dtype)
        )
        sums, zmax = router_sums(z, z_model.float(), self.top_k)
        k = _SCALAR_SUMS.index("dropped")
        if dispatch is None:
            sums[k] = math.nan  # no capacity: no dropped_pct (NaN survives the SUM all-reduce)
        else:
            kept = dispatch.reshape(-1, self.num_experts).to(torch.float64)
            sums[k] = h.shape[0] * self.top_k - kept.sum()
            sums[len(_SCALAR_SUMS) : len(_SCALAR_SUMS) + self.num_experts] = kept.sum(dim=0)
        self._sums = sums if self._sums is None else self._sums + sums
        self._max = zmax if self._max is None else torch.maximum(self._max, zmax)

    def take_sums(self, device: torch.device) -> torch.Tensor:
        """This step's sums ``[n_sums]`` (float64, zeros when nothing was seen), the expert counts
        replaced by the real routing where known; resets."""
        sums = self._sums if self._sums is not None else torch.zeros(self.n_sums, dtype=torch.float64)
        sums = sums.to(device)
        real = self._counts() if self._counts is not None else None
        if real is not None and self._sums is not None:
            sums = sums.clone()
            k = len(_SCALAR_SUMS)
            sums[k : k + self.num_experts] = real.to(device=device, dtype=torch.float64)
        self._sums = None
        return sums

    def take_max(self, device: torch.device) -> torch.Tensor:
        out = self._max if self._max is not None else torch.full((1,), -math.inf, dtype=torch.float64)
        self._max = None
        return out.to(device)



def router_sums(z: torch.Tensor, z_model: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums ``[8 + 2E]`` (float64: tokens, entropy, top-k margin, logit sum, logit square sum,
    flips, logsumexp squared, dropped slots (0 here); slots per expert; probability per expert)
    and ``[1]`` max |z| of
    float32 logits ``z [T, E]`` (``z_model``: the same logits in the model's dtype)."""
    t, e = z.shape
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(dim=-1)
    top = torch.topk(z, min(top_k + 1, e), dim=-1)
    margin = top.values[:, top_k - 1] - top.values[:, top_k] if e > top_k else torch.zeros(t, device=z.device)
    chosen = top.indices[:, :top_k]
    chosen_model = torch.topk(z_model, top_k, dim=-1).indices
    same = torch.sort(chosen, dim=-1).values == torch.sort(chosen_model, dim=-1).values
    flips = (~same.all(dim=-1)).sum()
    counts = torch.zeros(e, dtype=torch.float64, device=z.device)
    counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float64, device=z.device))
    lse = torch.logsumexp(z, dim=-1)
    scalars = torch.stack([
        torch.tensor(float(t), dtype=torch.float64, device=z.device),
        entropy.sum(dtype=torch.float64), margin.sum(dtype=torch.float64), z.sum(dtype=torch.float64),
        z.double().square().sum(), flips.to(torch.float64), lse.double().square().sum(),
        torch.zeros((), dtype=torch.float64, device=z.device),  # dropped slots: the capture fills it
    ])
    return torch.cat([scalars, counts, p.sum(dim=0, dtype=torch.float64)]), z.abs().amax().double().reshape(1)


def dispatch_mask(output: object, num_experts: int) -> torch.Tensor | None:
    """The dispatch mask a router returned (an integer or boolean ``[..., E]`` tensor first in its
    output tuple, SwitchTransformers' ``expert_index``), else ``None``."""
    first = output[0] if isinstance(output, tuple) and output else None
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and first.shape[-1] == num_experts:
        return first
    return None


def finalize_router(sums: Sequence[float], zmax: float, num_experts: int, top_k: int) -> dict[str, float]:
    """The statistics of :data:`ROUTER_STATS` from reduced sums (empty when no token was seen)."""
    k = len(_SCALAR_SUMS)
    v = dict(zip(_SCALAR_SUMS, sums[:k], strict=True))
    n = v["tokens"]
    if n <= 0:
        return {}
    counts = list(sums[k : k + num_experts])
    probs = list(sums[k + num_experts : k + 2 * num_experts])
    n_logits = n * num_experts
    mean_z = v["logit_sum"] / n_logits
    var_z = max(v["logit_sq"] / n_logits - mean_z * mean_z, 0.0)
    mean_c = sum(counts) / num_experts
    var_c = sum((c - mean_c) ** 2 for c in counts) / num_experts
    return {
        "logit_amax": zmax,
        "logit_std": math.sqrt(var_z),
        "entropy": v["entropy"] / n,
        "topk_margin": v["margin"] / n,
        "flip_pct": 100.0 * v["flips"] / n,
        "load_cv": math.sqrt(var_c) / mean_c if mean_c > 0 else 0.0,
        "load_max_over_mean": max(counts) / mean_c if mean_c > 0 else 0.0,
        "aux_loss": num_experts * sum((c / n) * (pe / n) for c, pe in zip(counts, probs, strict=True)),
        "z_loss": v["z2"] / n,
        **({} if math.isnan(v["dropped"]) else {"dropped_pct": 100.0 * v["dropped"] / (n * top_k)}),
    }


def router_metrics(per_block: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``fp8/router/<block>/<stat>`` and the run-level router metrics of one logging step."""
    out: dict[str, float] = {}
    for block, stats in per_block.items():
        for s, value in stats.items():
            out[run_metric("router", block, s)] = value
    live = [s for s in per_block.values() if s]
    if live:
        out[run_metric("router", "aux_loss")] = sum(s["aux_loss"] for s in live) / len(live)
        out[run_metric("router", "z_loss")] = sum(s["z_loss"] for s in live) / len(live)
        out[run_metric("router", "worst_load_cv")] = max(s["load_cv"] for s in live)
    return out
