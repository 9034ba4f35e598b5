"""Planted-fault scenarios for the diagnosis benchmark (bench/diagnosis_bench.py, docs/diagnosis.md).

One scenario = an FP8 run and its BF16 control: the same model, initial weights, batches and batch
order, both recorded by the real :class:`fp8track.Monitor` into run directories. A fault is planted
in the FP8 run's quantisation only, so the BF16 model is untouched by construction, and that is
checked too (:func:`bf16_unaffected`).

Plants (:class:`Plant`), all acting on FP8 quantisation state or on what one layer's quantiser sees;
each mechanism is a fault kind of fp8track's planted-fault kit (:mod:`fp8track.execution.faults`):

* ``amax`` (delayed scaling): the layer's amax history of one tensor kind gets a value ``2**log2``
  times its largest entry at every step of the plant's windows, as a corrupted history (or one
  outlier step) would leave it; the scale computed from it is ``2**log2`` too small, so the tensor
  underflows for the window plus one history length. Activation, weight and gradient alike. (A
  history lowered instead does nothing: each step writes its own amax into the history before the
  next scale is computed from its maximum.)
* ``outlier`` (any per-tensor scaling, activation only): one extra batch element carrying a single
  huge value joins the layer's input and its output row is dropped again; per-tensor scaling of the
  layer's input is set by that value and the real activations underflow. The BF16 GEMM's rows are
  independent, so the BF16 model computes the same thing.
* ``scale_state`` (delayed scaling): before each step of the plant's windows the layer's scale of
  one tensor kind is multiplied by ``2**-log2``, as a corrupted scale state (a bad restore, a
  scale written twice) would leave it; the next update recomputes it from the intact amax history,
  so the fault does not compound. ``log2 < 0`` saturates the tensor: every element above
  ``amax * 2**log2`` clips to the format's largest value. The monitor reads the same scale.
* ``scale`` (any per-tensor scaling): the layer's quantiser applies its scale times ``2**-log2``
  in the plant's windows (a software fault in the quantisation itself, such as a scale applied
  twice); it reports the faulty scale after the GEMM, so the monitor sees forward tensors' fault.

Data spikes (shared by both runs: a batch of uniformly random tokens) and a broken inference path
(evaluation through weights quantised with a scale ``2**-log2`` too small) complete the kinds of the
troubleshooting path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8track.execution import faults
from fp8track.execution.faults import Fault, Planted, has_outlier_row

FAMILIES = ("gpt", "llama", "gpt2", "qwen2")
POSITIONS = ("first", "middle", "last")
ROLES: Mapping[str, tuple[str, ...]] = {
    "attn_in": ("attn.qkv", "self_attn.q_proj", "attn.c_attn"),
    "mlp_down": ("mlp.proj", "mlp.down_proj", "mlp.c_proj"),
}
"""Plant positions by a layer's role: the first FP8 layer (forward order) whose name ends in one of
these (the attention input projection, the MLP down-projection) in every family."""
TENSORS = ("activation", "weight", "gradient")
VOCAB = 256
BLOCK = 64
BATCH = 16
LR = 3e-3
EVAL_BATCHES = 4
OUTLIER = 1e6
MECHANISMS = ("amax", "scale_state", "outlier", "scale")
RESULT_FORMAT = 4
"""Version of what :func:`train_run` returns (2: with ``gemm_error``; 3: scale plants count their
touches; 4: the GEMM-error probe measures every planted step); part of the cache key."""


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plant:
    """A fault in the FP8 run's quantisation.

    Attributes:
        mechanism: one of :data:`MECHANISMS` (module docstring).
        tensor: tensor kind it damages.
        position: ``"first"``, ``"middle"``, ``"last"`` FP8 layer in forward order, ``"all"``, or a
            role of :data:`ROLES` (``"attn_in"``, ``"mlp_down"``).
        windows: ``(start, stop)`` step ranges (stop exclusive) where the plant acts.
        log2: strength, binades.
    """

    mechanism: str
    tensor: str
    position: str
    windows: tuple[tuple[int, int], ...]
    log2: float = 20.0

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"unknown plant mechanism {self.mechanism!r}")
        if self.tensor not in TENSORS or self.position not in (*POSITIONS, *ROLES, "all"):
            raise ValueError(f"bad plant {self.tensor!r} at {self.position!r}")
        self.fault()  # the kit's own rules (the tensors a kind damages, its strength)

    def fault(self) -> Fault:
        """The kit's fault this plant puts into each target layer: the outlier carries
        :data:`OUTLIER`; a quantiser fault (``scale``) acts on evaluation passes too, as a software
        bug in the quantisation would."""
        return Fault(self.mechanism, self.tensor, self.windows, log2=self.log2, value=OUTLIER,
                     in_eval=self.mechanism == "scale")


@dataclass(frozen=True)
class RunSpec:
    """One training run: what the run-directory cache is keyed by."""

    family: str
    recipe: str
    seed: int
    steps: int
    every_n: int
    eval_every: int
    data_spikes: tuple[int, ...] = ()
    plant: Plant | None = None
    eval_fault_log2: float = 0.0
    bursts: bool = True
    """The monitor's bursts (every step for 8 steps after a spike, a non-finite or a divergence
    event: its default); ``False`` samples the fixed schedule only."""

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "result_format": RESULT_FORMAT}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Scenario:
    """A planted case: the FP8 run, its BF16 control and what the diagnosis should say.

    Attributes:
        name: unique id.
        expected_kind: the finding kind a correct diagnosis puts first (diagnose.KINDS).
        fp8: the FP8 run; the control is the same spec under the ``bf16`` recipe without the plant
            and the inference fault (:meth:`control`).
        ci: part of the ``--subset ci`` selection.
    """

    name: str
    expected_kind: str
    fp8: RunSpec
    ci: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)

    def control(self) -> RunSpec:
        return replace(self.fp8, recipe="bf16", plant=None, eval_fault_log2=0.0)

    @property
    def scores_layer(self) -> bool:
        """Whether the planted fault sits in one layer (layer top-1/top-3 are scored)."""
        return self.fp8.plant is not None and self.fp8.plant.position != "all"


# --- models and data -----------------------------------------------------------------------------


def build_model(family: str, seed: int) -> nn.Module:
    """A tiny model of ``family`` with seeded random weights (no download)."""
    torch.manual_seed(seed)
    if family == "gpt":
        from fp8track.examples.gpt import GPT, GPTConfig

        return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=BLOCK))
    import transformers

    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                       max_position_embeddings=BLOCK)
        return transformers.LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=BLOCK,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "qwen2":  # grouped-query attention, biased q/k/v projections, tied embeddings
        cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=BLOCK, tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(cfg)
    raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, nats (float32)."""
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


_TOKENS: torch.Tensor | None = None


def _tokens() -> torch.Tensor:
    global _TOKENS
    if _TOKENS is None:
        from fp8track.examples.gpt import stdlib_text

        _TOKENS = torch.frombuffer(bytearray(stdlib_text(600_000)), dtype=torch.uint8).to(torch.long)
    return _TOKENS


def batches(
    seed: int, steps: int, data_spikes: Sequence[int] = ()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` training batches in a seeded order (the same list for an FP8 run and its control);
    at ``data_spikes`` steps a batch of uniformly random tokens (a data spike both runs see)."""
    tok = _tokens()
    split = int(len(tok) * 0.9)
    n = (split - 1) // BLOCK
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for step in range(steps):
        if step in data_spikes:
            x = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(step))
        else:
            idx = torch.randint(0, n, (BATCH,), generator=g)
            x = torch.stack([tok[i * BLOCK: i * BLOCK + BLOCK + 1] for i in idx.tolist()])
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def val_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches (the tail 10 % of the text)."""
    tok = _tokens()
    start = int(len(tok) * 0.9)
    out = []
    for b in range(EVAL_BATCHES):
        rows = [
            tok[start + (b * BATCH + i) * BLOCK : start + (b * BATCH + i) * BLOCK + BLOCK + 1]
            for i in range(BATCH)
        ]
        x = torch.stack(rows)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


# --- plants --------------------------------------------------------------------------------------


def target_layers(fp8_layers: Sequence[str], position: str) -> list[str]:
    """The layers a plant acts on, by position in forward (module) order."""
    if position == "all":
        return list(fp8_layers)
    if position in ROLES:
        hits = [n for n in fp8_layers if n.endswith(ROLES[position])]
        if not hits:
            raise ValueError(f"no FP8 layer plays the role {position!r} in {list(fp8_layers)}")
        return hits[:1]
    i = {"first": 0, "middle": len(fp8_layers) // 2, "last": len(fp8_layers) - 1}[position]
    return [fp8_layers[i]]


def attach_plant(model: nn.Module, plant: Plant, layers: Sequence[str]) -> Planted:
    """``plant`` in ``layers`` of ``model``; call ``before_step(step)`` before each step's forward.
    Layers without the FP8 state a mechanism corrupts (the BF16 control) are left alone."""
    return faults.plant(model, plant.fault(), layers, strict=False)


@contextlib.contextmanager
def broken_inference(model: nn.Module, log2: float) -> Iterator[None]:
    """Evaluation through a wrong weight scale (``2**-log2`` too small) in every FP8 layer."""
    from fp8track.execution.emulated_linear import EmulatedFP8Layer

    layers = [n for n, m in model.named_modules() if isinstance(m, EmulatedFP8Layer)]
    handle = faults.plant(model, Fault("scale", "weight", log2=log2, in_eval=True), layers, strict=False)
    try:
        yield
    finally:
        handle.detach()


# --- layer damage, measured without the monitor ------------------------------------------------------


def _weight_out_in(layer: nn.Module) -> torch.Tensor:
    """The layer's weight as ``[out, in]`` (Hugging Face's ``Conv1D`` stores ``[in, out]``)."""
    from fp8track.execution.emulated_linear import EmulatedFP8Conv1D

    w = layer.weight
    return w.t() if isinstance(layer, EmulatedFP8Conv1D) or type(layer).__name__ == "Conv1D" else w


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(ref.norm())
    return float((got.float() - ref).norm()) / den if den > 0 else math.nan


class GemmErrorProbe:
    """The relative error of each layer's GEMM against the same GEMM in float32, from the training
    loop (plain torch, independent of the monitor and the diagnosis).

    On steps :meth:`measure` selects: ``forward`` is ``||y - (x W^T + b)|| / ||x W^T + b||`` for the
    layer's output ``y`` and input ``x`` (the outlier plant's padded row left out); ``dgrad`` is
    ``||dX - dY W|| / ||dY W||`` for the input gradient ``dX`` the layer's backward returned. A
    layer whose quantisation is broken reads near 1 (an underflowed operand gives a zero GEMM);
    healthy FP8 GEMMs of these models read a few percent.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], backward: bool) -> None:
        self.on = False
        self.errors: dict[str, dict[str, dict[int, float]]] = {"forward": {}, "dgrad": {}}
        self.step = -1
        self._handles = []
        for name in layers:
            m = model.get_submodule(name)
            self._handles.append(m.register_forward_hook(self._forward(name)))
            if backward:
                self._handles.append(m.register_full_backward_hook(self._backward(name)))

    def measure(self, step: int, on: bool) -> None:
        self.step, self.on = step, on

    def _forward(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if not (self.on and m.training and torch.is_grad_enabled()):
                return
            x = args[0]
            if x.shape[0] == out.shape[0] + 1 and has_outlier_row(x, OUTLIER):
                x = x[:-1]
            with torch.no_grad():
                b = None if m.bias is None else m.bias.float()
                ref = F.linear(x.float(), _weight_out_in(m).float(), b)
                self.errors["forward"].setdefault(name, {})[self.step] = _rel_error(out, ref)

        return hook

    def _backward(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, grad_in: tuple[Any, ...], grad_out: tuple[Any, ...]) -> None:
            if not self.on or grad_in[0] is None or grad_out[0] is None:
                return
            with torch.no_grad():
                ref = grad_out[0].float() @ _weight_out_in(m).float()
                self.errors["dgrad"].setdefault(name, {})[self.step] = _rel_error(grad_in[0], ref)

        return hook

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


PROBE_EVERY = 4
"""Steps between GEMM-error measurements (every step inside a plant's short windows)."""


def probe_step(plant: Plant | None, step: int) -> bool:
    """Whether the GEMM-error probe measures ``step``: every :data:`PROBE_EVERY`-th step, and every
    step of a plant window shorter than ``2 * PROBE_EVERY`` or of a plant of at most 16 steps in
    all (an intermittent or transient plant's few steps)."""
    if plant is None:
        return step % PROBE_EVERY == 0
    few = sum(b - a for a, b in plant.windows) <= 16
    short = any(a <= step < b and (few or b - a < 2 * PROBE_EVERY) for a, b in plant.windows)
    return short or step % PROBE_EVERY == 0


# --- training ------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v = sum(float(model_loss(model, x, y)) for x, y in data) / len(data)
    model.train(was)
    return v


def train_run(spec: RunSpec, log_dir: Path) -> dict[str, Any]:
    """Train ``spec`` with the real :class:`fp8track.Monitor` writing under ``log_dir``.

    Returns plain data (kept next to the run directory): ``run_dir``, ``fp8_layers``, ``loss``
    (every step, float, as the training loop saw it), ``eval`` (``{step: recorded val_loss}``),
    ``eval_clean`` (``{step: val_loss through the correct path}``), ``planted_layers``, ``seconds``.
    """
    import fp8track
    from fp8track.monitoring.monitor import data_fingerprint, run_meta_for

    model = build_model(spec.family, spec.seed)
    report = fp8track.apply_fp8(model, spec.recipe, backend="emulated")
    fp8_layers = list(report.fp8_layers) or [n for n, _ in report.bf16_layers]
    data = batches(spec.seed, spec.steps, spec.data_spikes)
    val = val_batches()
    meta = run_meta_for(model, name=f"{spec.family}-{spec.recipe}-s{spec.seed}",
                        config={"data_seed": spec.seed, "data_order": f"bench-{spec.seed}-{spec.steps}",
                                "family": spec.family})
    # The batches are a function of (seed, steps, data spikes): the FP8 run and its control record
    # the same fingerprint, so the diagnosis compares them step by step (paired noise unit).
    fingerprint = data_fingerprint(
        seed=spec.seed, order=range(spec.steps), data_spikes=repr(spec.data_spikes)
    )
    cfg = fp8track.MonitorConfig(every_n_steps=spec.every_n, **({} if spec.bursts else {"burst_steps": 0}))
    mon = fp8track.Monitor(model, cfg, log_dir=log_dir, meta=meta, data_fingerprint=fingerprint).attach()
    planted = target_layers(fp8_layers, spec.plant.position) if spec.plant else []
    plant = attach_plant(model, spec.plant, planted) if spec.plant else None
    # After the plant's hooks, so the probe sees what the next layer sees (the padded row dropped).
    probe = GemmErrorProbe(model, list(report.fp8_layers),
                           backward=spec.plant is not None and spec.plant.tensor == "gradient")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    evals: dict[int, float] = {}
    clean: dict[int, float] = {}
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(data):
        if plant is not None:
            plant.before_step(step)
        probe.measure(step, probe_step(spec.plant, step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model_loss(model, x, y)
        loss.backward()
        probe.measure(step, False)
        opt.step()
        mon.step(loss=loss.detach())
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if spec.eval_every and ((step + 1) % spec.eval_every == 0 or step == spec.steps - 1):
            clean[step] = evaluate(model, val)
            if spec.eval_fault_log2:
                with broken_inference(model, spec.eval_fault_log2):
                    evals[step] = evaluate(model, val)
            else:
                evals[step] = clean[step]
            mon.record_eval(step, {"val_loss": evals[step]})
    mon.close()
    probe.detach()
    if plant is not None:
        plant.detach()
    return {"run_dir": str(mon.run_dir), "fp8_layers": fp8_layers, "loss": losses, "eval": evals,
            "eval_clean": clean, "planted_layers": planted, "plant_touches": plant.touched if plant else 0,
            "gemm_error": probe.errors, "seconds": time.perf_counter() - t0}


def bf16_unaffected(spec: RunSpec, steps: int = 4) -> dict[str, Any]:
    """Train the BF16 model ``steps`` steps with the plant acting on every step and without it,
    from the same weights and batches: the plant must change nothing. ``max_loss_diff`` and
    ``max_param_diff`` are the largest absolute differences; ``ok`` when both are 0 up to float
    rounding of the same GEMMs (1e-6 relative)."""
    import fp8track

    if spec.plant is None:
        return {"ok": True, "max_loss_diff": 0.0, "max_param_diff": 0.0, "note": "no plant"}
    always = replace(spec.plant, windows=((0, steps),))
    data = batches(spec.seed, steps)
    outs = []
    for planted in (False, True):
        model = build_model(spec.family, spec.seed)
        report = fp8track.apply_fp8(model, "bf16", backend="emulated")
        layers = target_layers([n for n, _ in report.bf16_layers], always.position)
        handle = attach_plant(model, always, layers) if planted else None
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
        losses = []
        for step, (x, y) in enumerate(data):
            if handle is not None:
                handle.before_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model_loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        if handle is not None:
            handle.detach()
        outs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = outs
    loss_diff = max(abs(a - b) for a, b in zip(l0, l1, strict=True))
    param_diff = max(float((a - b).abs().max()) for a, b in zip(p0, p1, strict=True))
    scale = max(abs(v) for v in l0)
    return {"ok": loss_diff <= 1e-6 * scale and param_diff <= 1e-6, "max_loss_diff": loss_diff,
            "max_param_diff": param_diff}


# --- the scenario set ----------------------------------------------------------------------------

STEPS = 160
EVERY = 5
EVAL_EVERY = 20
DELAYED = "delayed:hybrid:h16:max"
CURRENT = "current"


def _spec(family: str, recipe: str, seed: int = 0, **kw: Any) -> RunSpec:
    return RunSpec(family, recipe, seed, kw.pop("steps", STEPS), EVERY, EVAL_EVERY, **kw)


SATURATE_LOG2 = -8.0
"""Strength of a saturating plant (``scale_state``): the scale ``2**8`` too large, so every element
above ``amax / 256`` clips to the format's largest value."""


def _layer_plant(recipe: str, tensor: str, position: str, lasting: bool, saturate: bool = False) -> Plant:
    windows = ((48, STEPS),) if lasting else ((64, 68), (112, 116))
    if saturate:
        return Plant("scale_state", tensor, position, windows, SATURATE_LOG2)
    mech = "amax" if recipe.startswith("delayed") else "outlier"
    return Plant(mech, tensor, position, windows, 30.0 if tensor == "gradient" else 20.0)


def scenarios() -> list[Scenario]:
    """The full set: every kind of the troubleshooting path on three model families."""
    out: list[Scenario] = []
    # healthy pairs: FP8 against its control, no plant; different families, recipes, seeds
    for fam, recipe, seed, ci in (("gpt", DELAYED, 0, True), ("llama", CURRENT, 1, False),
                                  ("gpt2", DELAYED, 2, False), ("gpt", CURRENT, 3, False),
                                  ("llama", DELAYED, 4, False)):
        out.append(
            Scenario(f"healthy-{fam}-{recipe.split(':')[0]}-s{seed}", "healthy", _spec(fam, recipe, seed), ci)
        )
    # shared spikes: random-token batches both runs see
    for fam, recipe, ci in (("gpt", DELAYED, True), ("llama", CURRENT, False)):
        out.append(Scenario(f"shared_spikes-{fam}-{recipe.split(':')[0]}", "shared_spikes",
                            _spec(fam, recipe, data_spikes=(56, 57, 112, 113)), ci))
    # divergence from the start: a software-style wrong scale in every FP8 layer from step 0
    for fam, recipe, tensor, ci in (
        ("gpt", CURRENT, "weight", False),
        ("llama", DELAYED, "activation", False),
        ("gpt2", CURRENT, "activation", False),
    ):
        plant = Plant("scale", tensor, "all", ((0, STEPS),), 24.0)
        out.append(Scenario(f"divergence-{fam}-{recipe.split(':')[0]}-{tensor}", "divergence_from_start",
                            _spec(fam, recipe, plant=plant), ci))
    # one damaged layer: activation/weight/gradient x first/middle/last x lasting/intermittent
    layer_cases = (
        ("gpt", DELAYED, "activation", "middle", True, False),
        ("gpt", DELAYED, "weight", "last", True, True),
        ("gpt", DELAYED, "gradient", "first", True, False),
        ("llama", DELAYED, "activation", "last", True, False),
        ("llama", DELAYED, "weight", "middle", True, False),
        ("gpt2", DELAYED, "gradient", "middle", True, False),
        ("gpt2", CURRENT, "activation", "first", True, False),
        ("llama", CURRENT, "activation", "middle", True, False),
        ("gpt", DELAYED, "activation", "first", False, False),
        ("gpt", DELAYED, "weight", "middle", False, False),
        ("llama", DELAYED, "gradient", "last", False, False),
        ("gpt2", DELAYED, "weight", "first", False, False),
        ("gpt2", DELAYED, "activation", "last", False, False),
        ("gpt", CURRENT, "activation", "last", False, True),
        ("llama", CURRENT, "activation", "first", False, False),
    )
    # ... and the other direction: a history too low, so the layer's tensor saturates (overflow)
    saturating = (
        ("gpt", DELAYED, "activation", "middle", True, False),
        ("llama", DELAYED, "weight", "first", True, False),
        ("gpt2", DELAYED, "gradient", "middle", True, False),
        ("llama", DELAYED, "activation", "middle", False, False),
    )
    for cases, saturate in ((layer_cases, False), (saturating, True)):
        for fam, recipe, tensor, pos, lasting, ci in cases:
            kind = "mid_training_gap" if lasting else "fp8_only_spikes"
            name = (f"{'gap' if lasting else 'spikes'}-{fam}-{recipe.split(':')[0]}-{tensor}-{pos}"
                    + ("-saturated" if saturate else ""))
            out.append(
                Scenario(
                    name,
                    kind,
                    _spec(fam, recipe, plant=_layer_plant(recipe, tensor, pos, lasting, saturate)),
                    ci,
                    tags=("lasting" if lasting else "intermittent", "overflow" if saturate else "underflow"),
                )
            )
    # loss normal, evaluation through a broken inference path worse
    for fam, recipe, ci in (("gpt", DELAYED, False), ("gpt2", CURRENT, False)):
        out.append(Scenario(f"downstream-{fam}-{recipe.split(':')[0]}", "downstream_drop_with_normal_loss",
                            _spec(fam, recipe, eval_fault_log2=24.0), ci))
    out.extend(_qwen2_scenarios())
    out.extend(_cause_scenarios())
    return out


def every(start: int, stop: int, k: int) -> tuple[tuple[int, int], ...]:
    """Plant windows of one step each, every ``k``-th step from ``start`` (an intermittent fault)."""
    return tuple((s, s + 1) for s in range(start, stop, k))


def _qwen2_scenarios() -> list[Scenario]:
    """The fourth family (Hugging Face Qwen2: grouped-query attention, biased q/k/v, tied embeddings)
    through the path's kinds: healthy pairs, shared spikes, divergence, one damaged layer."""
    out = [
        Scenario("healthy-qwen2-current-s5", "healthy", _spec("qwen2", CURRENT, 5)),
        Scenario("healthy-qwen2-delayed-s6", "healthy", _spec("qwen2", DELAYED, 6)),
        Scenario("shared_spikes-qwen2-current", "shared_spikes",
                 _spec("qwen2", CURRENT, data_spikes=(56, 57, 112, 113))),
        Scenario("divergence-qwen2-delayed-weight", "divergence_from_start",
                 _spec("qwen2", DELAYED, plant=Plant("scale", "weight", "all", ((0, STEPS),), 24.0))),
    ]
    for recipe, tensor, pos, lasting in ((DELAYED, "gradient", "middle", True),
                                         (CURRENT, "activation", "last", False)):
        name = f"{'gap' if lasting else 'spikes'}-qwen2-{recipe.split(':')[0]}-{tensor}-{pos}"
        out.append(Scenario(name, "mid_training_gap" if lasting else "fp8_only_spikes",
                            _spec("qwen2", recipe, plant=_layer_plant(recipe, tensor, pos, lasting)),
                            tags=("lasting" if lasting else "intermittent", "underflow")))
    return out


def _cause_scenarios() -> list[Scenario]:
    """Cause and consequence, transient damage, intermittent faults between samples, and healthy
    pairs that share spikes (what a diagnosis must not call a problem).

    * ``cause``: a 1e6 outlier joins the first attention input projection's input from step 40
      (every 3rd step, or every step): the layer's output is destroyed on those steps (the truth:
      its GEMM error in the training loop), the damage can reach the later layers, the loss and
      the head's gradient; the cause is the planted layer, later anomalies are its consequences.
      Whether the loss shows it depends on the model: a lasting gap or spikes it left are right
      answers beside ``latent_damage``, a healthy verdict never is;
    * ``transient``: a 1e6 outlier into the first MLP down-projection for 15 steps from step 80,
      then never again: the loss rises and recovers (latent damage);
    * ``between``: every 3rd step from step 41 (the monitor samples every 5th: one planted step in
      three sampled ones), with the monitor's bursts and without;
    * ``healthy_shared``: data spikes both runs take, on two more families.
    """
    out: list[Scenario] = []
    every3 = every(40, STEPS, 3)
    for fam, windows, ci in (("gpt", every3, True), ("qwen2", every3, False), ("llama", every3, False),
                             ("gpt2", every3, False), ("gpt", ((40, STEPS),), False)):
        plant = Plant("outlier", "activation", "attn_in", windows)
        how = "every3" if len(windows) > 1 else "lasting"
        out.append(Scenario(f"cause-{fam}-current-attn_in-{how}", "latent_damage",
                            _spec(fam, CURRENT, plant=plant), ci, tags=("cause", how)))
    transient = ((80, 95),)
    for fam, recipe, ci in (("gpt", CURRENT, True), ("llama", CURRENT, False), ("qwen2", CURRENT, False),
                            ("gpt2", CURRENT, False), ("gpt", DELAYED, False)):
        mech = "amax" if recipe.startswith("delayed") else "outlier"
        plant = Plant(mech, "activation", "mlp_down", transient, 20.0)
        out.append(Scenario(f"transient-{fam}-{recipe.split(':')[0]}-mlp_down", "latent_damage",
                            _spec(fam, recipe, plant=plant), ci, tags=("transient",)))
    between = every(41, STEPS, 3)
    for fam, recipe, role, bursts in (
        ("gpt", CURRENT, "mlp_down", True),
        ("gpt", CURRENT, "mlp_down", False),
        ("llama", CURRENT, "attn_in", True),
        ("llama", CURRENT, "attn_in", False),
        ("qwen2", CURRENT, "mlp_down", False),
    ):
        plant = Plant("outlier", "activation", role, between)
        tag = "bursts" if bursts else "no_bursts"
        out.append(Scenario(f"between-{fam}-{recipe.split(':')[0]}-{role}-{tag}", "latent_damage",
                            _spec(fam, recipe, plant=plant, bursts=bursts), tags=("between", tag)))
    for fam, recipe in (("gpt2", DELAYED), ("llama", DELAYED)):
        out.append(Scenario(f"healthy_shared-{fam}-{recipe.split(':')[0]}", "shared_spikes",
                            _spec(fam, recipe, seed=7, data_spikes=(40, 41, 100, 101)),
                            tags=("healthy_shared",)))
    return out


def select(subset: str = "full", families: Sequence[str] | None = None) -> list[Scenario]:
    """Scenarios of ``subset`` (``"full"`` or ``"ci"``) restricted to ``families``."""
    if subset not in ("full", "ci"):
        raise ValueError(f"unknown subset {subset!r}; valid: full, ci")
    fams = set(families or FAMILIES)
    bad = fams - set(FAMILIES)
    if bad:
        raise ValueError(f"unknown families {sorted(bad)}; valid: {', '.join(FAMILIES)}")
    return [s for s in scenarios() if s.fp8.family in fams and (subset == "full" or s.ci)]


# --- ground truth, independent of the diagnosis ----------------------------------------------------

RATIO_SMOOTH = 5
"""Centred running-median width applied to the per-step FP8/control loss ratio."""
GAP_MIN = 1.05
"""A lasting gap: the smoothed FP8/control loss ratio at least this (5 %; healthy pairs stay near 1 %)."""
TRACK_MAX = 1.03
"""Tracking the control before a plant: the median ratio at most this. (No lasting gap, in the
healthy and spike scenarios: the tail median below :data:`GAP_MIN`; healthy FP8 runs of these
tiny models end 1-4 % off their control.)"""
SPIKE_MIN = 1.10
"""An FP8-only spike: the smoothed ratio (as in the healthy check, which it must fail) reaches this
inside a plant window. A raw one-step ratio is not enough: a healthy pair reached 1.096."""
DATA_SPIKE_MIN = 1.3
"""A data spike: the loss at least this times the median of the 10 steps before, in both runs."""
EVAL_DROP_MIN = 1.05
"""A downstream drop: the broken-path evaluation loss at least this times the control's."""


def _running_median(v: Sequence[float], w: int) -> list[float]:
    h = w // 2
    return [float(torch.tensor(v[max(0, i - h): i + h + 1]).median()) for i in range(len(v))]


def _median(v: Sequence[float]) -> float:
    return float(torch.tensor(list(v)).median()) if len(v) else math.nan


def loss_ratio(fp8: Sequence[float], control: Sequence[float]) -> list[float]:
    """Per-step FP8/control training-loss ratio (same batches, so the noise largely cancels)."""
    return [f / c if math.isfinite(f) else math.inf for f, c in zip(fp8, control, strict=True)]


DAMAGE_MIN = 0.3
"""A damaged layer: the median relative error of its GEMM (forward, or dgrad for a gradient plant)
over the plant's steps at least this (healthy FP8 GEMMs of these models: a few percent)."""
DAMAGE_RATIO = 3.0
"""... and at least this many times every other layer's median over the same steps."""


def damage_steps(plant: Plant, recipe: str, steps: int) -> list[int]:
    """The steps a plant's damage is measured on: its windows, each extended by one amax-history
    length under delayed scaling (the corrupted entry stays in the history that long)."""
    from fp8track.execution.recipes import Recipe

    lag = Recipe.parse(recipe).amax_history_len if plant.mechanism == "amax" else 0
    return sorted({t for a, b in plant.windows for t in range(a, min(steps, b + lag))})


def layer_damage(sc: Scenario, fp8: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the plant damaged its layer and no other, from the training loop's GEMM-error probe
    (:class:`GemmErrorProbe`, never the monitor): the planted layer's median relative GEMM error
    over :func:`damage_steps` against :data:`DAMAGE_MIN` and :data:`DAMAGE_RATIO` times the worst
    other layer's. ``verified`` is False for plants on every layer and runs without probe data."""
    plant = sc.fp8.plant
    if plant is None or not sc.scores_layer or "gemm_error" not in fp8:
        return {"verified": False}
    measure = "dgrad" if plant.tensor == "gradient" else "forward"
    errs: Mapping[str, Mapping[str, float]] = fp8["gemm_error"][measure]
    steps = set(damage_steps(plant, sc.fp8.recipe, sc.fp8.steps))
    first = min(a for a, _ in plant.windows)

    def med(layer: str, keep: Callable[[int], bool]) -> float:
        return _median([v for t, v in errs.get(layer, {}).items() if keep(int(t)) and math.isfinite(v)])

    planted = fp8["planted_layers"][0]
    during = {layer: med(layer, lambda t: t in steps) for layer in errs}
    others = {k: v for k, v in during.items() if k != planted and math.isfinite(v)}
    worst_other = max(others.items(), key=lambda kv: kv[1]) if others else (None, 0.0)
    p = during.get(planted, math.nan)
    return {
        "measure": measure,
        "planted_error": p,
        "planted_error_before": med(planted, lambda t: 10 <= t < first),
        "worst_other_layer": worst_other[0],
        "worst_other_error": worst_other[1],
        "verified": bool(math.isfinite(p) and p >= DAMAGE_MIN and p >= DAMAGE_RATIO * worst_other[1]),
    }


def ground_truth(sc: Scenario, fp8: Mapping[str, Any], control: Mapping[str, Any],
                 bf16_check: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the scenario's phenomenon materialised, from the training loop's own losses and
    evaluations (never from the diagnosis). ``checks`` maps each condition to a bool;
    ``materialised`` is their conjunction; the numbers behind them come along."""
    spec = sc.fp8
    n = spec.steps
    ratio = loss_ratio(fp8["loss"], control["loss"])
    sm = _running_median(ratio, RATIO_SMOOTH)
    tail = sm[int(0.8 * n):]
    out: dict[str, Any] = {"final_ratio_smoothed": sm[-1], "max_ratio_smoothed": max(sm[10:])}
    checks: dict[str, bool] = {"bf16_unaffected": bool(bf16_check["ok"])}
    if spec.plant is not None:
        checks["plant_acted"] = fp8["plant_touches"] > 0
    kind = sc.expected_kind
    out["ratio_tail"] = _median(tail)
    if kind == "healthy":
        checks["no_lasting_gap"] = out["ratio_tail"] < GAP_MIN
        checks["no_spike"] = out["max_ratio_smoothed"] < SPIKE_MIN
    elif kind == "shared_spikes":
        starts = [s for s in spec.data_spikes if s - 1 not in spec.data_spikes]
        rises = []
        for s in starts:
            rises.append({"step": s, "fp8": fp8["loss"][s] / _median(fp8["loss"][s - 10:s]),
                          "control": control["loss"][s] / _median(control["loss"][s - 10:s])})
        out["data_spikes"] = rises
        checks["spikes_in_both"] = all(
            r["fp8"] >= DATA_SPIKE_MIN and r["control"] >= DATA_SPIKE_MIN for r in rises
        )
        checks["no_lasting_gap"] = out["ratio_tail"] < GAP_MIN
        # the pair is healthy: its verdict's ``healthy`` finding leads, the shared spikes a note
        out["accepted_kinds"] = [kind, "healthy"]
    elif kind == "divergence_from_start":
        early = _median(ratio[5: int(0.2 * n)])
        out.update(early_ratio=early, late_ratio=_median(tail))
        checks["gap_from_start"] = early >= GAP_MIN
        checks["gap_lasts"] = _median(tail) >= GAP_MIN
    elif kind == "mid_training_gap":
        start = spec.plant.windows[0][0]
        before = _median(ratio[10:start])
        out.update(ratio_before=before, ratio_late=_median(tail), plant_start=start)
        checks["tracks_before_plant"] = before <= TRACK_MAX
        checks["gap_after_plant"] = _median(tail) >= GAP_MIN
    elif kind == "fp8_only_spikes":
        from fp8track.execution.recipes import Recipe

        # Under delayed scaling the damage outlives the window by one amax-history length.
        lag = Recipe.parse(spec.recipe).amax_history_len if spec.plant.mechanism == "amax" else 0
        peaks = []
        for a, b in spec.plant.windows:
            seg = range(a, min(n, b + lag + 2))
            i = max(seg, key=lambda t: sm[t])
            ctl_rise = control["loss"][i] / _median(control["loss"][max(0, i - 10):i])
            peaks.append({"window": [a, b], "peak_step": i, "peak_ratio": ratio[i],
                          "peak_ratio_smoothed": sm[i], "control_rise": ctl_rise})
        out["spikes"] = peaks
        # The same measure the healthy check bounds: a spike is what no healthy pair shows.
        checks["fp8_spike"] = any(p["peak_ratio_smoothed"] >= SPIKE_MIN for p in peaks)
        checks["control_calm"] = all(p["control_rise"] < DATA_SPIKE_MIN for p in peaks)
        if out["ratio_tail"] >= GAP_MIN:  # the damage also left a lasting gap: both answers are right
            out["accepted_kinds"] = [kind, "mid_training_gap"]
    elif kind == "downstream_drop_with_normal_loss":
        last = max(int(k) for k in fp8["eval"])
        ev = {int(k): v for k, v in fp8["eval"].items()}
        clean = {int(k): v for k, v in fp8["eval_clean"].items()}
        ctl = {int(k): v for k, v in control["eval"].items()}
        out.update(eval_broken=ev[last], eval_clean=clean[last], eval_control=ctl[last],
                   ratio_second_half=_median(ratio[n // 2:]))
        checks["loss_normal"] = _median(ratio[n // 2:]) < GAP_MIN
        checks["eval_dropped"] = ev[last] >= EVAL_DROP_MIN * ctl[last]
        checks["clean_eval_normal"] = clean[last] < GAP_MIN * ctl[last]
    # The layer ranking's own ground truth: the planted layer's GEMM is the broken one, whether or
    # not one broken layer of a small model moves the loss.
    out["layer_damage"] = layer_damage(sc, fp8)
    if kind == "latent_damage":
        # The phenomenon is the destroyed GEMM itself (the probe's error, never the monitor's); the
        # loss may or may not show it: a lasting gap or a spike it left are right answers too.
        checks["layer_destroyed"] = bool(out["layer_damage"]["verified"])
        accepted = [kind, "layer_outlier"]
        if out["ratio_tail"] >= GAP_MIN:
            accepted.append("mid_training_gap")
        if max(sm[10:]) >= SPIKE_MIN:
            accepted.append("fp8_only_spikes")
        out["accepted_kinds"] = accepted
    out.setdefault("accepted_kinds", [kind])
    out["checks"] = checks
    out["materialised"] = all(checks.values())
    out["layer_verified"] = bool(
        out["layer_damage"]["verified"] and checks["bf16_unaffected"] and checks.get("plant_acted", False)
    )
    return out
