"""Mixture-of-experts structure: expert groups, their MoE blocks, routers and shared experts.

Recognised by structure and class names, never by importing a model library:

* **fused experts** (Hugging Face ``transformers`` >= 5, every ``@use_experts_implementation``
  family: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss, ...): one module holding 3-D
  parameters ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` with the experts on dimension 0,
  stored ``[E, out, in]``, or ``[E, in, out]`` where the module says ``is_transposed`` (gpt-oss),
  optional ``<param>_bias`` ``[E, out]``. Its forward sorts the routed (token, expert) slots by
  expert and runs one grouped GEMM per projection (``torch._grouped_mm`` with offsets).
* **dense experts** (Llama 4's ``Llama4TextExperts``): the same 3-D parameters, ``[E, in, out]``,
  run by ``torch.bmm`` over every token for every expert (the router's scores zero the rest).
* **module-list experts** (SwitchTransformers, NLLB-MoE, older models): an ``nn.ModuleList`` /
  ``nn.ModuleDict`` named ``experts`` of identical MLPs built from ``nn.Linear``; each expert's
  linears are ordinary GEMM layers.
* **Transformer Engine** ``GroupedLinear`` (one GEMM per expert, ``m_splits`` tokens each; TE's
  debug names ``<name>.gemm_<i>``) and torchao's MoE training (expert weights wrapped in a tensor
  subclass that intercepts ``_grouped_mm``) are recognised so that they are listed, not skipped.

A **router** is the block's ``gate`` / ``router`` child: a module with a 2-D ``weight``
``[E, hidden]`` (Mixtral's ``MixtralTopKRouter``, PhiMoE's and Llama 4's ``nn.Linear``
subclasses returning tuples), or such a module's ``classifier`` linear (SwitchTransformers);
Qwen2-MoE's ``shared_expert_gate`` (``Linear(hidden -> 1)``) gates the shared expert and is a
router too. Every anchor keeps routers in high precision (torchtitan filters ``experts`` only,
Megatron-LM ``--moe-router-dtype fp32``), so :func:`fp8track.apply_fp8` does as well.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

FUSED_UP_PARAMS = ("gate_up_proj", "up_proj")
FUSED_DOWN_PARAM = "down_proj"
ROUTER_NAMES = ("gate", "router")
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts")
SHARED_GATE_NAME = "shared_expert_gate"
MOE_KEYWORDS = ("experts", "router", "shared_experts")
"""Selector keywords (``bf16_layers=`` and the monitor's ``layers=``) naming MoE parts."""
ROUTER_REASON = "router kept in high precision"


@dataclass(frozen=True)
class ExpertParam:
    """One fused projection of an expert group.

    Attributes:
        name: the parameter's name in the experts module (``gate_up_proj``, ``up_proj``, ``down_proj``).
        transposed: stored ``[E, in, out]`` (gpt-oss, Llama 4) instead of ``[E, out, in]``.
        bias: the name of its ``[E, out]`` bias parameter, or ``None``.
    """

    name: str
    transposed: bool
    bias: str | None = None

    def weight_oi(self, module: nn.Module) -> torch.Tensor:
        """The ``[E, out, in]`` view of the parameter (GEMM orientation of every expert); a
        torchao-wrapped weight is read through its plain tensor (:func:`plain_weight`)."""
        w = plain_weight(getattr(module, self.name))
        return w.transpose(-2, -1) if self.transposed else w


def plain_weight(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the plain tensor inside torchao's MoE-training weight wrapper (its ``_data``: the
    wrapper itself has no storage of its own); views of the wrapper hold views of it."""
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and type(t).__module__.startswith("torchao") else t


def torchao_training_config(module: nn.Module) -> object | None:
    """The torchao MoE training config (``Float8TrainingOpConfig`` / ``MXFP8TrainingOpConfig``)
    of a fused experts module whose weights torchao wrapped, else ``None``."""
    for p in module._parameters.values():
        cfg = getattr(p, "config", None) if type(p).__module__.startswith("torchao") else None
        if cfg is not None:
            return cfg
    return None


@dataclass(frozen=True)
class ExpertGroup:
    """The experts of one MoE block.

    Attributes:
        fqn: the experts module's qualified name.
        kind: ``"fused"`` (grouped GEMMs over routed slots), ``"dense"`` (every expert over every
            token, Llama 4), ``"module_list"`` (per-expert ``nn.Linear`` MLPs), ``"te_grouped"``
            (Transformer Engine ``GroupedLinear``) or ``"torchao"`` (torchao MoE training).
        num_experts: E.
        params: the fused projections in execution order (empty for ``module_list`` / TE).
        top_k: routed experts per token, when the block or router says.
    """

    fqn: str
    kind: str
    num_experts: int
    params: tuple[ExpertParam, ...] = ()
    top_k: int | None = None


@dataclass(frozen=True)
class MoEBlock:
    """One mixture-of-experts block.

    Attributes:
        fqn: the block's qualified name (the experts' parent).
        experts: its :class:`ExpertGroup`.
        router: the router module's qualified name (``None`` if none was recognised).
        router_gemm: the module running the router's GEMM (the router itself, or its
            ``classifier`` linear), or ``None``.
        shared: qualified names of shared-expert modules.
        shared_gate: the ``shared_expert_gate`` linear, or ``None``.
    """

    fqn: str
    experts: ExpertGroup
    router: str | None = None
    router_gemm: str | None = None
    shared: tuple[str, ...] = ()
    shared_gate: str | None = None


def is_fused_experts(module: nn.Module) -> bool:
    """True for a module holding fused 3-D expert parameters (:data:`FUSED_UP_PARAMS` and
    ``down_proj``, experts on dimension 0), Hugging Face's fused and Llama 4's dense experts."""
    down = module._parameters.get(FUSED_DOWN_PARAM) if hasattr(module, "_parameters") else None
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        return False
    up = next(
        (module._parameters.get(n) for n in FUSED_UP_PARAMS if module._parameters.get(n) is not None), None
    )
    return isinstance(up, torch.Tensor) and up.dim() == 3 and up.shape[0] == down.shape[0]


def _is_te_grouped(module: nn.Module) -> bool:
    return any(c.__module__.startswith("transformer_engine") and c.__name__ == "GroupedLinear"
               for c in type(module).__mro__)


def _is_torchao_wrapped(module: nn.Module) -> bool:
    return torchao_training_config(module) is not None or any(
        type(p).__module__.startswith("torchao") for p in module._parameters.values() if p is not None
    )


def fused_params(module: nn.Module) -> tuple[ExpertParam, ...]:
    """The projections of a fused experts module, in execution order (up, then down).

    ``is_transposed`` comes from the module when it says (Hugging Face's decorator sets it);
    otherwise the layout is read off the shapes: ``[E, in, out]`` when the up projection's
    dimension 1 equals the down projection's output width (Llama 4: ``[E, H, 2I]`` and ``[E, I, H]``).
    """
    up_name = next(n for n in FUSED_UP_PARAMS if module._parameters.get(n) is not None)
    up, down = getattr(module, up_name), getattr(module, FUSED_DOWN_PARAM)
    transposed = getattr(module, "is_transposed", None)
    if not isinstance(transposed, bool):
        transposed = up.shape[1] == down.shape[2] and up.shape[2] != down.shape[1]
    return tuple(
        ExpertParam(n, transposed, f"{n}_bias" if module._parameters.get(f"{n}_bias") is not None else None)
        for n in (up_name, FUSED_DOWN_PARAM)
    )


def _top_k(*modules: nn.Module | None) -> int | None:
    for m in modules:
        for attr in ("top_k", "num_experts_per_tok"):
            v = getattr(m, attr, None) if m is not None else None
            if isinstance(v, int) and v > 0:
                return v
        config = getattr(m, "config", None) if m is not None else None
        v = getattr(config, "num_experts_per_tok", None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def expert_group(fqn: str, module: nn.Module, block: nn.Module | None = None) -> ExpertGroup | None:
    """The :class:`ExpertGroup` ``module`` is, or ``None``."""
    if _is_te_grouped(module):
        return ExpertGroup(fqn, "te_grouped", int(getattr(module, "num_gemms", 0)), top_k=_top_k(block))
    if is_fused_experts(module):
        params = fused_params(module)
        e = int(getattr(module, params[-1].name).shape[0])
        kind = (
            "torchao"
            if _is_torchao_wrapped(module)
            else ("fused" if hasattr(module, "has_gate") else "dense")
        )
        router = _router_child(block) if block is not None else None
        return ExpertGroup(fqn, kind, e, params, _top_k(block, router[1] if router else None, module))
    if fqn.rsplit(".", 1)[-1] == "experts" and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(
            isinstance(m, nn.Linear) for m in children[0].modules()
        ):
            router = _router_child(block) if block is not None else None
            return ExpertGroup(
                fqn, "module_list", len(children), top_k=_top_k(block, router[1] if router else None)
            )
    return None


def _router_child(block: nn.Module) -> tuple[str, nn.Module] | None:
    for name in ROUTER_NAMES:
        child = getattr(block, name, None)
        if isinstance(child, nn.Module) and _router_gemm(child) is not None:
            return name, child
    return None


def _router_gemm(router: nn.Module) -> str | None:
    """``""`` when ``router`` runs its own ``[E, hidden]`` GEMM, ``"classifier"`` (or another child
    linear's name) when a child does, ``None`` when it is not a router."""
    w = router._parameters.get("weight")
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return ""
    for name, child in router.named_children():
        cw = getattr(child, "weight", None)
        if isinstance(child, nn.Linear) and isinstance(cw, torch.Tensor):
            return name
    return None


@dataclass(frozen=True)
class MoEMap:
    """Every MoE block of a model (:func:`find_moe`)."""

    blocks: tuple[MoEBlock, ...] = ()

    @property
    def groups(self) -> tuple[ExpertGroup, ...]:
        return tuple(b.experts for b in self.blocks)

    def group(self, fqn: str) -> ExpertGroup | None:
        return next((b.experts for b in self.blocks if b.experts.fqn == fqn), None)

    def router_gemms(self) -> tuple[str, ...]:
        """Qualified names of the modules running router GEMMs (routers and shared-expert gates)."""
        return tuple(n for b in self.blocks for n in (b.router_gemm, b.shared_gate) if n is not None)

    def keyword_modules(self, keyword: str) -> tuple[str, ...]:
        """The modules a selector keyword (:data:`MOE_KEYWORDS`) names."""
        if keyword == "experts":
            return tuple(b.experts.fqn for b in self.blocks)
        if keyword == "router":
            return self.router_gemms()
        if keyword == "shared_experts":
            return tuple(s for b in self.blocks for s in b.shared)
        raise ValueError(keyword)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_moe(model: nn.Module) -> MoEMap:
    """The model's MoE blocks, in registration order (an empty map for a dense model)."""
    blocks: list[MoEBlock] = []
    for fqn, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or isinstance(block, (nn.ModuleList, nn.ModuleDict)):
            continue
        group = expert_group(_join(fqn, "experts"), experts, block)
        if group is None:
            continue
        router = _router_child(block)
        router_fqn = router_gemm = None
        if router is not None:
            router_fqn = _join(fqn, router[0])
            sub = _router_gemm(router[1])
            router_gemm = _join(router_fqn, sub) if sub else router_fqn
        shared = tuple(
            _join(fqn, n) for n in SHARED_EXPERT_NAMES if isinstance(getattr(block, n, None), nn.Module)
        )
        gate = getattr(block, SHARED_GATE_NAME, None)
        blocks.append(MoEBlock(
            fqn, group, router_fqn, router_gemm, shared,
            _join(fqn, SHARED_GATE_NAME) if isinstance(gate, nn.Linear) else None,
        ))
    return MoEMap(tuple(blocks))


def unrecognised_experts(model: nn.Module, moe: MoEMap) -> dict[str, str]:
    """``{module name: reason}`` of modules that hold expert weights in a layout none of the kinds
    above covers (DBRX's ``DbrxExpertGLU``: 2-D ``w1``/``v1``/``w2`` ``[E * F, H]``; JetMoE's
    ``JetMoeParallelExperts``: a 3-D ``weight``): a class named for experts (not a norm) with its own
    parameters of two or more dimensions, outside every recognised expert group of ``moe``
    (:func:`find_moe`'s map of ``model``). No backend converts them and no statistics hook sees
    their GEMMs, so they must be listed, never skipped silently."""
    groups = [g.fqn for g in moe.groups]
    out = {}
    for fqn, m in model.named_modules():
        cls = type(m).__name__
        if "expert" not in cls.lower() or "norm" in cls.lower() or isinstance(m, nn.Linear):
            continue
        if is_fused_experts(m) or any(fqn == g or fqn.startswith(g + ".") for g in groups):
            continue
        params = [n for n, p in m.named_parameters(recurse=False) if p.dim() >= 2]
        if params:
            out[fqn] = (
                f"{cls} holds expert weights ({', '.join(params)}) in a layout fp8track does not "
                "recognise (neither fused gate_up_proj/down_proj nor nn.Linear experts): no backend "
                "converts them and the monitor has no statistics rows for them; they run in high "
                "precision (the FP8 FLOP share counts their GEMMs as such)"
            )
    return out


def expert_row(group_fqn: str, param: str, expert: int | None = None) -> str:
    """Record name of an expert projection: ``<experts>.<param>`` (the group's aggregate row) or
    ``<experts>.<param>.expert_<e>``.

    Example:
        >>> expert_row("model.layers.1.mlp.experts", "down_proj", 3)
        'model.layers.1.mlp.experts.down_proj.expert_3'
    """
    base = f"{group_fqn}.{param}"
    return base if expert is None else f"{base}.expert_{expert}"


_EXPERT_SUFFIX = ".expert_"


def projection_of_row(name: str) -> str:
    """The selectable name a record row designates: ``<experts>.<param>`` for one expert's row
    ``<experts>.<param>.expert_<e>`` (an expert cannot be kept in BF16 alone on any backend: its
    projection can), else ``name`` itself.

    Example:
        >>> projection_of_row("model.layers.1.mlp.experts.down_proj.expert_3")
        'model.layers.1.mlp.experts.down_proj'
    """
    head, sep, tail = name.rpartition(_EXPERT_SUFFIX)
    return head if sep and tail.isdigit() else name


_ROW_FORMS = (
    re.compile(r"^(?P<group>.+)\.expert_(?P<e>\d+)$"),  # fused: <experts>.<param>.expert_<e>
    re.compile(r"^(?P<group>.+)\.gemm_(?P<e>\d+)$"),  # TE GroupedLinear debug names: <name>.gemm_<e>
    # module-list experts: <experts>.expert_<e>.<param> (SwitchTransformers), <experts>.<e>.<param>
    re.compile(r"^(?P<experts>(?:.+\.)?experts)\.(?:expert_)?(?P<e>\d+)\.(?P<param>.+)$"),
)


def parse_expert_row(name: str) -> tuple[str, int] | None:
    """``(group, expert)`` of a record row holding one expert's GEMM, else ``None``. ``group`` names
    the projection across the experts (``<experts>.<param>``), so siblings share it whatever
    form the row has: fused ``<experts>.<param>.expert_<e>``, Transformer Engine
    ``<name>.gemm_<e>``, module-list ``<experts>.expert_<e>.<param>`` or ``<experts>.<e>.<param>``.

    Example:
        >>> parse_expert_row("encoder.block.1.layer.1.mlp.experts.expert_3.wi")
        ('encoder.block.1.layer.1.mlp.experts.wi', 3)
        >>> parse_expert_row("model.layers.0.self_attn.q_proj") is None
        True
    """
    for form in _ROW_FORMS:
        m = form.match(name)
        if m is not None:
            group = m["group"] if "group" in form.groupindex else f"{m['experts']}.{m['param']}"
            return group, int(m["e"])
    return None


def param_names(group: ExpertGroup) -> Sequence[str]:
    """Selector names of a fused group's projections (``<experts>.<param>``)."""
    return [f"{group.fqn}.{p.name}" for p in group.params]
