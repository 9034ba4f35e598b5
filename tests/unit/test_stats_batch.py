"""One statistics pass per hook phase: the grouped partials equal the per-tensor ones, and the
batch ends its phases where the tensors still hold the values the hooks saw."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.execution.apply import apply_fp8
from fp8track.monitoring.reduce import take_partials
from fp8track.monitoring.stats_batch import StatsBatch
from fp8track.numerics.segment_stats import row_width, tensors_partial_stats
from fp8track.numerics.stats import finalize, get_compile, merge_partials, partial_stats, set_compile


@pytest.fixture(autouse=True)
def _eager_stats():
    """The per-tensor reference is the eager kernel (float64 sums, the real FP8 cast), which the
    grouped pass reproduces; the compiled kernel's float32 row sums differ from both by rounding."""
    mode = get_compile()
    set_compile("eager")
    yield
    set_compile(mode)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(16, 16, generator=g),
        torch.randn(16, 16, generator=g) * 1e-4,  # deep in the subnormals of e4m3 under a given scale
        torch.randn(3, 5, generator=g).to(torch.bfloat16),  # mixed dtypes in one group
        torch.randn(100, generator=g) * 300,
        torch.zeros(7),  # all zero: current scale 1, no nonzero element
    ]
    xs[3][5], xs[3][9], xs[0][2, 3] = math.nan, math.inf, 1e6
    return xs


def test_one_row_tensors_are_bit_equal_to_their_own_partials():
    xs = _tensors()
    assert row_width([x.numel() for x in xs]) == 256  # every tensor a single row
    for fmt, margin in (("e4m3", 0), ("e5m2", 1)):
        out = tensors_partial_stats(xs, fmt, None, margin)
        for x, row in zip(xs, out, strict=True):
            assert torch.equal(row, partial_stats(x, fmt, None, margin))


def test_given_and_current_scales_mix_in_one_pass():
    xs = _tensors()
    scales = [torch.tensor(2.0), torch.tensor(0.25), None, torch.tensor(4.0), None]
    out = tensors_partial_stats(xs, "e4m3", scales)
    for x, s, row in zip(xs, scales, out, strict=True):
        assert torch.equal(row, partial_stats(x, "e4m3", s))
    assert finalize(out[1], "e4m3")["underflow_pct"] > 50  # the small tensor under scale 0.25


def test_multi_row_tensors_equal_their_partials_to_float64_rounding():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 64, generator=g), torch.randn(1000, generator=g), torch.randn(300, 70, generator=g)]
    out = tensors_partial_stats(xs, "e4m3")
    for x, row in zip(xs, out, strict=True):
        ref = partial_stats(x, "e4m3")
        assert torch.equal(row[:5], ref[:5])  # counts: exact
        assert torch.equal(row[9:], ref[9:])  # maxima and scales: exact
        torch.testing.assert_close(row[5:9], ref[5:9], rtol=1e-14, atol=0)  # sums: summation order


def _model(recipe: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 8))
    if recipe is not None:
        apply_fp8(model, recipe, backend="emulated")
    return model


def _partials(recipe: str | None, batched: bool, tmp_path, micro_batches: int = 1, tensors=None):
    model = _model(recipe)
    cfg = MonitorConfig(every_n_steps=1, **({"tensors": tensors} if tensors else {}))
    mon = Monitor(model, cfg, log_dir=tmp_path / f"{recipe}-{batched}").attach()
    batches = {cap.batch for cap in mon.captures.values()}
    assert len(batches) == 1 and None not in batches  # one batch shared by the monitor's layers
    if not batched:
        for cap in mon.captures.values():
            cap.batch = None
    g = torch.Generator().manual_seed(2)
    batch = next(iter(batches))
    for i in range(micro_batches):
        loss = model(torch.randn(12, 16, generator=g)).square().mean()
        if batched:
            assert len(batch) == (6 if i == 0 else 3)  # the forward's activations (and weights) wait
        loss.backward()
        if batched:
            assert len(batch) == 0  # both phases computed by the end of the backward
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)  # an optimizer step: the weights' rows must be the forward's weights
    take = take_partials(mon.captures, torch.device("cpu"))
    mon.close(reduce=False)
    return take


@pytest.mark.parametrize("recipe", [None, "current", "delayed"])
def test_monitor_rows_equal_the_per_tensor_path(recipe, tmp_path):
    got = _partials(recipe, True, tmp_path, micro_batches=2)
    want = _partials(recipe, False, tmp_path, micro_batches=2)
    assert got.keys == want.keys and len(got.keys) == 3 * 3
    for key, a, b in zip(got.keys, got.parts, want.parts, strict=True):
        assert torch.equal(a, b), key
    assert {v for _, _, v in got.keys} == {"shadow" if recipe is None else "actual"}


def test_forward_batch_ends_at_the_backward_without_gradient_rows(tmp_path):
    got = _partials("current", True, tmp_path, tensors=("activation", "weight"))
    want = _partials("current", False, tmp_path, tensors=("activation", "weight"))
    assert len(got.keys) == 3 * 2
    for a, b in zip(got.parts, want.parts, strict=True):
        assert torch.equal(a, b)


def test_a_tensor_changed_in_place_before_its_phase_ends_is_named():
    batch = StatsBatch()
    x = torch.ones(4, 4)
    acc: dict = {}
    batch.add(acc, ("activation", "shadow"), x, "e4m3", None, 0)
    x.mul_(2)
    with pytest.warns(UserWarning, match="modified in place"):
        batch.flush()
    assert finalize(acc[("activation", "shadow")])["amax"] == 2.0


def test_the_pending_bound_computes_early_and_large_tensors_go_direct():
    batch = StatsBatch(max_pending_numel=40)
    acc: dict = {}
    batch.add(acc, ("a", "v"), torch.ones(16), "e4m3", None, 0)
    assert len(batch) == 1 and not acc
    batch.add(acc, ("b", "v"), torch.ones(32), "e4m3", None, 0)
    assert len(batch) == 0 and set(acc) == {("a", "v"), ("b", "v")}
    assert not batch.accepts(torch.ones(1 << 13)) and batch.accepts(torch.ones(1 << 12))
    assert not batch.accepts(torch.ones(0)) and not batch.accepts(torch.ones(4, dtype=torch.int32))


class _SharedInputs(nn.Module):
    """Layers that read one input, as in a transformer: q, k and v projections, then an MLP's gate
    and up projections. ``clone_inputs`` gives each layer its own copy of the input (the same values
    in separate memory: nothing to share)."""

    def __init__(self, width: int, clone_inputs: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.clone_inputs = clone_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own = (lambda t: t.clone()) if self.clone_inputs else (lambda t: t)
        h = self.q(own(x)) * self.k(own(x)) + self.v(own(x))
        return self.down(nn.functional.gelu(self.gate(own(h))) * self.up(own(h)))


def _shared_input_run(
    recipe, clone_inputs, tokens, width, tmp_path, monkeypatch, micro_batches=2, batched=True, twice=False
):
    """The step's partials of :class:`_SharedInputs` over ``micro_batches``, and the elements the
    statistics passes read (the grouped pass and the per-tensor path of the batch). ``batched``
    False: no batch (each observation computed at once and merged by the kernel, the path before
    batching); ``twice``: the model runs twice per micro-batch (each layer twice in a phase)."""
    import fp8track.monitoring.stats_batch as sb

    seen = {"numel": 0}

    def counting(fn, tensors):
        def wrapped(*args, **kwargs):
            seen["numel"] += sum(t.numel() for t in tensors(args))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(sb, "tensors_partial_stats", counting(sb.tensors_partial_stats, lambda a: a[0]))
    monkeypatch.setattr(sb, "partial_stats", counting(sb.partial_stats, lambda a: a[:1]))
    model = _SharedInputs(width, clone_inputs)
    if recipe is not None:
        apply_fp8(model, recipe, backend="emulated")
    log_dir = tmp_path / f"{recipe}-{clone_inputs}-{batched}-{twice}"
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=log_dir).attach()
    if not batched:
        for cap in mon.captures.values():
            cap.batch = None
    g = torch.Generator().manual_seed(3)
    for _ in range(micro_batches):
        x = torch.randn(tokens, width, generator=g)
        (model(model(x)) if twice else model(x)).square().mean().backward()
    take = take_partials(mon.captures, torch.device("cpu"))
    mon.close(reduce=False)
    return take, seen["numel"]


@pytest.mark.parametrize("recipe", [None, "current", "delayed"])
@pytest.mark.parametrize("tokens,width", [(12, 16), (256, 64)])  # grouped; per tensor (>= 8192 elements)
def test_layers_reading_one_input_compute_its_statistics_once(recipe, tokens, width, tmp_path, monkeypatch):
    shared, shared_numel = _shared_input_run(recipe, False, tokens, width, tmp_path, monkeypatch)
    cloned, cloned_numel = _shared_input_run(recipe, True, tokens, width, tmp_path, monkeypatch)
    assert shared.keys == cloned.keys and len(shared.keys) == 6 * 3
    for key, a, b in zip(shared.keys, cloned.parts, shared.parts, strict=True):
        assert torch.equal(a, b), key  # sharing changes no bit
    # Per micro-batch: the inputs of q, k, v (one tensor) and of gate, up (one tensor) are read once
    # under current scaling (the control's shadow statistics, an FP8 run's current scaling); delayed
    # scaling judges each layer's copy with the layer's own scale.
    saved = 2 * (2 * tokens * width + tokens * width)  # two micro-batches: k, v; up
    if recipe == "delayed":
        assert shared_numel == cloned_numel
    else:
        # Per micro-batch: inputs 5 x (tokens, width) + (tokens, 2 width), dY 4 x (tokens, width) +
        # 2 x (tokens, 2 width); weights once per step: 3 x width^2 + 3 x 2 width^2.
        assert cloned_numel == 2 * (7 + 8) * tokens * width + 9 * width * width
        assert cloned_numel - shared_numel == saved


@pytest.mark.parametrize("recipe", [None, "current"])
@pytest.mark.parametrize("twice", [False, True])
def test_later_micro_batches_merge_as_the_unbatched_path(recipe, twice, tmp_path, monkeypatch):
    # Every tensor of per-tensor size (>= 16,384 elements), three micro-batches: the partials the batch
    # merges at each phase end equal those the kernel merged at once, one by one, with no batch.
    run = lambda batched: _shared_input_run(  # noqa: E731
        recipe, False, 128, 128, tmp_path, monkeypatch, micro_batches=3, batched=batched, twice=twice
    )[0]
    merged, direct = run(True), run(False)
    assert merged.keys == direct.keys and len(merged.keys) == 6 * 3
    for key, a, b in zip(merged.keys, merged.parts, direct.parts, strict=True):
        assert torch.equal(a, b), key
    numel = finalize(merged.parts[merged.keys.index(("q", "activation", merged.keys[0][2]))])["numel"]
    assert numel == 3 * (2 if twice else 1) * 128 * 128  # every micro-batch (and call) merged once


def test_a_later_micro_batch_waits_for_the_phase_end_and_merges_in_observation_order():
    batch = StatsBatch()
    g = torch.Generator().manual_seed(6)
    x1, x2, x3 = (torch.randn(128, 128, generator=g) * s for s in (1.0, 3.0, 0.01))
    acc: dict = {}
    batch.merge_current(acc, ("a", "v"), x1, "e4m3", 0)  # the step's first: taken as it is
    first = acc[("a", "v")]
    assert torch.equal(first, partial_stats(x1, "e4m3"))
    batch.merge_current(acc, ("a", "v"), x2, "e4m3", 0)  # a later micro-batch: waits
    batch.merge_current(acc, ("b", "v"), x2, "e4m3", 0)  # another layer reads the same tensor
    assert acc[("a", "v")] is first and ("b", "v") in acc
    batch.merge_current(acc, ("a", "v"), x3, "e4m3", 0)  # the same layer again: the wait ends first
    batch.flush()
    p1, p2, p3 = (partial_stats(x, "e4m3") for x in (x1, x2, x3))
    assert torch.equal(acc[("a", "v")], merge_partials([merge_partials([p1, p2]), p3]))
    assert torch.equal(acc[("b", "v")], p2)
    assert finalize(acc[("a", "v")])["amax"] == finalize(p2)["amax"]


def test_only_the_same_unchanged_tensor_in_one_phase_shares_a_partial():
    batch = StatsBatch()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    first = batch.current_partial(x, "e4m3", 0)
    assert batch.current_partial(x.detach(), "e4m3", 0) is first  # another view object, same view
    assert batch.current_partial(x, "e5m2", 0) is not first  # another format
    assert batch.current_partial(x, "e4m3", 1) is not first  # another margin
    x.mul_(4)  # changed in place: its version moved
    changed = batch.current_partial(x, "e4m3", 0)
    assert torch.equal(changed, partial_stats(x, "e4m3"))
    assert finalize(changed)["amax"] == 4 * finalize(first)["amax"]
    batch.flush()  # the phase ended
    assert batch.current_partial(x, "e4m3", 0) is not changed
    acc: dict = {}
    batch.add(acc, ("a", "v"), x, "e4m3", None, 0)
    batch.add(acc, ("b", "v"), x, "e4m3", None, 0)  # shares the first's row
    batch.add(acc, ("c", "v"), x, "e4m3", torch.tensor(0.5), 0)  # a given scale: its own row
    assert len(batch) == 3 and batch._numel == 2 * x.numel()
    batch.flush()
    assert acc[("a", "v")] is acc[("b", "v")] and not torch.equal(acc[("a", "v")], acc[("c", "v")])


def test_a_tensor_subclass_is_never_shared():
    class Wrapped(torch.Tensor):  # a subclass stands for storage it may not have
        pass

    batch = StatsBatch()
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(5)).as_subclass(Wrapped)
    first = batch.current_partial(x, "e4m3", 0)
    assert batch.current_partial(x, "e4m3", 0) is not first
    assert torch.equal(first, partial_stats(x.as_subclass(torch.Tensor), "e4m3"))
    acc: dict = {}
    batch.add(acc, ("a", "v"), x, "e4m3", None, 0)
    batch.add(acc, ("b", "v"), x, "e4m3", None, 0)
    assert batch._numel == 2 * x.numel()
    batch.flush()
    assert torch.equal(acc[("a", "v")], acc[("b", "v")]) and acc[("a", "v")] is not acc[("b", "v")]


@pytest.mark.parametrize(
    "count,tiny,grouped", [(2, False, False), (7, False, False), (8, False, True), (2, True, True)]
)
def test_a_few_tensors_the_compiled_kernel_takes_skip_the_grouped_pass_on_cpu(
    count, tiny, grouped, monkeypatch
):
    # Under the "auto" policy a CPU phase of fewer than PER_TENSOR_BELOW["cpu"] tensors of compiled
    # size (2,048-8,191 elements) is computed one by one: each row is that tensor's own partial, bit
    # for bit. Eight such tensors, or any tensor the policy keeps eager, take the grouped pass.
    import fp8track.monitoring.stats_batch as sb

    set_compile("auto")
    calls = []
    monkeypatch.setattr(sb, "tensors_partial_stats", lambda *a: calls.append(a) or tensors_partial_stats(*a))
    assert sb.PER_TENSOR_BELOW["cpu"] == 8
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(64, 64, generator=g) * (i + 1) for i in range(count)]
    xs += [torch.randn(16, 16, generator=g)] if tiny else []
    scales = [torch.tensor(2.0 ** -i) if i % 2 else None for i in range(len(xs))]  # given and current mixed
    batch, acc = StatsBatch(), {}
    for i, (x, s) in enumerate(zip(xs, scales, strict=True)):
        assert batch.accepts(x)
        batch.add(acc, (f"t{i}", "v"), x, "e4m3", s, 0)
    batch.flush()
    assert len(calls) == (1 if grouped else 0)
    want = tensors_partial_stats(xs, "e4m3", scales) if grouped else None
    for i, (x, s) in enumerate(zip(xs, scales, strict=True)):
        assert torch.equal(acc[(f"t{i}", "v")], want[i] if grouped else partial_stats(x, "e4m3", s))
