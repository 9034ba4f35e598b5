"""Pairing before judging, on real runs: small models trained a few steps under fp8track's monitor
(plain loop and Lightning), run directories read back. The four pairs issue 19 measured (swapped,
the same run twice, a BERT control for a Llama run, Lightning against a plain loop) plus other
shapes and disjoint steps; the CLI's one line and exit 2."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest
import torch

import fp8track
from fp8track.analysis.baseline import load_run
from fp8track.analysis.diagnose import diagnose
from fp8track.analysis.pairing import align_runs, check_pairing, run_label, run_precision
from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.examples.gpt_lightning import GPTLightningModule
from fp8track.execution.recipes import Recipe
from fp8track.monitoring.monitor import run_meta_for

from helpers.lightning import quiet_trainer

STEPS, EVERY, BATCH, SEQ = 12, 3, 4, 16
SMALL = GPTConfig(vocab=64, n_layer=1, n_head=2, n_embd=32, block_size=SEQ)


def _batches(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _plain(tmp_path, name, model, recipe, loss_fn, vocab):
    """A plain loop: apply_fp8, fp8track.Monitor, STEPS optimizer steps; returns the run directory."""
    torch.manual_seed(0)
    fp8track.apply_fp8(model, recipe)
    mon = fp8track.Monitor(
        model, {"every_n_steps": EVERY}, log_dir=tmp_path / name, meta=run_meta_for(model, name)
    ).attach()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in _batches(vocab):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
    mon.close()
    return mon.run_dir


def _gpt(tmp_path, name, recipe, cfg=SMALL):
    torch.manual_seed(0)
    return _plain(tmp_path, name, GPT(cfg), recipe, lambda m, x, y: m.loss(x, y), cfg.vocab)


def _hf(tmp_path, name, family, recipe):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=SEQ,
        )
        model = transformers.BertForMaskedLM(cfg)
    return _plain(
        tmp_path,
        name,
        model,
        recipe,
        lambda m, x, y: m(input_ids=x.contiguous(), labels=y.contiguous()).loss,
        64,
    )


def _lightning(tmp_path, name, recipe):

    torch.manual_seed(0)
    module = GPTLightningModule(SMALL, lr=0.05)
    fp8track.apply_fp8(module, recipe)
    monitor = fp8track.FP8Monitor(every_n_steps=EVERY, log_dir=tmp_path / name, trackers="none",
                                  config={"run_name": name})
    trainer = quiet_trainer(None, [monitor], max_steps=STEPS)
    loader = torch.utils.data.DataLoader(_batches(SMALL.vocab), batch_size=None)
    trainer.fit(module, loader)
    return monitor.run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairing")
    return {"fp8": _gpt(tmp, "gpt-fp8", "delayed"), "control": _gpt(tmp, "gpt-control", "bf16"), "tmp": tmp}


def test_a_true_pair_pairs(runs):
    fp8, ctl = load_run(runs["fp8"]), load_run(runs["control"])
    assert run_precision(fp8) == "fp8" and run_precision(ctl) == "bf16"
    assert run_label(fp8) == f"gpt-fp8 ({Recipe.parse('delayed')})" and run_label(ctl) == "gpt-control (bf16)"
    assert check_pairing(fp8, ctl) is None
    assert "mismatched_runs" not in diagnose(fp8, ctl).kinds()


def test_swapped_runs_are_refused_saying_so(runs):
    fp8, ctl = load_run(runs["fp8"]), load_run(runs["control"])
    m = check_pairing(ctl, fp8)
    assert m.kind == "swapped" and "swapped" in m.message and "gpt-control (bf16)" in m.message
    d = diagnose(ctl, fp8)  # from Python: one mismatched_runs finding, never a verdict
    assert d.kinds() == ["mismatched_runs"] and d.top.text == m.message and d.layer_ranking == ()
    # both in FP8, or both in BF16: the one that is wrong is named
    assert (
        check_pairing(
            fp8,
            dataclasses.replace(
                fp8,
                source="other",
                meta={**fp8.meta, "run_id": "x"},
                metrics={"loss": {0: 1.0, 1: 2.0, 2: 3.0}},
            ),
        ).kind
        == "control_not_bf16"
    )
    assert (
        check_pairing(
            ctl,
            dataclasses.replace(
                ctl,
                source="other",
                meta={**ctl.meta, "run_id": "x"},
                metrics={"loss": {0: 1.0, 1: 2.0, 2: 3.0}},
            ),
        ).kind
        == "not_fp8"
    )


def test_the_same_run_twice_is_refused(runs, tmp_path):
    fp8 = load_run(runs["fp8"])
    assert check_pairing(fp8, load_run(runs["fp8"])).kind == "same_run"
    copy = shutil.copytree(runs["fp8"], tmp_path / "copy")  # another path, the same run id
    assert "run id" in check_pairing(fp8, load_run(copy)).message
    # another id, the same losses: still the same run
    twin = dataclasses.replace(load_run(copy), source="twin", meta={**fp8.meta, "run_id": "other"})
    assert "identical loss" in check_pairing(fp8, twin).message


@pytest.mark.slow
def test_a_bert_control_for_a_llama_run_is_refused(runs):
    llama = load_run(_hf(runs["tmp"], "llama-fp8", "llama", "current"))
    bert = load_run(_hf(runs["tmp"], "bert-control", "bert", "bf16"))
    m = check_pairing(llama, bert)
    assert m.kind == "layers" and "no layer in common" in m.message and "\n" not in m.message
    assert diagnose(llama, bert).kinds() == ["mismatched_runs"]


def test_other_sizes_of_the_same_layers_are_refused(runs):
    wide = load_run(_gpt(runs["tmp"], "gpt-wide-control", "bf16", dataclasses.replace(SMALL, n_embd=48)))
    m = check_pairing(load_run(runs["fp8"]), wide)
    assert m.kind == "shapes" and "blocks.0" in m.message


def test_too_few_common_steps_are_refused(runs):
    fp8, ctl = load_run(runs["fp8"]), load_run(runs["control"])
    key = ctl.loss_key()
    shifted = dataclasses.replace(ctl, metrics={key: {s + STEPS - 2: v for s, v in ctl.metrics[key].items()}})
    m = check_pairing(fp8, shifted)
    assert m.kind == "steps" and f"share 2 logged loss steps of {STEPS} and {STEPS}" in m.message


def test_a_lightning_run_pairs_with_a_plain_loop_control(runs):
    """The LightningModule holds the GPT as ``self.model``: its records carry the plain loop's names,
    so every layer has a control score."""
    lit = load_run(_lightning(runs["tmp"], "lightning-fp8", "delayed"))
    ctl = load_run(runs["control"])
    assert {r.layer for r in lit.tensor_rows} == {r.layer for r in ctl.tensor_rows}
    assert "blocks.0.attn.qkv" in {r.layer for r in lit.tensor_rows}
    assert check_pairing(lit, ctl) is None
    # records written before the names were canonical (a `model.` prefix) are aligned by the pairing
    old = dataclasses.replace(
        lit, tensor_rows=[dataclasses.replace(r, layer="model." + r.layer) for r in lit.tensor_rows]
    )
    assert check_pairing(old, ctl) is None
    a, c = align_runs(old, ctl)
    assert {r.layer for r in a.tensor_rows} == {r.layer for r in c.tensor_rows}
    d = diagnose(old, ctl)
    assert "mismatched_runs" not in d.kinds()
    assert {r.layer for r in d.layer_ranking} == {r.layer for r in ctl.tensor_rows}


def test_cli_prints_one_line_and_exits_2_on_a_mismatch(runs, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8track.cli",
            "diagnose",
            str(runs["control"]),
            "--baseline",
            str(runs["fp8"]),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8track diagnose: error: the runs are swapped"), (
        proc.stderr
    )
    assert not (tmp_path / "out" / "report.html").exists()
