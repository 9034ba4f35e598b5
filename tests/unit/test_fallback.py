import pytest
import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.execution.blocks import block_stacks, repeated_blocks
from fp8track.execution.fallback import FallbackSpec, resolve_fallback
from fp8track.execution.fallback_resolve import HEAD_REASON


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16))


def block_linears(i):
    return [f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj"]


class Stage(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList(Inner() for _ in range(n))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 16) for _ in range(4))  # bare-linear lists never win


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.stages = nn.ModuleList([Stage(2), Stage(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.stem(x)
        for st in self.stages:
            for b in st.blocks:
                x = b.heads[0](b.up(x))
        return self.head(x)


def test_first_last_on_gpt(gpt):
    assert repeated_blocks(gpt) == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(resolve_fallback(gpt, "none")) == []
    assert list(resolve_fallback(gpt, "first")) == block_linears(0)
    assert list(resolve_fallback(gpt, "last:2")) == block_linears(1) + block_linears(2)
    got = resolve_fallback(gpt, "first_last")
    assert list(got) == block_linears(0) + block_linears(2) + ["lm_head"]  # Megatron: output layer never FP8
    assert got["blocks.2.mlp.fc"] == "last:1 (block blocks.2)" and got["lm_head"] == HEAD_REASON
    assert list(resolve_fallback(gpt, "head")) == ["lm_head"]
    assert FallbackSpec.parse("first_last").explain(gpt) == (
        "first:1, last:1: stack blocks (3 blocks) keeps blocks.0, blocks.2",
        "head: lm_head (the linears after the last block; Megatron-LM never runs its output layer in FP8)",
    )


def test_regex_names_and_auto(gpt):
    assert list(resolve_fallback(gpt, "re:lm_head$,blocks.1.mlp")) == [
        "blocks.1.mlp.fc",
        "blocks.1.mlp.proj",
        "lm_head",
    ]
    assert list(resolve_fallback(gpt, ["re:attn\\.(qkv|proj)$"])) == [
        n for i in range(3) for n in block_linears(i)[:2]
    ]
    ranked = resolve_fallback(
        gpt, "auto:2", ranking={"lm_head": 0.1, "blocks.2.mlp.fc": 3.0, "blocks.0.attn.qkv": 2.0}
    )
    assert ranked == {"blocks.0.attn.qkv": "auto:2 (rank 2)", "blocks.2.mlp.fc": "auto:2 (rank 1)"}
    assert list(resolve_fallback(gpt, "auto:1", ranking=["lm_head", "blocks.0.mlp.fc"])) == ["lm_head"]


def test_nested_blocks_count_inner_blocks_across_stages():
    m = Nested()
    assert repeated_blocks(m) == [
        "stages.0.blocks.0",
        "stages.0.blocks.1",
        "stages.1.blocks.0",
        "stages.1.blocks.1",
        "stages.1.blocks.2",
    ]
    first = resolve_fallback(m, "first:1")
    assert list(first) == ["stages.0.blocks.0.up"] + [f"stages.0.blocks.0.heads.{i}" for i in range(4)]
    last2 = resolve_fallback(m, "last:2")
    assert {n.rsplit(".", 2)[0] if ".heads." in n else n.rsplit(".", 1)[0] for n in last2} == {
        "stages.1.blocks.1", "stages.1.blocks.2"
    }
    assert "stem" not in resolve_fallback(m, "first:5,last:5") and "head" not in resolve_fallback(
        m, "first:5,last:5"
    )
    assert list(resolve_fallback(m, "head")) == ["head"]  # the linear after the last block


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)


class MoELayer(nn.Module):
    def __init__(self, n_experts=4):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.Linear(16, 16)
        self.gate = nn.Linear(16, n_experts)
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))


def test_mixture_of_experts_counts_layers_not_experts():
    m = nn.Module()
    m.layers = nn.ModuleList(MoELayer() for _ in range(3))  # 12 experts outnumber the 3 layers
    m.lm_head = nn.Linear(16, 64)
    assert repeated_blocks(m) == ["layers.0", "layers.1", "layers.2"]
    got = resolve_fallback(m, "first_last")
    assert {n.split(".")[1] for n in got if n.startswith("layers.")} == {"0", "2"}
    assert len(got) == 2 * (2 + 4 * 2) + 1 and got["lm_head"] == HEAD_REASON


def test_model_without_blocks_counts_single_linears():
    # Registration order differs from execution order here: b runs first.
    class Swapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.c = nn.Linear(16, 16)

        def forward(self, x):
            return self.c(self.a(self.b(x)))

    m = Swapped()
    assert repeated_blocks(m) == []
    assert list(resolve_fallback(m, "first")) == ["a"]
    assert list(resolve_fallback(m, "first", example_inputs=torch.randn(2, 16))) == ["b"]
    seq = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    assert list(resolve_fallback(seq, "first_last")) == ["0", "4"]  # head = the last linear, already kept
    assert list(resolve_fallback(seq, "head")) == ["4"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("re:^nothing", "matches no linear layer; candidates: blocks.0.attn.qkv"),
        ("blocks.9", "missing module 'blocks.9'; linear layers: blocks.0.attn.qkv"),
        ("ln_f", "holds no linear layer"),
        ("first:4", "asks for 4 blocks but stack 'blocks' has 3: blocks.0, blocks.1, blocks.2"),
        ("auto:2", "needs a layer ranking"),
    ],
)
def test_errors_name_candidates(gpt, spec, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        resolve_fallback(gpt, spec)


@pytest.mark.parametrize("spec", ["first:0", "last:x", "auto:", "re:(", ""])
def test_malformed_terms_fail_at_parse(spec):
    if spec == "":
        assert FallbackSpec.parse(spec).terms == ()
        return
    with pytest.raises(ConfigError):
        FallbackSpec.parse(spec)


def test_megatron_equivalent_and_str():
    assert FallbackSpec.from_megatron(True, 1, 2).terms == ("first:1", "last:2", "head")
    assert FallbackSpec.from_megatron(False).terms == ("head",)
    assert str(FallbackSpec.parse("first_last:2")) == "first:2,last:2,head"
    with pytest.raises(ConfigError, match="cannot be combined"):
        FallbackSpec.parse("none,first")
    with pytest.raises(ConfigError, match="ranking names layers the model lacks"):
        resolve_fallback(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2)), "auto:1", ranking=["ghost"])


# --- Hugging Face models built from small configs (no download) -----------------------------------

tf = pytest.importorskip("transformers")


def _blocks_kept(got, prefix):
    """Indices of the blocks under ``prefix`` that hold a kept linear."""
    return sorted({int(n[len(prefix):].split(".")[0]) for n in got if n.startswith(prefix)})


def test_first_last_on_llama_keeps_lm_head():
    m = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    got = resolve_fallback(m, "first_last")
    assert _blocks_kept(got, "model.layers.") == [0, 3] and got["lm_head"] == HEAD_REASON
    assert len(got) == 2 * 7 + 1  # q, k, v, o, gate, up, down per block, plus lm_head
    assert list(resolve_fallback(m, "first:1,last:1")) == [n for n in got if n != "lm_head"]


def test_first_last_on_bert_classifier_keeps_pooler_and_classifier():
    m = tf.BertForSequenceClassification(
        tf.BertConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_labels=3,
        )
    )
    got = resolve_fallback(m, "first_last")
    assert _blocks_kept(got, "bert.encoder.layer.") == [0, 2]
    assert [n for n, why in got.items() if why == HEAD_REASON] == ["bert.pooler.dense", "classifier"]


def test_first_last_on_bart_keeps_both_stacks_ends():
    m = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64))
    assert [(s, len(b)) for s, b in block_stacks(m)] == [
        ("model.encoder.layers", 3),
        ("model.decoder.layers", 3),
    ]
    got = resolve_fallback(m, "first_last")
    # Before: both kept blocks came from the encoder and the whole decoder ran FP8.
    assert _blocks_kept(got, "model.encoder.layers.") == [0, 2]
    assert _blocks_kept(got, "model.decoder.layers.") == [0, 2]
    assert got["lm_head"] == HEAD_REASON
    assert len(got) == 2 * 6 + 2 * 10 + 1  # encoder block: q,k,v,out,fc1,fc2; decoder adds cross-attention


def test_first_last_on_t5_counts_each_stack_and_refuses_a_short_one():
    m = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                  num_decoder_layers=4, num_heads=2))
    assert [(s, len(b)) for s, b in block_stacks(m)] == [("encoder.block", 2), ("decoder.block", 4)]
    got = resolve_fallback(m, "first_last")
    assert _blocks_kept(got, "encoder.block.") == [0, 1] and _blocks_kept(got, "decoder.block.") == [0, 3]
    assert got["lm_head"] == HEAD_REASON
    notes = FallbackSpec.parse("first_last").explain(m)
    assert notes[:2] == (
        "first:1, last:1: stack encoder.block (2 blocks) keeps encoder.block.0, encoder.block.1",
        "first:1, last:1: stack decoder.block (4 blocks) keeps decoder.block.0, decoder.block.3",
    )
    with pytest.raises(ConfigError, match="asks for 3 blocks but stack 'encoder.block' has 2"):
        resolve_fallback(m, "last:3")


def test_a_misspelt_keyword_lists_the_layers_and_every_spec_keyword():
    from fp8track import apply_fp8

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError) as err:
        apply_fp8(model, "current", bf16_layers="first_and_last", backend="emulated")
    text = str(err.value)
    assert "'first_and_last'" in text and "linear layers: 0, 2" in text
    keywords = text.split("spec keywords: ", 1)[1].split(", ")
    expected = {"none", "first_last", "first:N", "last:N", "re:PATTERN"}
    expected |= {"experts", "router", "shared_experts"}
    assert expected <= set(keywords)
