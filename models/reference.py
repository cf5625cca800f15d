"""Tiny PyTorch reference models whose forward returns a scalar training loss."""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


class MLP(nn.Module):
    """Two hidden Linear+ReLU layers and a classifier head."""

    def __init__(self, in_features=32, hidden=64, num_classes=10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x, targets):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return F.cross_entropy(self.head(h), targets)


# ---------------------------------------------------------------------------
# GPT-2 style decoder
# ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tie_weights: bool = True
    gelu_tanh: bool = False
    # The causal mask added to the scores as Hugging Face builds it: 0 on and
    # below the diagonal, finfo(float32).min above (not masked_fill's -inf).
    additive_mask: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        tril = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.additive = cfg.additive_mask
        if self.additive:
            m = torch.full((cfg.block_size, cfg.block_size), torch.finfo(torch.float32).min)
            self.register_buffer("bias", m.triu(1).view(1, 1, cfg.block_size, cfg.block_size))
        else:
            self.register_buffer("bias", tril.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        B, T, C = x.size()
        hd = self.n_embd // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if self.additive:
            att = att + self.bias[:, :, :T, :T]
        else:
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.approximate = "tanh" if cfg.gelu_tanh else "none"

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg=GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # One Parameter object under two names: named_parameters() reports
            # it once, as "wte.weight".
            self.lm_head.weight = self.wte.weight
        self.apply(_init_transformer)

    def forward(self, input_ids, targets):
        B, T = input_ids.size()
        pos = torch.arange(0, T, dtype=torch.long, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------
# Llama style decoder
# ---------------------------------------------------------------------------


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_heads % cfg.n_kv_heads == 0
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def _repeat_kv(self, x):
        B, H, T, D = x.shape
        rep = self.n_heads // self.n_kv_heads
        return x[:, :, None, :, :].expand(B, H, rep, T, D).reshape(B, H * rep, T, D)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k = self._repeat_kv(k)
        v = self._repeat_kv(v)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.wo(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg=LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        )
        freqs = torch.outer(torch.arange(cfg.block_size).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [Tmax, head_dim]
        self.register_buffer("rope_cos", emb.cos())
        self.register_buffer("rope_sin", emb.sin())
        tril = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("mask", tril.view(1, 1, cfg.block_size, cfg.block_size))
        self.apply(_init_transformer)

    def forward(self, input_ids, targets):
        T = input_ids.size(1)
        cos = self.rope_cos[:T]
        sin = self.rope_sin[:T]
        mask = self.mask[:, :, :T, :T]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------
# Mixture of experts: a Mixtral-style decoder and the routed block's forms
# ---------------------------------------------------------------------------


@dataclass
class MixtralConfig(LlamaConfig):
    num_experts: int = 4
    top_k: int = 2
    # "before": softmax over all experts, then top-k, renormalized (Mixtral);
    # "after": top-k of the router's logits, then softmax over those k.
    softmax: str = "before"
    # Tokens an expert takes at most, as a factor of its even share
    # (top_k * tokens / num_experts); 0: no limit. Tokens over it are dropped
    # in order (first choices of every token first, as GShard orders them).
    capacity_factor: float = 0.0
    # The weight of the load-balancing loss (Switch Transformer's
    # E * sum_e f_e * P_e over top-k choices) added to the loss; 0: none.
    aux_loss_coef: float = 0.0
    # "routed": per expert, torch.where on the expert's mask, the tokens
    # gathered, the expert, index_add_ back (Mixtral's reference code);
    # "dense": one_hot dispatch and combine tensors and einsum (GShard).
    form: str = "routed"


class SparseMoE(nn.Module):
    """A sparse mixture-of-experts feed-forward block of SwiGLU experts.

    forward returns (output, auxiliary loss): the block written the way MoE
    layers are written in PyTorch, with data-dependent routing (torch.where)
    in the routed form."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg) for _ in range(cfg.num_experts))

    def _route(self, x):
        """(top-k weights [N, k], selected experts [N, k], router probabilities [N, E])."""
        cfg = self.cfg
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1)
        if cfg.softmax == "before":
            weights, selected = torch.topk(probs, cfg.top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
        else:
            top, selected = torch.topk(logits, cfg.top_k, dim=-1)
            weights = F.softmax(top, dim=-1)
        return weights, selected, probs

    # The token count the capacity is computed from; None: the tokens of the
    # forward pass. A traced export bakes the capacity in as a constant of the
    # export's token count; setting this reproduces that on other batches.
    capacity_tokens = None

    def _choices(self, selected, n):
        """[N, k, E] one-hot choices, without those over an expert's capacity."""
        cfg = self.cfg
        onehot = F.one_hot(selected, cfg.num_experts)
        if cfg.capacity_factor <= 0:
            return onehot
        tokens = self.capacity_tokens or n
        capacity = max(1, int(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts))
        slot_major = onehot.permute(1, 0, 2).reshape(cfg.top_k * n, cfg.num_experts)
        position = torch.cumsum(slot_major, dim=0) - 1
        keep = (position < capacity) & (slot_major > 0)
        return keep.long().reshape(cfg.top_k, n, cfg.num_experts).permute(1, 0, 2)

    def _aux_loss(self, choices, probs):
        cfg = self.cfg
        fraction = choices.float().sum(1).mean(0) / cfg.top_k  # [E]
        return cfg.num_experts * (fraction * probs.mean(0)).sum()

    def forward(self, x):
        cfg = self.cfg
        B, T, D = x.shape
        x = x.reshape(-1, D)
        n = x.shape[0]
        weights, selected, probs = self._route(x)
        choices = self._choices(selected, n)  # [N, k, E]
        if cfg.form == "routed":
            out = torch.zeros_like(x)
            expert_mask = choices.permute(2, 1, 0)  # [E, k, N]
            for e, expert in enumerate(self.experts):
                slot, token = torch.where(expert_mask[e])
                rows = x[None, token].reshape(-1, D)
                y = expert(rows) * weights[token, slot, None]
                out.index_add_(0, token, y)
        else:
            combine = (choices.float() * weights.unsqueeze(-1)).sum(1)  # [N, E]
            outs = torch.stack([expert(x) for expert in self.experts], 1)  # [N, E, D]
            out = torch.einsum("ne,ned->nd", combine, outs)
        aux = self._aux_loss(choices, probs) if cfg.aux_loss_coef > 0 else x.new_zeros(())
        return out.reshape(B, T, D), aux


class MixtralBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.block_sparse_moe = SparseMoE(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        y, aux = self.block_sparse_moe(self.ffn_norm(x))
        return x + y, aux


class Mixtral(Llama):
    """The Llama decoder (RMSNorm, rotary, grouped-query attention) with a
    sparse mixture of experts in place of every feed-forward block."""

    def __init__(self, cfg=MixtralConfig()):
        super().__init__(cfg)
        self.layers = nn.ModuleList([MixtralBlock(cfg) for _ in range(cfg.n_layer)])
        self.apply(_init_transformer)

    def forward(self, input_ids, targets):
        T = input_ids.size(1)
        cos = self.rope_cos[:T]
        sin = self.rope_sin[:T]
        mask = self.mask[:, :, :T, :T]
        x = self.tok_embeddings(input_ids)
        aux = 0.0
        for layer in self.layers:
            x, a = layer(x, cos, sin, mask)
            aux = aux + a
        logits = self.output(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if self.cfg.aux_loss_coef > 0:
            loss = loss + self.cfg.aux_loss_coef * aux
        return loss


# ---------------------------------------------------------------------------
# BERT style encoder with a masked-LM head
# ---------------------------------------------------------------------------


@dataclass
class BertConfig:
    vocab_size: int = 64
    max_position: int = 16
    type_vocab_size: int = 2
    n_layer: int = 2
    hidden: int = 32
    n_head: int = 2
    intermediate: int = 64
    ln_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_position).unsqueeze(0)
        )

    def forward(self, input_ids, token_type_ids):
        T = input_ids.size(1)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(self.position_ids[:, :T])
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.hidden // cfg.n_head
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def _heads(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, ext_mask):
        B, T, C = x.shape
        q = self._heads(self.query(x))
        k = self._heads(self.key(x))
        v = self._heads(self.value(x))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = F.softmax(scores + ext_mask, dim=-1)
        return (probs @ v).permute(0, 2, 1, 3).contiguous().view(B, T, C)


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.attention_output = nn.Linear(cfg.hidden, cfg.hidden)
        self.attention_norm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.intermediate = nn.Linear(cfg.hidden, cfg.intermediate)
        self.output = nn.Linear(cfg.intermediate, cfg.hidden)
        self.output_norm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)

    def forward(self, x, ext_mask):
        x = self.attention_norm(x + self.attention_output(self.attention(x, ext_mask)))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertMLMHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, x):
        return self.decoder(self.LayerNorm(F.gelu(self.dense(x))))


class Bert(nn.Module):
    def __init__(self, cfg=BertConfig()):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.n_layer)])
        self.mlm = BertMLMHead(cfg)
        self.apply(_init_transformer)

    def forward(self, input_ids, token_type_ids, attention_mask, targets):
        ext_mask = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, ext_mask)
        logits = self.mlm(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------
# ResNet-18
# ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, in_ch, out_ch, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, width=8, num_classes=10, layers=(2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        in_ch = width
        for i, n in enumerate(layers):
            out_ch = width * 2**i
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(in_ch, out_ch, stride)]
            blocks += [BasicBlock(out_ch, out_ch, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            in_ch = out_ch
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x, targets):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return F.cross_entropy(self.fc(x), targets)


# ---------------------------------------------------------------------------
# Vision Transformer
# ---------------------------------------------------------------------------


class ViT(nn.Module):
    """A Vision Transformer as torchvision writes it (ViT-B/16 scaled down): a
    Conv2d patch embedding (kernel = stride = patch), a learned class token
    prepended to the patches, a learned position embedding, pre-norm encoder
    layers (PyTorch's nn.TransformerEncoderLayer with norm_first and GELU), a
    final LayerNorm and a linear head on the class token."""

    def __init__(self, image=32, patch=8, width=32, heads=4, layers=2, mlp=64, num_classes=10,
                 dropout=0.0):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, width, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        seq = (image // patch) ** 2 + 1
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, width).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(width, heads, mlp, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(width)
        self.heads = nn.Linear(width, num_classes)

    def forward(self, images, targets):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)  # [B, patches, width]
        cls = self.class_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embedding
        x = self.ln(self.encoder(x))[:, 0]
        return F.cross_entropy(self.heads(x), targets)


# ---------------------------------------------------------------------------
# Shared initialization and the model registry
# ---------------------------------------------------------------------------


def _init_transformer(module):
    """GPT-2 style init: N(0, 0.02) weights, zero biases, unit norms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


@dataclass(frozen=True)
class InputSpec:
    """One model input: `shape` holds ints and the symbols "B" (batch), "T" (seq)."""

    name: str
    shape: tuple
    kind: str = "index"  # "float" (normal), "index" (uniform in [0, high)), "mask"
    high: int = 0


def _tokens(*extra):
    return [InputSpec("input_ids", ("B", "T"), high=64), *extra,
            InputSpec("targets", ("B", "T"), high=64)]


def _gpt(seq, **kw):
    kw.setdefault("block_size", max(16, seq))
    return GPT(GPTConfig(**kw))


def _llama(seq, **kw):
    kw.setdefault("block_size", max(16, seq))
    return Llama(LlamaConfig(**kw))


def _mixtral(seq, **kw):
    kw.setdefault("block_size", max(16, seq))
    return Mixtral(MixtralConfig(**kw))


def _bert(seq, **kw):
    kw.setdefault("max_position", max(16, seq))
    return Bert(BertConfig(**kw))


# name -> (constructor taking seq and config overrides, input specs)
MODELS = {
    "mlp": (
        lambda seq, **kw: MLP(**kw),
        [InputSpec("x", ("B", 32), "float"), InputSpec("targets", ("B",), high=10)],
    ),
    "gpt": (_gpt, _tokens()),
    "gpt_untied": (lambda seq, **kw: _gpt(seq, tie_weights=False, **kw), _tokens()),
    "gpt_tanh": (lambda seq, **kw: _gpt(seq, gelu_tanh=True, **kw), _tokens()),
    "gpt_hfmask": (lambda seq, **kw: _gpt(seq, additive_mask=True, **kw), _tokens()),
    "llama": (_llama, _tokens()),
    "mixtral": (_mixtral, _tokens()),
    "bert": (
        _bert,
        _tokens(
            InputSpec("token_type_ids", ("B", "T"), high=2),
            InputSpec("attention_mask", ("B", "T"), "mask"),
        ),
    ),
    "resnet18": (
        lambda seq, **kw: ResNet18(**kw),
        [InputSpec("images", ("B", 3, 32, 32), "float"),
         InputSpec("targets", ("B",), high=10)],
    ),
    "vit": (
        lambda seq, **kw: ViT(**kw),
        [InputSpec("images", ("B", 3, 32, 32), "float"),
         InputSpec("targets", ("B",), high=10)],
    ),
}

# The families of models/families.py (T5, Swin, MobileNetV3, GPT-J).
import families  # noqa: E402 (models/ is on the path wherever reference is)

for _name, (_ctor, _specs) in families.MODELS.items():
    MODELS[_name] = (_ctor, [InputSpec(n, s, k, h) for n, s, k, h in _specs])

# Models exported by "all"; the gpt variants are available by name.
DEFAULT_MODELS = ["mlp", "gpt", "llama", "bert", "resnet18"]


def _example_input(spec, batch, seq, gen):
    shape = [{"B": batch, "T": seq}.get(d, d) for d in spec.shape]
    if spec.kind == "float":
        return torch.randn(shape, generator=gen)
    if spec.kind == "mask":
        # Ones, with a padded tail on every other row so that the mask matters.
        m = torch.ones(shape, dtype=torch.int64)
        m[::2, shape[1] * 3 // 4 :] = 0
        return m
    return torch.randint(0, spec.high, shape, generator=gen, dtype=torch.int64)


def _adapt_specs(specs, config):
    """The input specs of a model built with `config` overrides: a vocabulary or
    class count sets the range of the index inputs, in_features the width of x."""
    out = []
    for spec in specs:
        if spec.name in ("input_ids", "targets") and "vocab_size" in config:
            spec = replace(spec, high=config["vocab_size"])
        elif spec.name == "targets" and "num_classes" in config:
            spec = replace(spec, high=config["num_classes"])
        elif spec.name == "x" and "in_features" in config:
            spec = replace(spec, shape=("B", config["in_features"]))
        out.append(spec)
    return out


def build(name, batch=4, seq=16, seed=0, config=None):
    """Returns (model, example_inputs, input_names) for a registered model.

    Parameters are initialized from `seed`; the example inputs come from an
    independent generator seeded with `seed + 1`. `config` overrides fields of
    the model's config (e.g. {"n_layer": 4, "n_embd": 256} for gpt) or
    constructor arguments (mlp, resnet18); without it the model is the default.
    """
    if name not in MODELS:
        raise KeyError(f"unknown model '{name}'; known: {', '.join(MODELS)}")
    ctor, specs = MODELS[name]
    config = dict(config or {})
    torch.manual_seed(seed)
    model = ctor(seq, **config)
    specs = _adapt_specs(specs, config)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = tuple(_example_input(s, batch, seq, gen) for s in specs)
    return model, inputs, [s.name for s in specs]
