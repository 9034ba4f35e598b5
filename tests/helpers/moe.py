"""Tiny mixture-of-experts models built from Hugging Face configs (random weights, no download).

Every family fp8track supports, at sizes that train in milliseconds: ``H`` hidden, ``E`` experts,
``K`` routed experts per token. :data:`DIMS` gives each family's projection widths for independent
FLOP counts (``reference_flops``).
"""

from __future__ import annotations

import warnings

import torch

H, E, K, VOCAB, LAYERS = 32, 4, 2, 64, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FUSED_FAMILIES = ("mixtral", "qwen3moe", "olmoe", "qwen2moe", "gptoss", "dsv3", "phimoe")
ALL_FAMILIES = (*FUSED_FAMILIES, "llama4", "switch")


def tiny_moe(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny ``name`` model (one of :data:`ALL_FAMILIES`) in float32, training mode."""
    import transformers as tf

    torch.manual_seed(seed)
    c = {**COMMON, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "mixtral":
            m = tf.MixtralForCausalLM(tf.MixtralConfig(**c, num_local_experts=E, num_experts_per_tok=K))
        elif name == "qwen3moe":
            m = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**c, num_experts=E, num_experts_per_tok=K,
                                                         moe_intermediate_size=16, head_dim=8))
        elif name == "olmoe":
            m = tf.OlmoeForCausalLM(tf.OlmoeConfig(**c, num_experts=E, num_experts_per_tok=K))
        elif name == "qwen2moe":
            m = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**c, num_experts=E, num_experts_per_tok=K,
                                                         moe_intermediate_size=16,
                                                         shared_expert_intermediate_size=32))
        elif name == "gptoss":
            m = tf.GptOssForCausalLM(
                tf.GptOssConfig(
                    **c,
                    num_local_experts=E,
                    num_experts_per_tok=K,
                    head_dim=8,
                    layer_types=["full_attention"] * c["num_hidden_layers"],
                )
            )
        elif name == "dsv3":
            m = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
                **{**c, "num_key_value_heads": 4}, n_routed_experts=E, num_experts_per_tok=K,
                moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1))
        elif name == "phimoe":
            m = tf.PhimoeForCausalLM(tf.PhimoeConfig(**c, num_local_experts=E, num_experts_per_tok=K))
        elif name == "llama4":
            m = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**c, num_local_experts=E, num_experts_per_tok=1,
                                                         intermediate_size_mlp=64, head_dim=8))
        elif name == "switch":
            m = tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
                vocab_size=VOCAB, d_model=H, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                num_experts=E, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1,
                decoder_start_token_id=0, pad_token_id=0))
        else:
            raise ValueError(name)
    return m.float().train()


def forward_loss(model: torch.nn.Module, name: str, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch of token ids ``[B, T]`` (labels = inputs)."""
    if name == "switch":
        return model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    return model(ids, labels=ids).loss


def batch(seed: int, b: int = 2, t: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (b, t), generator=g)
