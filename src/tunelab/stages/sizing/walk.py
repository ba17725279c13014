"""The forward walk of the memory model: one forward pass, op by op, with autograd's rule for
what it keeps for backward (`Trace`).

An op keeps an input only when the gradient of another input needs it: a linear layer keeps
its input only when its weight trains, a product `a * b` keeps `b` only when `a` needs a
gradient. So LoRA on a frozen base keeps far less than full fine-tuning, and layers before the
first trainable parameter keep almost nothing. Transformer blocks are walked per family
(`llama`, `bert`; mixture-of-experts blocks through `moe_walk`, Swin stages through
`stage_walk`), conv nets feature map by feature map (`resnet`, `convnext`), which also counts
their FLOPs (`conv_flops`). `Trace.run()` returns the saved bytes by group and leaves
`total`, `per_layer`, `blocks` and `recompute` for `memory.estimate_memory`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tunelab.stages.sizing import stage_walk
from tunelab.stages.sizing.loss_memory import loss_token_count
from tunelab.stages.sizing.terms import CONV_FAMILIES, DTYPE_BYTES, Case, ModelFacts

_KEYS = itertools.count(1)  # tensor identities, unique across traces (a block re-traced shares x)


@dataclass(frozen=True)
class _T:
    """A symbolic tensor: element count, bytes per element, whether it needs a gradient."""

    key: int
    numel: int
    size: int
    rg: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.size


class Trace:
    """Walks a forward pass op by op and records the tensors autograd saves for backward."""

    def __init__(self, facts: ModelFacts, case: Case, loss_route: str = "fused"):
        self.f = facts
        self.c = case
        self.loss_route = loss_route
        self.pb = DTYPE_BYTES.get(facts.param_dtype, 4)
        self.autocast = case.precision in ("bf16", "fp16")
        self.cd = 2 if self.autocast else self.pb  # dtype of matmul inputs and outputs
        self.cuda = case.device == "cuda"
        self.saved: dict[int, int] = {}
        self.groups: dict[str, int] = {}
        self._group = "embeddings"

    # tensors
    def new(self, numel: int, size: int, rg: bool) -> _T:
        return _T(next(_KEYS), int(numel), size, rg)

    def save(self, *ts: _T) -> None:
        for t in ts:
            if t.key not in self.saved:
                self.saved[t.key] = t.nbytes
                self.groups[self._group] = self.groups.get(self._group, 0) + t.nbytes

    def save_bytes(self, nbytes: int) -> None:
        self.save(self.new(nbytes, 1, False))

    def group(self, name: str) -> None:
        self._group = name

    @property
    def total(self) -> int:
        return sum(self.saved.values())

    # ops
    def cast(self, x: _T, size: int) -> _T:
        return x if x.size == size else self.new(x.numel, size, x.rg)

    def linear(
        self, x: _T, fan_in: int, fan_out: int, train: str | None, *, outside: bool = False
    ) -> _T:
        """x @ W.T (+ LoRA B(A(dropout(x))) * scale); x has x.numel // fan_in rows.

        A block's linear layer of a 4-bit base (QLoRA; `outside`: the head, never 4-bit) keeps
        only its packed weight for backward and returns x's dtype (bitsandbytes casts back)."""
        rows = x.numel // fan_in
        four_bit = self.f.quant_params > 0 and not outside
        xin = self.cast(x, self.cd) if self.autocast else x
        if train == "weight":
            self.save(xin)  # grad W = g.T @ x
        if self.autocast and x.rg and not four_bit and self.pb != self.cd:
            # the low-precision weight copy (weights already in the compute dtype need none)
            self.save_bytes(fan_in * fan_out * self.cd)
        out_size = self.cd if self.autocast else max(self.pb, x.size if train else self.pb)
        out = self.new(rows * fan_out, x.size if four_bit else out_size, x.rg or train is not None)
        if train == "lora":
            r = self.f.lora_rank
            lora_size = 4 if (self.pb < 4 and not self.autocast) else self.pb
            xa = x if self.autocast else self.cast(x, lora_size)
            if self.f.lora_dropout > 0:
                if xa.rg:
                    self.save(self.new(xa.numel, 1 if self.cuda else xa.size, False))
                xa = self.new(xa.numel, xa.size, xa.rg)
            a_in = self.cast(xa, self.cd) if self.autocast else xa
            if self.autocast and xa.size != 4:
                # peft lifts x to the adapter's fp32 first: autocast's bf16 copy is a new tensor
                a_in = self.new(xa.numel, self.cd, xa.rg)
            self.save(a_in)  # grad A = g.T @ x
            a = self.new(rows * r, self.cd if self.autocast else lora_size, True)
            self.save(a)  # grad B = g.T @ A(x)
            if self.autocast:
                self.save_bytes(r * fan_out * self.cd)
                if xa.rg:
                    self.save_bytes(fan_in * r * self.cd)
        return out

    def rmsnorm(self, x: _T, train: str | None) -> _T:
        """Llama RMSNorm: computed in fp32, `weight * (x * rsqrt(mean(x^2) + eps))`."""
        tokens = x.numel // self.f.hidden
        xf = self.cast(x, 4)
        if x.rg:
            self.save(xf, self.new(tokens, 4, True))  # x and rsqrt
        y = self.cast(self.new(x.numel, 4, x.rg), x.size)
        if train:
            self.save(y)
        return self.new(x.numel, max(self.pb, y.size), x.rg or bool(train))

    def layernorm(self, x: _T, train: str | None) -> _T:
        tokens = x.numel // self.f.hidden
        if x.rg or train:
            self.save(x, self.new(tokens, 4, False), self.new(tokens, 4, False))  # x, mean, rstd
        return self.new(x.numel, max(self.pb, x.size), x.rg or bool(train))

    def dropout(self, x: _T, p: float) -> _T:
        if p <= 0:
            return x
        if x.rg:  # CPU keeps the scaled noise tensor, CUDA a boolean mask
            self.save(self.new(x.numel, 1 if self.cuda else x.size, False))
        return self.new(x.numel, x.size, x.rg)

    def pointwise_saving_input(self, x: _T) -> _T:  # silu, gelu
        if x.rg:
            self.save(x)
        return self.new(x.numel, x.size, x.rg)

    def mul(self, a: _T, b: _T) -> _T:
        if a.rg:
            self.save(b)
        if b.rg:
            self.save(a)
        return self.new(max(a.numel, b.numel), max(a.size, b.size), a.rg or b.rg)

    def add(self, a: _T, b: _T) -> _T:
        return self.new(max(a.numel, b.numel), max(a.size, b.size), a.rg or b.rg)

    # attention
    def attention(self, q: _T, k: _T, v: _T, *, dropout: float, rows: int, s: int) -> _T:
        out = self._attention(q, k, v, dropout=dropout, rows=rows, s=s)
        self.attention_mark = self.total
        return out

    def _attention(self, q: _T, k: _T, v: _T, *, dropout: float, rows: int, s: int) -> _T:
        """Scaled dot-product attention over `rows` rows of `s` tokens; returns [tokens, heads*hd].

        Fused kernels (flash / memory-efficient; CPU flash when there is no dropout) keep q, k, v,
        the output and the log-sum-exp. The math fallback (CPU with dropout) keeps the scaled q and
        k, the softmax, the dropout noise and the dropped probabilities: [rows, heads, s, s] each.
        """
        f, c = self.f, self.c
        heads = f.heads
        rg = q.rg or k.rg or v.rg
        # packed rows run SDPA once per example (tunelab.stages.train.attention): no mask, no repeat
        masked = c.masked and not c.packing
        if f.family == "llama" and f.kv_heads != heads and masked:
            # transformers repeats k and v to every head when there is a mask (no enable_gqa)
            k = self.new(k.numel * heads // f.kv_heads, k.size, k.rg)
            v = self.new(v.numel * heads // f.kv_heads, v.size, v.rg)
        if dropout > 0 and not self.cuda:
            # CPU math path, computed in fp32 whatever the input dtype
            qs, ks, vs = (self.new(t.numel, 4, t.rg) for t in (q, k, v))
            if q.rg:
                self.save(ks)
            if k.rg:
                self.save(qs)
            probs = self.new(rows * heads * s * s, 4, rg)
            if rg:
                self.save(probs)
            probs = self.dropout(probs, dropout)
            if probs.rg:
                self.save(vs)
            if v.rg:
                self.save(probs)
            size = self.cd if self.autocast else max(q.size, v.size)
            return self.new(q.numel, size, rg)  # [b, s, h*d]: a copy of the transposed output
        size = self.cd if self.autocast else max(q.size, k.size, v.size)
        q, k, v = self.cast(q, size), self.cast(k, size), self.cast(v, size)
        out = self.new(q.numel, size, rg)
        if rg:
            self.save(q, k, v, out, self.new(rows * heads * s, 4, False))
            if masked:
                # the boolean mask is converted to q's dtype in every layer
                self.save_bytes(rows * s * s * size)
        if c.packing:
            return self.new(q.numel, size, rg)  # the examples' outputs concatenated: a copy
        return out  # [b, s, h, d] layout: the reshape for o_proj is a view

    # blocks
    def block(self, x: _T, train: dict[str, str]) -> _T:
        return self.bert_block(x, train) if self.f.family == "bert" else self.llama_block(x, train)

    def llama_block(self, x: _T, train: dict[str, str]) -> _T:
        f = self.f
        hd, rows, s = f.head_dim, self.rows, self.s
        h = self.rmsnorm(x, train.get("norm1"))
        q = self.linear(h, f.hidden, f.heads * hd, train.get("q"))
        k = self.linear(h, f.hidden, f.kv_heads * hd, train.get("k"))
        v = self.linear(h, f.hidden, f.kv_heads * hd, train.get("v"))
        # RoPE: q * cos + rotate_half(q) * sin with cos/sin in the stream dtype (kept once, shared)
        q = self.new(q.numel, max(q.size, x.size), q.rg)
        k = self.new(k.numel, max(k.size, x.size), k.rg)
        if (q.rg or k.rg) and not self.rope_saved:
            self.rope_saved = True
            self.save_bytes(2 * self.rows_pos * s * hd * x.size)
        a = self.attention(q, k, v, dropout=0.0, rows=rows, s=s)
        o = self.linear(a, f.heads * hd, f.hidden, train.get("o"))
        x = self.add(x, o)
        h = self.rmsnorm(x, train.get("norm2"))
        if f.moe and getattr(self, "layer", -1) in f.moe["sparse_layers"]:
            from tunelab.stages.sizing.moe_walk import moe_mlp

            return self.add(x, moe_mlp(self, h, train))
        g = self.linear(h, f.hidden, f.intermediate, train.get("gate"))
        u = self.linear(h, f.hidden, f.intermediate, train.get("up"))
        m = self.mul(self.pointwise_saving_input(g), u)
        d = self.linear(m, f.intermediate, f.hidden, train.get("down"))
        return self.add(x, d)

    def bert_block(self, x: _T, train: dict[str, str]) -> _T:
        f = self.f
        q = self.linear(x, f.hidden, f.hidden, train.get("q"))
        k = self.linear(x, f.hidden, f.hidden, train.get("k"))
        v = self.linear(x, f.hidden, f.hidden, train.get("v"))
        a = self.attention(q, k, v, dropout=f.attention_dropout, rows=self.rows, s=self.s)
        o = self.dropout(self.linear(a, f.hidden, f.hidden, train.get("o")), f.hidden_dropout)
        y = self.layernorm(self.add(o, x), train.get("norm1"))
        i = self.pointwise_saving_input(self.linear(y, f.hidden, f.intermediate, train.get("up")))
        d = self.linear(i, f.intermediate, f.hidden, train.get("down"))
        d = self.dropout(d, f.hidden_dropout)
        return self.layernorm(self.add(d, y), train.get("norm2"))

    # conv nets: feature maps [batch, channels, height, width]
    def conv2d(self, x: _T, c_out: int, hw: tuple[int, int], train: str | None, fan_in: int) -> _T:
        """A convolution keeps its input whenever anything of it needs a gradient (one
        backward for input and weight), unlike a linear layer. `fan_in`: the inputs one output
        element multiplies (input channels per group x kernel area)."""
        if x.rg or train:
            self.save(self.cast(x, self.cd) if self.autocast else x)
        out = self.new(self.c.micro_batch * c_out * hw[0] * hw[1], self.cd, x.rg or bool(train))
        self.count_flops(2.0 * out.numel * fan_in, x.rg, train)
        self.largest_map = max(self.largest_map, out.nbytes)
        self.block_map = max(self.block_map, out.nbytes)
        return out

    def count_flops(self, forward: float, input_grad: bool, train: str | None) -> None:
        """A conv net's layer: `forward` FLOPs, and as many again in backward for its input's
        gradient (where it needs one) and for its weight's (where it trains)."""
        self.flops[0] += forward
        self.flops[1] += forward * (int(input_grad) + int(train == "weight"))

    def conv_linear(
        self, x: _T, fan_in: int, fan_out: int, train: str | None, *, outside: bool = False
    ) -> _T:
        """A conv net's linear layer (ConvNeXt's pointwise layers, the head), FLOPs counted;
        a LoRA adapter's two small products cost 2 FLOPs a weight forward, twice that back."""
        rows = x.numel // fan_in
        self.count_flops(2.0 * rows * fan_in * fan_out, x.rg, train)
        if train == "lora":
            lora = 2.0 * rows * self.f.lora_rank * (fan_in + fan_out)
            self.flops[0] += lora
            self.flops[1] += 2 * lora
        return self.linear(x, fan_in, fan_out, train, outside=outside)

    def batchnorm(self, x: _T, channels: int, train: str | None) -> _T:
        if x.rg or train:  # the input, the batch mean and inverse std, the running statistics
            self.save(x, self.new(4 * channels, 4, False))
        return self.new(x.numel, x.size, x.rg or bool(train))

    def relu(self, x: _T) -> _T:
        out = self.new(x.numel, x.size, x.rg)
        if x.rg:
            self.save(out)  # relu's backward reads its output
        return out

    def maxpool(self, x: _T, out_numel: int) -> _T:
        if x.rg:
            self.save(x, self.new(out_numel, 8, False))  # the input and the int64 indices
        return self.new(out_numel, x.size, x.rg)

    def _train(self, path: str) -> str | None:
        return (self.f.conv or {}).get("trains", {}).get(path)

    def resnet(self) -> _T:
        """transformers' ResNet: conv 7x7/2 + BN + ReLU, max pool 3x3/2, stages of basic or
        bottleneck layers (conv + BN (+ ReLU)), a 1x1 conv + BN shortcut where the shape
        changes, the residual added in place and a ReLU, then the average pool."""
        cfg, b, tr = self.f.conv or {}, self.c.micro_batch, self._train
        side = -(-int(cfg["image_size"]) // 2)
        x = self.new(b * int(cfg["num_channels"]) * int(cfg["image_size"]) ** 2, self.pb, False)

        def conv_layer(  # noqa: PLR0913
            x: _T, path: str, c_in: int, c_out: int, hw: tuple[int, int], act: bool, k: int = 3
        ) -> _T:
            x = self.conv2d(x, c_out, hw, tr(f"{path}.convolution"), c_in * k * k)
            x = self.batchnorm(x, c_out, tr(f"{path}.normalization"))
            return self.relu(x) if act else x

        c = int(cfg["embedding_size"])
        x = conv_layer(x, "embedder.embedder", int(cfg["num_channels"]), c, (side, side), True, 7)
        side = -(-side // 2)
        x = self.maxpool(x, b * c * side * side)
        bottleneck = cfg.get("layer_type") == "bottleneck"
        first_stride = 2 if cfg.get("downsample_in_first_stage") else 1
        stages = zip(cfg["hidden_sizes"], cfg["depths"], strict=True)
        for i, (c_out, depth) in enumerate(stages):
            for j in range(depth):
                self.group(f"layer.{len(self.blocks)}")
                before, self.block_map = self.total, x.nbytes
                stride = (first_stride if i == 0 else 2) if j == 0 else 1
                out_side = -(-side // stride)
                path, hw = f"encoder.stages.{i}.layers.{j}", (out_side, out_side)
                h = x
                if bottleneck:
                    r = c_out // int(cfg.get("reduction", 4))
                    in_bottleneck = cfg.get("downsample_in_bottleneck")
                    hw1 = hw if in_bottleneck else (side, side)
                    h = conv_layer(h, f"{path}.layer.0", c, r, hw1, True, 1)
                    h = conv_layer(h, f"{path}.layer.1", r, r, hw, True)
                    h = conv_layer(h, f"{path}.layer.2", r, c_out, hw, False, 1)
                else:
                    h = conv_layer(h, f"{path}.layer.0", c, c_out, hw, True)
                    h = conv_layer(h, f"{path}.layer.1", c_out, c_out, hw, False)
                residual = x
                if c != c_out or stride != 1:
                    residual = conv_layer(x, f"{path}.shortcut", c, c_out, hw, False, 1)
                x = self.relu(self.new(h.numel, h.size, h.rg or residual.rg))
                c, side = c_out, out_side
                self.blocks.append((self.total - before, 0))
                self.per_layer.append(self.total - before)
                self.block_maps.append(self.block_map)
        return self.new(b * c, self.pb, x.rg)  # the average pool keeps nothing

    def convnext(self) -> _T:
        """transformers' ConvNeXt: a patchify conv + LayerNorm, stages of a downsampling
        LayerNorm + conv 2x2/2 and blocks (depthwise conv 7x7, LayerNorm, Linear 4x, GELU, Linear,
        layer scale, residual), then the mean over the map and a LayerNorm."""
        cfg, b, tr = self.f.conv or {}, self.c.micro_batch, self._train
        size = int(cfg["image_size"])
        x = self.new(b * int(cfg["num_channels"]) * size * size, self.pb, False)
        patch = int(cfg.get("patch_size", 4))
        side = size // patch
        c = int(cfg["hidden_sizes"][0])
        x = self.conv2d(
            x,
            c,
            (side, side),
            tr("embeddings.patch_embeddings"),
            int(cfg["num_channels"]) * patch**2,
        )
        x = self._norm(x, c, tr("embeddings.layernorm"))
        stages = zip(cfg["hidden_sizes"], cfg["depths"], strict=True)
        for i, (c_out, depth) in enumerate(stages):
            if i > 0:
                x = self._norm(x, c, tr(f"encoder.stages.{i}.downsampling_layer.0"))
                side //= 2
                x = self.conv2d(
                    x, c_out, (side, side), tr(f"encoder.stages.{i}.downsampling_layer.1"), c * 4
                )  # 2x2, stride 2
            c = int(c_out)
            for j in range(depth):
                self.group(f"layer.{len(self.blocks)}")
                before, self.block_map = self.total, x.nbytes
                path = f"encoder.stages.{i}.layers.{j}"
                h = self.conv2d(x, c, (side, side), tr(f"{path}.dwconv"), 49)  # depthwise 7x7
                h = self._norm(h, c, tr(f"{path}.layernorm"))
                h = self.conv_linear(h, c, 4 * c, tr(f"{path}.pwconv1"))
                if h.rg:
                    self.largest_expanded = max(self.largest_expanded, h.nbytes)
                h = self.pointwise_saving_input(h)  # GELU
                h = self.conv_linear(h, 4 * c, c, tr(f"{path}.pwconv2"))
                if cfg.get("layer_scale_init_value", 1e-6) > 0:
                    scale = tr(f"{path}.layer_scale_parameter")
                    if scale:
                        self.save(h)  # grad of the scale = sum(g * h)
                    h = self.new(h.numel, h.size, h.rg or bool(scale))
                x = self.add(x, h)
                self.blocks.append((self.total - before, 0))
                self.per_layer.append(self.total - before)
                self.block_maps.append(self.block_map)
        pooled = self.new(b * c, self.pb, x.rg)  # mean over the map: keeps nothing
        return self._norm(pooled, c, tr("layernorm"), tokens=b)

    def _norm(self, x: _T, channels: int, train: str | None, tokens: int | None = None) -> _T:
        """A LayerNorm over the channels: the input and per position a mean and an rstd."""
        n = tokens if tokens is not None else x.numel // channels
        if x.rg or train:
            self.save(x, self.new(n, 4, False), self.new(n, 4, False))
        return self.new(x.numel, max(self.pb, x.size), x.rg or bool(train))

    def run_conv(self) -> dict[str, int]:
        """A conv net's forward: its feature maps, then the head on the pooled features."""
        f = self.f
        self.per_layer, self.blocks, self.recompute, self.largest_map = [], [], 0, 0
        self.flops = [0.0, 0.0]  # forward, backward (count_flops)
        # each block's largest map, its input's included: the gradients flowing through it
        self.block_maps: list[int] = []
        self.block_map = 0
        self.largest_expanded = 0  # ConvNeXt's 4x map between its two Linear layers
        self.group("embeddings")
        pooled = self.resnet() if f.family == "resnet" else self.convnext()
        self.group("final")
        self.conv_linear(pooled, f.hidden, max(1, f.num_labels), f.head, outside=True)
        return dict(self.groups)

    # the whole model
    def run(self) -> dict[str, int]:
        f, c = self.f, self.c
        if f.family in CONV_FAMILIES:
            return self.run_conv()
        self.rows, self.s = (1, c.tokens) if c.packing else (c.micro_batch, c.seq_len)
        self.rows_pos = 1
        self.rope_saved = False
        tokens = c.tokens
        ids_bytes = tokens * 8
        if f.stages:  # Swin: the patch grid of the first stage, whatever the case's length
            tokens = stage_walk.first_width(f.stages, c.micro_batch) // f.stages[0]["hidden"]
        self.group("embeddings")
        # with checkpointing, transformers makes the embeddings' output require a gradient
        # (enable_input_require_grads) so that frozen layers pass gradients through
        emb_rg = bool(f.embed) or c.checkpointing
        if f.embed:
            self.save_bytes(ids_bytes * (3 if f.family == "bert" else 1))  # index tensors
        x = self.new(tokens * (f.stages[0]["hidden"] if f.stages else f.hidden), self.pb, emb_rg)
        if f.family == "bert":
            x = self.dropout(self.layernorm(x, f.embed), f.hidden_dropout)
        elif c.checkpointing and not f.embed:
            x = self.new(x.numel, x.size, True)
        per_layer: list[int] = []
        # per block: (bytes its backward holds, bytes held up to its attention core)
        self.blocks: list[tuple[int, int]] = []
        self.recompute = 0
        for i in range(f.layers):
            train = f.layer_training[i] if i < len(f.layer_training) else {}
            self.group(f"layer.{i}")
            before = self.total
            self.layer = i
            if f.stages:
                x = stage_walk.enter_layer(self, i, x, f)
            if c.checkpointing:
                # only the block input is kept; the block runs again during backward
                self.save(x)
                sub = Trace(self.f, c)
                sub.rows, sub.s, sub.rows_pos, sub.rope_saved = self.rows, self.s, 1, True
                sub.layer = i
                out = sub.block(x, train)
                self.recompute = max(self.recompute, sub.total)
                self.blocks.append((sub.total, getattr(sub, "attention_mark", 0)))
                x = self.new(out.numel, out.size, out.rg)
            else:
                self.attention_mark = before
                x = self.block(x, train)
                self.blocks.append((self.total - before, self.attention_mark - before))
            per_layer.append(self.total - before)
        self.f = f
        self.group("final")
        if f.family == "bert":
            pooled_rg = x.rg or bool(f.pooler)
            if f.pooler:
                self.save(x)  # the pooler keeps a view of the last hidden states
            p = self.new(c.micro_batch * f.hidden, self.pb, pooled_rg)
            if pooled_rg:
                self.save(p)  # tanh output
            p = self.dropout(p, f.hidden_dropout)
            self.linear(p, f.hidden, max(1, f.num_labels), f.head, outside=True)
        else:
            # tunelab.stages.train.losses: hidden states gathered at the loss positions before the head
            h = self.rmsnorm(x, f.final_norm)
            n = loss_token_count(c)
            if h.rg:
                self.save_bytes(n * 8)  # the gather's index
            gathered = self.new(n * f.hidden, h.size, h.rg)
            head = f.head or (f.embed if f.tied_embeddings else None)
            if self.loss_route != "fused":  # the fused loss keeps gradients, not its inputs
                self.linear(gathered, f.hidden, f.vocab, head, outside=True)
        self.per_layer = per_layer
        return dict(self.groups)


def conv_flops(facts: ModelFacts, examples: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a conv net's micro-batch of `examples` images of
    `facts.conv["image_size"]`: its convolutions and linear layers, as the walk meets them
    (normalization, activations and pooling, a few % of a ResNet's, are left out)."""
    side = int((facts.conv or {})["image_size"])
    trace = Trace(facts, Case(seq_len=side, micro_batch=max(1, int(examples))))
    trace.run_conv()
    return trace.flops[0], trace.flops[1]
