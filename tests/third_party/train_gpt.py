"""A training script of the nanoGPT kind, as users bring them: a plain PyTorch loop, gradient
accumulation, ``torchrun`` DDP, configured by ``--key=value`` flags that override module-level
globals (nanoGPT's ``configurator.py`` convention). It is written in the shape of Andrej Karpathy's
nanoGPT ``train.py`` (MIT) for fp8track's tests; nothing here knows fp8track except the lines marked
``# fp8track`` (the README shows them as a diff: the integration a user adds).

    python train_gpt.py --max_iters=40 --recipe=current
    torchrun --standalone --nproc_per_node=2 train_gpt.py --max_iters=20
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8track  # fp8track

# -----------------------------------------------------------------------------
# default config values
out_dir = "out"
max_iters = 40
eval_interval = 10
eval_iters = 4
batch_size = 8
block_size = 32
gradient_accumulation_steps = 2
n_layer = 2
n_head = 2
n_embd = 32
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 5
grad_clip = 1.0
seed = 1337
backend = "gloo"
mlflow_uri = ""  # log to MLflow (a tracking URI) when set
run_name = "gpt"
recipe = "delayed"  # fp8track: bf16 (the control), delayed, current, mxfp8, ...
bf16_layers = "none"  # fp8track
control = ""  # fp8track: the BF16 control run (a run directory or mlflow:<run id>)
every_n_steps = 5  # fp8track
# -----------------------------------------------------------------------------
# nanoGPT's configurator: --key=value overrides a global of the same name and type
for arg in sys.argv[1:]:
    assert arg.startswith("--") and "=" in arg, f"expected --key=value, got {arg}"
    key, val = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    cur = globals()[key]
    globals()[key] = type(cur)(val) if not isinstance(cur, str) else val


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# data: this file's own text, bytes as tokens (no download)
data = torch.frombuffer(bytearray(open(__file__, "rb").read() * 8), dtype=torch.uint8).long()
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    torch.distributed.init_process_group(backend=backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gradient_accumulation_steps //= world
else:
    rank, world = 0, 1
master_process = rank == 0
torch.manual_seed(seed + rank)


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i : i + block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


torch.manual_seed(seed)  # the same initial weights on every rank
model = GPT(vocab_size=256)
torch.manual_seed(seed + rank)
report = fp8track.apply_fp8(model, recipe, bf16_layers=bf16_layers)  # fp8track
raw_model = model
if ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=learning_rate, betas=(0.9, 0.95))


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.stack([model(*get_batch(split)) for _ in range(eval_iters)])
        out[split] = losses.mean().item()
    model.train()
    return out


if master_process and mlflow_uri:
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.start_run(run_name=run_name)
    mlflow.log_params({"recipe": recipe, "bf16_layers": bf16_layers, "max_iters": max_iters})
monitor = fp8track.Monitor(
    model,
    {"every_n_steps": every_n_steps},
    apply_report=report,  # fp8track
    control=control or None,  # fp8track
    log_dir=os.path.join(out_dir, "fp8track"),
).attach()  # fp8track
for it in range(max_iters):
    for g in optimizer.param_groups:
        g["lr"] = get_lr(it)
    if it % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if mlflow_uri:
            mlflow.log_metric("val/loss", losses["val"], step=it)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(*get_batch("train")) / gradient_accumulation_steps
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    monitor.step(loss=loss * gradient_accumulation_steps)  # fp8track (the un-normalised loss)
    optimizer.zero_grad(set_to_none=True)
    if master_process and mlflow_uri:
        mlflow.log_metric("train/loss", loss.item() * gradient_accumulation_steps, step=it)
monitor.close()  # fp8track
if master_process:
    print(f"fp8track run: {monitor.run_dir}")
    if mlflow_uri:
        mlflow.end_run()
if ddp:
    torch.distributed.destroy_process_group()
