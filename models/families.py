"""Tiny models of the families people train that carve's first references did
not cover, written for carve's tests the way the popular libraries write them
(not copies of their code): a T5-style encoder-decoder, a Swin-style stage of
shifted-window attention, a MobileNetV3-style network and a GPT-J-style
decoder. Each `forward(*inputs)` returns a scalar loss. reference.py registers
them in its MODELS table (t5, swin, mobilenet, gptj).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- T5: relative position buckets, shift right, cross-attention -------------


def relative_position_bucket(relative, bidirectional, num_buckets, max_distance):
    """T5's bucket of each relative position (memory - query): exact for small
    distances, logarithmic up to max_distance; the decoder's looks back only."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).to(torch.long) * num_buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = num_buckets // 2
    small = relative < exact
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return bucket + torch.where(small, relative, large)


class T5Norm(nn.Module):
    """T5's layer norm: a scale, no mean subtracted, no bias."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class T5Attention(nn.Module):
    def __init__(self, dim, heads, relative_bias=False, bidirectional=True, buckets=8,
                 max_distance=16):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.bidirectional, self.buckets, self.max_distance = bidirectional, buckets, max_distance
        self.relative_attention_bias = nn.Embedding(buckets, heads) if relative_bias else None

    def position_bias(self, tq, tk):
        query = torch.arange(tq, dtype=torch.long)[:, None]
        memory = torch.arange(tk, dtype=torch.long)[None, :]
        bucket = relative_position_bucket(memory - query, self.bidirectional, self.buckets,
                                          self.max_distance)
        return self.relative_attention_bias(bucket).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x, memory=None, bias=None, mask=None):
        b, t, _ = x.shape
        kv = x if memory is None else memory
        s = kv.shape[1]

        def split(y, n):
            return y.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x), t), split(self.k(kv), s), split(self.v(kv), s)
        scores = q @ k.transpose(-1, -2)  # T5 folds the 1/sqrt(d) into its init
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores + mask
        out = (torch.softmax(scores.float(), -1).type_as(scores) @ v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class T5FF(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.wi = nn.Linear(dim, hidden, bias=False)
        self.wo = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class T5EncoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden, first):
        super().__init__()
        self.norm1, self.attn = T5Norm(dim), T5Attention(dim, heads, relative_bias=first)
        self.norm2, self.ff = T5Norm(dim), T5FF(dim, hidden)

    def forward(self, x, bias):
        x = x + self.attn(self.norm1(x), bias=bias)
        return x + self.ff(self.norm2(x))


class T5DecoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden, first):
        super().__init__()
        self.norm1 = T5Norm(dim)
        self.self_attn = T5Attention(dim, heads, relative_bias=first, bidirectional=False)
        self.norm2, self.cross_attn = T5Norm(dim), T5Attention(dim, heads)
        self.norm3, self.ff = T5Norm(dim), T5FF(dim, hidden)

    def forward(self, x, memory, bias, mask):
        x = x + self.self_attn(self.norm1(x), bias=bias, mask=mask)
        x = x + self.cross_attn(self.norm2(x), memory=memory)
        return x + self.ff(self.norm3(x))


class T5Stack(nn.Module):
    """The encoder (memory None) or the decoder: the first layer's relative
    position bias shared by every layer, then the final norm."""

    def __init__(self, layer, dim, heads, hidden, layers):
        super().__init__()
        self.layers = nn.ModuleList(layer(dim, heads, hidden, i == 0) for i in range(layers))
        self.final_norm = T5Norm(dim)

    def forward(self, x, memory=None, mask=None):
        t = x.shape[1]
        first = self.layers[0]
        if memory is None:
            bias = first.attn.position_bias(t, t)
            for layer in self.layers:
                x = layer(x, bias)
        else:
            bias = first.self_attn.position_bias(t, t)
            for layer in self.layers:
                x = layer(x, memory, bias, mask)
        return self.final_norm(x)


class T5(nn.Module):
    """A T5-style encoder-decoder: a shared embedding, relative position
    buckets (bidirectional in the encoder, causal in the decoder, computed in
    the first layer and shared by the rest), the targets shifted right as the
    decoder's input (a slice assignment), cross-attention, and a head tied to
    the embedding (scaled by dim ** -0.5, as T5 does) or untied."""

    def __init__(self, vocab_size=64, dim=32, heads=4, hidden=64, layers=2, tie=True,
                 decoder_start=0):
        super().__init__()
        self.dim, self.tie, self.start = dim, tie, decoder_start
        self.shared = nn.Embedding(vocab_size, dim)
        self.encoder = T5Stack(T5EncoderLayer, dim, heads, hidden, layers)
        self.decoder = T5Stack(T5DecoderLayer, dim, heads, hidden, layers)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.lm_head.weight = self.shared.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=dim ** -0.5)

    def shift_right(self, ids):
        shifted = torch.zeros_like(ids)
        shifted[:, 1:] = ids[:, :-1]
        shifted[:, 0] = self.start
        return shifted.masked_fill(shifted == -100, 0)

    def forward(self, input_ids, targets):
        t = input_ids.shape[1]
        memory = self.encoder(self.shared(input_ids))
        mask = torch.triu(torch.full((t, t), -1e9), 1)
        y = self.decoder(self.shared(self.shift_right(targets)), memory, mask)
        if self.tie:
            y = y * self.dim ** -0.5
        logits = self.lm_head(y)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- Swin: shifted windows, the window mask, relative position bias -----------


def window_partition(x, w):
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)


def window_reverse(windows, w, h, wd):
    c = windows.shape[-1]
    b = windows.shape[0] // ((h // w) * (wd // w))
    x = windows.view(b, h // w, wd // w, w, w, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, wd, c)


class WindowAttention(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads, self.window = heads, window
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
        index = (rel[:, :, 0] + window - 1) * (2 * window - 1) + rel[:, :, 1] + window - 1
        self.register_buffer("relative_position_index", index, persistent=False)

    def forward(self, x, mask=None):
        n, t, c = x.shape  # n windows of t tokens
        qkv = self.qkv(x).reshape(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        attn = attn + bias.reshape(t, t, -1).permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(n // nw, nw, self.heads, t, t) + mask[None, :, None]
            attn = attn.view(n, self.heads, t, t)
        out = torch.softmax(attn, -1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, c))


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, window, shift, size):
        super().__init__()
        self.window, self.shift, self.size = window, shift, size
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if shift:
            # Which region of the shifted image each position came from: tokens
            # of a window that wrapped around attend only within their region.
            img = torch.zeros(1, size, size, 1)
            count = 0
            spans = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
            for hs in spans:
                for ws in spans:
                    img[:, hs, ws, :] = count
                    count += 1
            regions = window_partition(img, window).squeeze(-1)
            mask = regions[:, None, :] - regions[:, :, None]
            mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
            self.register_buffer("attn_mask", mask, persistent=False)
        else:
            self.attn_mask = None

    def forward(self, x):
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = self.attn(window_partition(y, self.window), self.attn_mask)
        y = window_reverse(y, self.window, h, w)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    """A Swin-style stage on 16x16 images: 2x2 patches embedded to an 8x8 grid,
    a block of window attention (4x4 windows) and one of shifted windows
    (torch.roll by 2, the mask of the regions a wrapped window mixes), each
    with its relative position bias table, then a classifier."""

    def __init__(self, dim=16, heads=2, window=4, num_classes=10, image=16, patch=2):
        super().__init__()
        size = image // patch
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm = nn.LayerNorm(dim)
        self.blocks = nn.ModuleList([SwinBlock(dim, heads, window, 0, size),
                                     SwinBlock(dim, heads, window, window // 2, size)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images, targets):
        x = self.norm(self.patch(images).permute(0, 2, 3, 1))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean((1, 2))), targets)


# --- MobileNetV3: depthwise convolutions, Hardswish, squeeze-excitation -------


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduced):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, reduced, 1)
        self.fc2 = nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin, expand, cout, stride, se):
        super().__init__()
        self.residual = stride == 1 and cin == cout
        layers = [nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish(),
                  nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False),
                  nn.BatchNorm2d(expand), nn.Hardswish()]
        if se:
            layers.append(SqueezeExcite(expand, max(4, expand // 4)))
        layers += [nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV3(nn.Module):
    """A MobileNetV3-style network on 16x16 images: a Hardswish stem, inverted
    residuals with depthwise convolutions and squeeze-excitation gated by
    Hardsigmoid, a Hardswish classifier."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(8, 16, 8, 1, True),
                                    InvertedResidual(8, 24, 12, 2, True),
                                    InvertedResidual(12, 24, 12, 1, False))
        self.classifier = nn.Sequential(nn.Linear(12, 32), nn.Hardswish(),
                                        nn.Linear(32, num_classes))

    def forward(self, images, targets):
        x = self.blocks(self.stem(images))
        return F.cross_entropy(self.classifier(x.mean((2, 3))), targets)


# --- GPT-J: parallel attention and MLP, rotary by interleaved pairs -----------


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def duplicate_interleave(m):
    """[T, n] -> [T, 2n], each column twice in a row (GPT-J's tables)."""
    rows = m.shape[0]
    return m.view(-1, 1).repeat(1, 2).view(rows, -1)


class GPTJBlock(nn.Module):
    def __init__(self, dim, heads, rotary_dim):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = heads, dim // heads, rotary_dim
        self.ln = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.fc_in = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def rotary(self, x, sin, cos):
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        rot = rot * cos + rotate_every_two(rot) * sin
        return torch.cat([rot, rest], dim=-1)

    def forward(self, x, sin, cos, mask):
        b, t, c = x.shape
        h = self.ln(x)

        def split(y):
            return y.view(b, t, self.heads, self.head_dim)

        q = self.rotary(split(self.q(h)), sin, cos).transpose(1, 2)
        k = self.rotary(split(self.k(h)), sin, cos).transpose(1, 2)
        v = split(self.v(h)).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask
        attn = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, c)
        mlp = self.fc_out(F.gelu(self.fc_in(h), approximate="tanh"))
        return x + self.out(attn) + mlp  # attention and MLP in parallel, one norm


class GPTJ(nn.Module):
    """A GPT-J-style decoder: each block runs attention and the MLP side by
    side from one LayerNorm, rotary embeddings on the first rotary_dim of each
    head by interleaved pairs (tables built with repeat, a Tile), an untied
    head with a bias."""

    def __init__(self, vocab_size=64, dim=32, heads=4, layers=2, rotary_dim=4):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.wte = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(GPTJBlock(dim, heads, rotary_dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, input_ids, targets):
        t = input_ids.shape[1]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rotary_dim, 2).float()
                                    / self.rotary_dim))
        angles = torch.einsum("i,j->ij", torch.arange(t).float(), inv_freq)
        sin = duplicate_interleave(torch.sin(angles))[None, :, None, :]
        cos = duplicate_interleave(torch.cos(angles))[None, :, None, :]
        mask = torch.triu(torch.full((t, t), -1e9), 1)
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x, sin, cos, mask)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# name -> (constructor taking seq and config overrides, input specs as
# (name, shape, kind, high) with "B" the batch and "T" the sequence length)
TOKENS = [("input_ids", ("B", "T"), "index", 64), ("targets", ("B", "T"), "index", 64)]
IMAGES = [("images", ("B", 3, 16, 16), "float", 0), ("targets", ("B",), "index", 10)]
MODELS = {
    "t5": (lambda seq, **kw: T5(**kw), TOKENS),
    "t5_untied": (lambda seq, **kw: T5(tie=False, **kw), TOKENS),
    "swin": (lambda seq, **kw: Swin(**kw), IMAGES),
    "mobilenet": (lambda seq, **kw: MobileNetV3(**kw), IMAGES),
    "gptj": (lambda seq, **kw: GPTJ(**kw), TOKENS),
}
