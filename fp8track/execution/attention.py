"""``nn.MultiheadAttention`` rebuilt on four ``nn.Linear`` projections, so FP8 backends can convert
them and module hooks can see them.

``nn.MultiheadAttention`` keeps its query/key/value projections as one packed Parameter
(``in_proj_weight``) and runs them, and even its ``out_proj`` Linear, through
``F.multi_head_attention_forward`` with ``F.linear`` on the raw weights: no backend can swap a
module in and no forward hook fires. :class:`LinearMultiheadAttention` computes the same function
(same arguments, masks, dropout, ``bias_k``/``bias_v``, ``add_zero_attn``, ``batch_first``,
unbatched inputs, attention weights) with ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` as
``nn.Linear`` modules called as modules; the attention core mirrors
``torch.nn.functional.multi_head_attention_forward`` step by step. In float32 it matches
``nn.MultiheadAttention`` to rounding (the packed GEMM and three separate GEMMs sum in a different
order); ``tests/unit/test_attention.py`` checks it.

Parameters: ``out_proj``'s, ``bias_k``/``bias_v`` and separate ``q/k/v_proj_weight`` (``kdim`` or
``vdim`` differ from ``embed_dim``) keep their identity; the packed ``in_proj_weight`` /
``in_proj_bias`` are split into three new Parameters (build the optimizer after
:func:`fp8track.apply_fp8`, as with any conversion). State dicts saved from
``nn.MultiheadAttention`` load into it (the packed keys are split on load).

The fast paths of ``nn.TransformerEncoderLayer`` (inference only) test ``self_attn``'s attributes;
this module reports ``_qkv_same_embed_dim = False`` so they always take the regular path, which
calls the projections.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LinearMultiheadAttention", "linearize_attention", "multihead_attention_modules"]


def _linear_from(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight``/``bias`` themselves (no copy)."""
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
    lin.weight = weight
    lin.bias = bias
    return lin


def _part(packed: torch.Tensor | None, i: int, n: int) -> nn.Parameter | None:
    if packed is None:
        return None
    return nn.Parameter(packed.detach().chunk(3)[i].clone(), requires_grad=packed.requires_grad)


class LinearMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its four projections as ``nn.Linear`` modules (module docstring).

    Build it with :meth:`from_mha`. Attributes as ``nn.MultiheadAttention``: ``embed_dim``,
    ``kdim``, ``vdim``, ``num_heads``, ``head_dim``, ``dropout``, ``batch_first``,
    ``add_zero_attn``, ``bias_k``, ``bias_v``.
    """

    _qkv_same_embed_dim = False  # keeps nn.TransformerEncoder(Layer)'s fused inference path away
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim, self.kdim, self.vdim = mha.embed_dim, mha.kdim, mha.vdim
        self.num_heads, self.head_dim = mha.num_heads, mha.head_dim
        self.dropout, self.batch_first, self.add_zero_attn = mha.dropout, mha.batch_first, mha.add_zero_attn
        packed_b = mha.in_proj_bias
        if mha._qkv_same_embed_dim:
            ws = [_part(mha.in_proj_weight, i, 3) for i in range(3)]
        else:
            ws = [mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight]
        bs = [_part(packed_b, i, 3) for i in range(3)]
        self.q_proj, self.k_proj, self.v_proj = (_linear_from(w, b) for w, b in zip(ws, bs, strict=True))
        self.out_proj = _linear_from(mha.out_proj.weight, mha.out_proj.bias)
        self.bias_k, self.bias_v = mha.bias_k, mha.bias_v
        self.train(mha.training)
        self._register_load_state_dict_pre_hook(_split_packed_keys)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> LinearMultiheadAttention:
        """The equivalent module for ``mha`` (see the class docstring for which Parameters are kept)."""
        return cls(mha)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward``'s signature and result."""
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if self.batch_first and is_batched:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._attend(
            query,
            key,
            value,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
            is_batched,
        )
        if self.batch_first and is_batched:
            return out.transpose(1, 0), weights
        return out, weights

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
        is_batched: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Mirrors torch.nn.functional.multi_head_attention_forward (torch 2.x) after its checks, with
        # the in- and out-projections called as modules.
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        elif key_padding_mask is not None:
            is_causal = False
        q, k, v, attn_mask = self._heads(query, key, value, key_padding_mask, attn_mask)
        tgt_len, bsz, _ = query.shape
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            if is_causal and attn_mask is None:
                raise RuntimeError("is_causal without attn_mask is not implemented for need_weights")
            out, w = self._weighted(q, k, v, attn_mask, dropout_p, tgt_len, bsz)
            weights = w.view(bsz, self.num_heads, tgt_len, k.size(1))
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                return out.squeeze(1), weights.squeeze(0)
            return out, weights
        out = self._sdpa(q, k, v, attn_mask, dropout_p, is_causal, tgt_len, bsz)
        return (out if is_batched else out.squeeze(1)), None

    def _heads(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The in-projections split into heads (``[bsz * heads, len, head_dim]``), ``bias_k`` /
        ``bias_v`` and ``add_zero_attn`` applied, and the attention mask with the key padding mask
        merged in (additive, ``[bsz * heads, tgt_len, src_len]`` or broadcastable)."""
        tgt_len, bsz, _ = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        src_len = key.shape[0]
        if attn_mask is not None and attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros.to(v.dtype)], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        src_len = k.size(1)
        if key_padding_mask is not None:
            kpm = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, heads, -1, -1)
                .reshape(bsz * heads, 1, src_len)
            )
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        return q, k, v, attn_mask

    def _weighted(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        tgt_len: int,
        bsz: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention with its weights materialised (``need_weights``): ``(output [tgt_len, bsz,
        embed_dim], weights [bsz * heads, tgt_len, src_len])``."""
        q_scaled = q * math.sqrt(1.0 / float(self.head_dim))
        if attn_mask is not None:
            w = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            w = torch.bmm(q_scaled, k.transpose(-2, -1))
        w = F.softmax(w, dim=-1)
        if dropout_p > 0.0:
            w = F.dropout(w, p=dropout_p)
        out = torch.bmm(w, v).transpose(0, 1).reshape(tgt_len * bsz, self.embed_dim)
        return self.out_proj(out).view(tgt_len, bsz, -1), w

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        tgt_len: int,
        bsz: int,
    ) -> torch.Tensor:
        """Attention through ``F.scaled_dot_product_attention``, no weights: the output
        ``[tgt_len, bsz, embed_dim]``."""
        heads, head_dim = self.num_heads, self.head_dim
        src_len = k.size(1)
        if attn_mask is not None:
            attn_mask = (
                attn_mask.unsqueeze(0)
                if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                else (attn_mask.view(bsz, heads, -1, src_len))
            )
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, self.embed_dim)
        return self.out_proj(out).view(tgt_len, bsz, -1)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _split_packed_keys(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: ``nn.MultiheadAttention``'s keys (``in_proj_weight``, ``in_proj_bias``,
    ``q/k/v_proj_weight``) become this module's ``q/k/v_proj.weight`` / ``.bias``."""
    names = ("q_proj", "k_proj", "v_proj")
    for packed, leaf in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        t = state_dict.pop(prefix + packed, None)
        if t is not None:
            for name, part in zip(names, t.chunk(3), strict=True):
                state_dict[f"{prefix}{name}.{leaf}"] = part
    for name in names:
        t = state_dict.pop(f"{prefix}{name}_weight", None)
        if t is not None:
            state_dict[f"{prefix}{name}.weight"] = t


def multihead_attention_modules(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s ``nn.MultiheadAttention`` modules (subclasses included):
    attention whose projections no module hook sees and no backend can convert."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]


def linearize_attention(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """Replace every exact ``nn.MultiheadAttention`` in ``model`` by :class:`LinearMultiheadAttention`.

    Returns:
        ``(replaced, refused)``: ``(name, original module)`` of each replaced module (to undo with
        ``model.set_submodule(name, original)``), and ``{name: reason}`` for attention modules left
        as they are (subclasses, whose forward may differ; the root module itself).
    """
    replaced: list[tuple[str, nn.Module]] = []
    refused: dict[str, str] = {}
    for name in multihead_attention_modules(model):
        mha = model.get_submodule(name)
        if not name:
            refused[name] = "the model itself is an nn.MultiheadAttention: wrap it in a module to convert it"
        elif type(mha) is not nn.MultiheadAttention:
            refused[name] = (
                f"{type(mha).__name__} subclasses nn.MultiheadAttention (its forward may differ); its "
                "projections run through F.multi_head_attention_forward, which no backend converts"
            )
        else:
            model.set_submodule(name, LinearMultiheadAttention.from_mha(mha))
            replaced.append((name, mha))
    return replaced, refused
