"""Hugging Face's own convention, ``Trainer(..., callbacks=[FP8TrainerCallback(...)])``, on a real
Trainer: ``fp8/loss`` is the loss HF logs (read from the model's ``outputs.loss`` and normalised as
HF normalises it under gradient accumulation, both normalisations), a one-time warning where it
cannot be read that way, ``.attach(trainer)`` for a custom ``compute_loss``, and ``apply_report``."""

from __future__ import annotations

import warnings

import pytest
import torch

import fp8track
from fp8track.monitoring.naming import LOSS_METRIC, run_metric
from fp8track.monitoring.records import RunReader

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def token_data(n: int = 10, seq: int = 8):
    """Sequences whose number of predicted tokens differs (1 to 5 leading labels masked), so a
    per-token mean over the accumulated batch differs from the mean of per-micro-batch means.
    10 sequences at 2 per micro-batch are 5 micro-batches per epoch: with accumulation 2 the third
    step of each epoch has one micro-batch (HF's ``current_gradient_accumulation_steps`` = 1)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, 64, (seq,), generator=g)
        labels = ids.clone()
        labels[: (i % 5) + 1] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(seq, dtype=torch.long)})
    return out


def hf_args(tmp_path, steps: int = 5, max_grad_norm: float = 0.5):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, learning_rate=1e-2, seed=0, max_grad_norm=max_grad_norm,
    )  # fmt: skip


def hf_losses(trainer) -> dict[int, float]:
    """HF's own logged loss per step (fp8track numbers the steps as HF does: from 1)."""
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def hf_grad_norms(trainer) -> dict[int, float]:
    return {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}


def recorded(run_dir, name: str = LOSS_METRIC) -> dict[int, float]:
    return {m.step: m.metrics[name] for m in RunReader(run_dir).metrics() if name in m.metrics}


class OutputRecorder:
    """The test's own record of each training micro-batch's ``outputs.loss``, per HF step, and
    whether HF passed ``num_items_in_batch`` (an independent view of what the model returned)."""

    def __init__(self, model, trainer) -> None:
        self.by_step: dict[int, list[float]] = {}
        self.normalised: set[bool] = set()

        def hook(module, args, kwargs, output):
            if module.training and torch.is_grad_enabled():
                step = trainer.state.global_step + 1
                self.by_step.setdefault(step, []).append(float(output.loss))
                self.normalised.add(kwargs.get("num_items_in_batch") is not None)

        self.handle = model.register_forward_hook(hook, with_kwargs=True)


def fp8track_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fp8track: ")]


@pytest.mark.parametrize(
    "tokens_normalise", [True, False], ids=["num_items_in_batch", "mean_per_micro_batch"]
)
def test_callbacks_list_records_the_loss_hf_logs(tmp_path, tokens_normalise):
    from transformers import Trainer

    from fp8track.hf import FP8TrainerCallback

    model = tiny_llama()
    report = fp8track.apply_fp8(model, "current", backend="emulated")
    cb = FP8TrainerCallback(every_n_steps=2, trackers="none", apply_report=report)
    trainer = Trainer(model=model, args=hf_args(tmp_path), train_dataset=token_data(), callbacks=[cb])
    # HF passes num_items_in_batch (the token count of the whole accumulated batch) when the model
    # takes loss kwargs, and otherwise divides each micro-batch's mean by the step's micro-batches.
    trainer.model_accepts_loss_kwargs = tokens_normalise
    outputs = OutputRecorder(model, trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    outputs.handle.remove()

    assert fp8track_warnings(caught) == []
    assert outputs.normalised == {tokens_normalise}
    hf, ours = hf_losses(trainer), recorded(cb.run_dir)
    assert sorted(ours) == sorted(hf) == [1, 2, 3, 4, 5]
    assert [len(outputs.by_step[s]) for s in hf] == [2, 2, 1, 2, 2]  # step 3 ends the epoch alone
    for step in hf:
        assert ours[step] == pytest.approx(hf[step], abs=1e-4)
    # The other normalisation would be wrong here: under num_items_in_batch the model's losses are
    # already per token of the step (their sum is HF's loss, their mean is half of it); otherwise
    # their mean is HF's loss and the sum is not.
    other = {s: (sum(v) / len(v) if tokens_normalise else sum(v)) for s, v in outputs.by_step.items()}
    assert all(abs(other[s] - hf[s]) > 1e-2 for s in hf if len(outputs.by_step[s]) == 2)
    # fp8/grad_norm of the sampled steps (2, 4): read after HF's clipping to 0.5
    norms, hf_norms = recorded(cb.run_dir, run_metric("grad_norm")), hf_grad_norms(trainer)
    assert sorted(norms) == [2, 4]
    for step, value in norms.items():
        assert value == pytest.approx(min(hf_norms[step], 0.5), rel=1e-4)
    meta = RunReader(cb.run_dir).meta()
    assert cb.monitor.apply_report is report  # the keyword reached the monitor
    assert meta["recipe"]["name"] == "current" and len(meta["fp8_layers"]) == 15


def test_unclipped_grad_norm_equals_hf_and_attach_still_works(tmp_path):
    """With clipping off, the grad norm read in on_pre_optimizer_step is HF's; and ``.attach``
    (the wrapper of ``training_step``) gives the same losses as the output hook."""
    from transformers import Trainer

    from fp8track.hf import FP8TrainerCallback

    runs = {}
    for mode in ("callbacks", "attach"):
        model = tiny_llama()
        cb = FP8TrainerCallback(every_n_steps=1, trackers="none")
        trainer = Trainer(
            model=model,
            args=hf_args(tmp_path / mode, steps=3, max_grad_norm=0.0),
            train_dataset=token_data(),
            callbacks=[cb] if mode == "callbacks" else None,
        )
        if mode == "attach":
            cb.attach(trainer)
        trainer.train()
        runs[mode] = (recorded(cb.run_dir), recorded(cb.run_dir, run_metric("grad_norm")), trainer)
    for losses, norms, trainer in runs.values():
        assert losses == pytest.approx(hf_losses(trainer), abs=1e-4)
        assert norms == pytest.approx(hf_grad_norms(trainer), rel=1e-5)
    assert runs["callbacks"][0] == pytest.approx(runs["attach"][0], abs=1e-6)  # same seed, same run


def test_a_loss_the_model_does_not_return_warns_once_and_attach_records_it(tmp_path):
    """``compute_loss_func`` takes the labels, so the model returns no loss: one warning, no
    ``fp8/loss``, training unharmed; ``.attach(trainer)`` then records HF's loss."""
    from transformers import Trainer

    from fp8track.hf import FP8TrainerCallback

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].reshape(-1, 64)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)

    cb = FP8TrainerCallback(every_n_steps=2, trackers="none")
    trainer = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "cb", steps=3), train_dataset=token_data(),
                      callbacks=[cb], compute_loss_func=loss_func)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    (text,) = fp8track_warnings(caught)
    assert "cannot read this step's loss" in text and ".attach(trainer)" in text
    assert recorded(cb.run_dir) == {} and len(hf_losses(trainer)) == 3
    assert sorted(recorded(cb.run_dir, run_metric("grad_norm"))) == [2]  # the statistics still flow

    attached = FP8TrainerCallback(every_n_steps=2, trackers="none")
    trainer = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "attach", steps=3),
                      train_dataset=token_data(), compute_loss_func=loss_func)
    attached.attach(trainer)
    trainer.train()
    assert recorded(attached.run_dir) == pytest.approx(hf_losses(trainer), abs=1e-4)


class ScaledLossTrainer(transformers.Trainer):
    """A ``compute_loss`` override: HF logs a loss the model's output does not hold."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 3.0


def test_custom_compute_loss_is_noticed_once_and_attach_records_it(tmp_path):
    from fp8track.hf import FP8TrainerCallback

    cb = FP8TrainerCallback(every_n_steps=2, trackers="none")
    trainer = ScaledLossTrainer(model=tiny_llama(), args=hf_args(tmp_path / "cb", steps=3),
                                train_dataset=token_data(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    (text,) = fp8track_warnings(caught)
    assert "differs from the loss HF logged" in text and "at step 1" in text and ".attach(trainer)" in text
    hf, ours = hf_losses(trainer), recorded(cb.run_dir)
    assert all(hf[s] == pytest.approx(3 * ours[s], rel=1e-4) for s in hf)  # the model's loss, not HF's

    attached = FP8TrainerCallback(every_n_steps=2, trackers="none")
    trainer = ScaledLossTrainer(model=tiny_llama(), args=hf_args(tmp_path / "attach", steps=3),
                                train_dataset=token_data())
    attached.attach(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert fp8track_warnings(caught) == []
    assert recorded(attached.run_dir) == pytest.approx(hf_losses(trainer), abs=1e-4)


def test_apply_report_keyword_is_the_same_on_every_frontend():
    import inspect

    from fp8track.hf import FP8TrainerCallback
    from fp8track.lightning import FP8Monitor

    for frontend in (fp8track.Monitor, FP8Monitor, FP8TrainerCallback):
        param = inspect.signature(frontend).parameters["apply_report"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None
    with pytest.raises(fp8track.ConfigError, match="ApplyReport"):
        FP8TrainerCallback(apply_report="current")


class _Crash(transformers.TrainerCallback):
    """Stops training with an exception at the end of HF step ``at`` (a process dying there)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise RuntimeError("crash")


def test_resuming_from_a_checkpoint_goes_on_in_the_same_run_directory(tmp_path):
    """A run dies after step 5 (checkpoints at 2 and 4); ``train(resume_from_checkpoint=True)``
    resumes from step 4 in the same run directory: steps 1-6 once each, equal to an uninterrupted
    run's, and the step 5 written by the dead run replaced by the resumed run's."""
    from transformers import Trainer

    from fp8track.hf import STATE_FILE, FP8TrainerCallback

    def trainer(out, callbacks):
        args = hf_args(tmp_path / out, steps=6)
        args.save_strategy, args.save_steps = "steps", 2
        return Trainer(model=tiny_llama(), args=args, train_dataset=token_data(), callbacks=callbacks)

    whole = FP8TrainerCallback(every_n_steps=3, trackers="none", log_dir=tmp_path / "runs_whole")
    trainer("whole", [whole]).train()

    first = FP8TrainerCallback(every_n_steps=3, trackers="none", log_dir=tmp_path / "runs")
    with pytest.raises(RuntimeError, match="crash"):
        trainer("cut", [first, _Crash(5)]).train()
    first.monitor.close()  # what the dead process left: steps 1-5
    assert sorted(recorded(first.run_dir)) == [1, 2, 3, 4, 5]
    assert (tmp_path / "cut" / "hf" / "checkpoint-4" / STATE_FILE).is_file()

    second = FP8TrainerCallback(every_n_steps=3, trackers="none", log_dir=tmp_path / "runs")
    resumed = trainer("cut", [second])
    resumed.train(resume_from_checkpoint=True)
    assert second.run_dir == first.run_dir
    assert len(list((tmp_path / "runs").iterdir())) == 1
    ours, reference = recorded(second.run_dir), recorded(whole.run_dir)
    assert sorted(ours) == [1, 2, 3, 4, 5, 6]
    assert ours == pytest.approx(reference, rel=1e-6)
    assert ours[6] == pytest.approx(hf_losses(resumed)[6], abs=1e-4)
    sampled = {r.step for r in RunReader(second.run_dir).tensor_stats()}
    assert sampled == {3, 6}
