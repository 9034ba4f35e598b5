"""Which captures a model's mixture-of-experts blocks add to a monitor's selection: for each block
holding a selected layer, its expert group's per-expert rows (:class:`ExpertGroupCapture`) and its
router's metrics (:class:`RouterCapture`), and which selected layers the plain layer captures must
then leave out. :mod:`fp8track.monitoring.selection` calls :func:`moe_captures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fp8track.execution.backends import backend_of
from fp8track.execution.experts import find_moe, unrecognised_experts
from fp8track.monitoring.expert_capture import ExpertGroupCapture, ExpertRowCapture
from fp8track.monitoring.module_flops import ModuleFlopsCapture
from fp8track.monitoring.router_capture import RouterCapture


class MoECaptures:
    """What the monitor adds for a model's MoE blocks (:func:`moe_captures`).

    Attributes:
        captures: ``{record name: capture}``: every expert row, one router capture per block, and
            a FLOP count of each experts module fp8track does not recognise (DBRX, JetMoE).
        skip: canonical names of selected layers the layer captures must leave out (expert modules,
            whose rows come from here; router subclasses returning tuples, measured by the router
            capture).
        token_layers: canonical names of selected linears of module-list experts (their layer
            captures count the expert's tokens: ``LayerCapture.count_tokens``).
    """

    def __init__(self) -> None:
        self.captures: dict[str, ExpertRowCapture | RouterCapture | ModuleFlopsCapture] = {}
        self.skip: set[str] = set()
        self.token_layers: set[str] = set()


def moe_captures(
    model: nn.Module, chosen: Sequence[tuple[str, nn.Module]], tensors: Sequence[str], shadow_format: str
) -> MoECaptures:
    """Expert-row and router captures for the MoE blocks of ``model`` holding any of the selected
    layers ``chosen`` (``(canonical name, module)``): a block with none is left alone, so its router
    has no metrics and no FLOPs in the share of what the monitor observes."""
    out = MoECaptures()
    by_module = {id(m): name for name, m in chosen}
    moe = find_moe(model)
    prefix_of = {fqn: _canonical_prefix(by_module, model, fqn) for fqn in (b.fqn for b in moe.blocks)}
    for block in moe.blocks:
        if not any(id(m) in by_module for m in model.get_submodule(block.fqn).modules()):
            continue  # nothing of this block selected (``layers=``): no router capture, no FLOPs
        experts = model.get_submodule(block.experts.fqn)
        group_capture = None
        name = by_module.get(id(experts))
        if name is not None and block.experts.kind in ("fused", "dense", "torchao"):
            group_capture = ExpertGroupCapture(name, experts, block.experts, tensors, shadow_format)
            out.captures.update(group_capture.rows)
            out.skip.add(name)
        if block.experts.kind == "module_list":
            out.token_layers.update(by_module[id(m)] for m in experts.modules() if id(m) in by_module)
        if block.router is None or block.router_gemm is None:
            continue
        router, gemm = model.get_submodule(block.router), model.get_submodule(block.router_gemm)
        gemm_name = by_module.get(id(gemm))
        if gemm_name is not None and type(gemm) is not nn.Linear and backend_of(gemm) is None:
            # an nn.Linear subclass returning a tuple (PhiMoE, Llama 4); a router linear an FP8
            # backend converted (apply_fp8(..., fp8_routers=True)) is an FP8 layer like any other
            out.skip.add(gemm_name)
            gemm_name = None
        block_name = prefix_of[block.fqn]
        # Real routing from the fused group's GEMM sizes (a dense group runs every expert on every
        # token: its routing is the router's own top-k then).
        counts = (
            group_capture.take_counts
            if group_capture is not None and block.experts.kind in ("fused", "torchao")
            else None
        )
        cap = RouterCapture(block_name, block, router, gemm, counts)
        cap.count_flops = gemm_name is None
        key = _free_key(
            out.captures, by_module.get(id(router)) or f"{block_name}.{block.router.rsplit('.', 1)[-1]}"
        )
        out.captures[key] = cap
    for fqn in unrecognised_experts(model, moe):
        stack_block, rest = _stack_block(fqn)
        holder = model.get_submodule(stack_block)
        if any(id(m) in by_module for m in holder.modules()):  # its block has a selected layer
            key = f"{_canonical_prefix(by_module, model, stack_block)}.{rest}" if stack_block else fqn
            out.captures[key] = ModuleFlopsCapture(key, model.get_submodule(fqn))
    return out


def _stack_block(fqn: str) -> tuple[str, str]:
    """``fqn`` split into the block of the model's layer stack holding it (up to its last numeric
    name component: ``transformer.blocks.3``) and the rest; ``("", fqn)`` outside any stack."""
    parts = fqn.split(".")
    last = max((i for i, p in enumerate(parts[:-1]) if p.isdigit()), default=-1)
    return ".".join(parts[: last + 1]), ".".join(parts[last + 1:])


def _canonical_prefix(by_module: dict[int, str], model: nn.Module, fqn: str) -> str:
    """The canonical name of the block at ``fqn``: derived from a selected layer inside it (the
    canonical names drop wrappers and a LightningModule's holder), else ``fqn`` itself."""
    block = model.get_submodule(fqn)
    for sub_name, m in block.named_modules():
        name = by_module.get(id(m))
        if name is not None and sub_name and name.endswith("." + sub_name):
            return name[: -len(sub_name) - 1]
    return fqn


def _free_key(taken: dict[str, Any], key: str) -> str:
    return key if key not in taken else f"{key}.router_stats"
