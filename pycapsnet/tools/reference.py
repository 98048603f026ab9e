"""A PyTorch-autograd CapsNet of the same architecture -- the *reference*, never the library's
training path: the first thing to compare the hand-written backward with.  Needs PyTorch (this
module is not imported by ``import pycapsnet``).

Written the way readable_capsnet writes one: nn-style convolutions (F.conv2d, NCHW) and an einsum
routing loop, with every gradient left to autograd.  The EM network is formulated independently of
pycapsnet's too: windows by Tensor.unfold, each child's assignments normalised by index_add and
scatter_reduce over an explicit slot -> child index rather than by im2col/col2im, "final" as a
detach of the last assignments.  It reads pycapsnet's parameters (same names,
same layouts: conv weights (kh, kw, C_in, C_out), W_ij (P|1, T, J, D, K)), so the tests use it as an
independent oracle for the hand-written backward, and the benchmark compares speed and memory with
identical weights and batches.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    # the same exact form as pycapsnet (finite at 0); autograd differentiates sqrt at n2 > 0
    return s * (n2.sqrt() / (1 + n2))


def exp_squash(s, dim=-1):
    """Efficient-CapsNet's squash (1 - e^-|s|) s / |s|, as its paper writes it (s != 0)."""
    norm = s.norm(dim=dim, keepdim=True)
    return s * (1 - torch.exp(-norm)) / norm


def attention_route(u_hat, bias):
    """Self-attention routing on û (N, I, J, D) with the bias (I, J), Efficient-CapsNet's squash on the output."""
    scores = torch.einsum("nijd,njd->nij", u_hat, u_hat.sum(1)) / u_hat.shape[-1] ** 0.5
    c = torch.softmax(scores, dim=2) + bias
    return exp_squash(torch.einsum("nij,nijd->njd", c, u_hat))


class AutogradCapsNet:
    """Functional CapsNet over a dict of leaf tensors ``params`` (requires_grad=True)."""

    def __init__(self, config, params: dict, device="cpu", dtype=torch.float32):
        self.cfg = config
        self.params = {k: torch.as_tensor(np.asarray(v), dtype=dtype, device=device).requires_grad_(True)
                       for k, v in params.items()}
        self.device, self.dtype = device, dtype

    @classmethod
    def from_model(cls, model, device="cpu", dtype=torch.float32):
        return cls(model.config, model.state_dict(), device, dtype)

    def parameters(self):
        return list(self.params.values())

    def forward(self, x, y=None):
        """x (N, C, H, W); y labels or None.  Returns (v, class scores, reconstruction)."""
        cfg, p = self.cfg, self.params
        h = F.relu(self.conv(x, "conv1", cfg.conv_stride))
        v, lengths = self.matrix_capsules(h) if cfg.routing == "em" else self.vector_capsules(h)
        n = v.shape[0]
        chosen = y if y is not None else lengths.argmax(1)
        mask = F.one_hot(chosen, cfg.n_classes).to(v.dtype)
        z = (v * mask[..., None]).reshape(n, -1)
        n_dec = len(cfg.decoder_hidden) + 1
        for k in range(1, n_dec + 1):
            z = z @ p[f"decoder{k}.W"] + p[f"decoder{k}.b"]
            z = F.relu(z) if k < n_dec else torch.sigmoid(z)
        return v, lengths, z.reshape(n, *cfg.input_shape)

    def conv(self, t, name, stride, depthwise=False):
        p = self.params
        if depthwise:  # W (k, k, C): one kernel per channel, a grouped convolution of C groups
            W = p[name + ".W"]
            return F.conv2d(t, W.permute(2, 0, 1).unsqueeze(1), p[name + ".b"], stride=stride, groups=W.shape[2])
        return F.conv2d(t, p[name + ".W"].permute(3, 2, 0, 1), p[name + ".b"], stride=stride)

    def vector_capsules(self, h):
        """Dynamic or self-attention routing: (v (N, J, D), |v| (N, J))."""
        cfg, p = self.cfg, self.params
        s = self.conv(h, "primary", cfg.primary_stride)               # (N, T*K, H2, W2)
        n = s.shape[0]
        s = s.permute(0, 2, 3, 1).reshape(n, -1, cfg.primary_types, cfg.primary_dim)  # (N, P, T, K)
        u = squash(s)
        W = p["classcaps.W"]                                          # (P|1, T, J, D, K)
        u_hat = torch.einsum("ptjdk,nptk->nptjd", W, u).reshape(n, -1, cfg.n_classes, cfg.class_dim)
        if cfg.routing == "attention":
            v = self.attention_route(u_hat)
        else:
            v = self.route(u_hat)
        return v, v.norm(dim=-1)

    def attention_route(self, u_hat):
        """Self-attention routing on û (N, I, J, D), Efficient-CapsNet's squash on the output."""
        cfg = self.cfg
        i, j = u_hat.shape[1:3]
        bias = self.params["classcaps.bias"].expand(-1 if not cfg.share_spatial else i // cfg.primary_types,
                                                    cfg.primary_types, j).reshape(i, j)
        return attention_route(u_hat, bias)

    # ---- matrix capsules with EM routing --------------------------------------------------------------
    def matrix_capsules(self, h):
        """h (N, A, H, W) -> (class poses (N, J, 16), class activations (N, J))."""
        cfg, p = self.cfg, self.params
        T = cfg.primary_types
        y = torch.einsum("nahw,ak->nhwk", h, p["primary.W"]) + p["primary.b"]
        n, gh, gw, _ = y.shape
        M, a = y[..., :T * 16].reshape(n, gh, gw, T, 16), torch.sigmoid(y[..., T * 16:])
        for k, (kernel, stride) in enumerate(((3, 2), (3, 1)), start=1):
            M, a = self.conv_caps(M, a, f"convcaps{k}", kernel, stride)
        n, gh, gw, t, _ = M.shape
        V = torch.einsum("nqtab,tjbd->nqtjad", M.reshape(n, gh * gw, t, 4, 4), p["classcaps.W"])
        coord = torch.zeros(gh, gw, 4, 4, dtype=V.dtype, device=V.device)   # coordinate addition
        coord[:, :, 0, 3] = ((torch.arange(gh, dtype=V.dtype) + 0.5) / gh)[:, None]      # the row
        coord[:, :, 1, 3] = ((torch.arange(gw, dtype=V.dtype) + 0.5) / gw)[None, :]      # the column
        V = V + coord.reshape(1, gh * gw, 1, 1, 4, 4)
        V = V.reshape(n, gh * gw * t, cfg.n_classes, 16)
        child = torch.arange(gh * gw * t, device=V.device)                   # one slot per child
        mu, a_out = self.em(V, a.reshape(n, -1), child, "classcaps")
        return mu, a_out

    def conv_caps(self, M, a, name, k, s):
        """Windows by Tensor.unfold; children shared between windows found by index arithmetic."""
        p, n, gw, t = self.params, M.shape[0], M.shape[2], M.shape[3]
        Mw = M.unfold(1, k, s).unfold(2, k, s)                  # (N, OH, OW, T, 16, k, k)
        oh, ow = Mw.shape[1:3]
        Mw = Mw.permute(0, 1, 2, 5, 6, 3, 4).reshape(n, oh * ow, k * k * t, 4, 4)
        aw = a.unfold(1, k, s).unfold(2, k, s).permute(0, 1, 2, 4, 5, 3).reshape(n, oh * ow * k * k * t)
        W = p[name + ".W"]                                       # (k*k*T, C, 4, 4)
        V = torch.einsum("npiab,icbd->npicad", Mw, W).reshape(n, oh * ow * k * k * t, W.shape[1], 16)
        r, c, ki, kj, ti = np.meshgrid(np.arange(oh), np.arange(ow), np.arange(k), np.arange(k), np.arange(t),
                                       indexing="ij")
        child = torch.as_tensor((((r * s + ki) * gw + (c * s + kj)) * t + ti).ravel(), device=V.device)
        mu, a_out = self.em(V, aw, child, name, positions=oh * ow)
        C = W.shape[1]
        return mu.reshape(n, oh, ow, C, 16), a_out.reshape(n, oh, ow, C)

    def em(self, V, a_in, child, name, positions=1):
        """EM routing over slots: V (N, S, C, 16) with S = positions x slots per position, a_in (N, S),
        child[s] the child in slot s.  Parents are (position, type); R normalised per child."""
        cfg, p = self.cfg, self.params
        n, S, C, H = V.shape
        beta_u, beta_a = p[name + ".beta_u"], p[name + ".lambda_beta_a"] / cfg.em_lambda  # learned as λβ_a
        iters, eps = cfg.routing_iters, 1e-6
        n_children = int(child.max()) + 1
        slots = torch.zeros(n_children, dtype=V.dtype, device=V.device).index_add_(0, child, torch.ones_like(child, dtype=V.dtype))
        R = (1 / (C * slots[child]))[None, :, None].expand(n, S, C)
        Vp = V.reshape(n, positions, S // positions, C, H)
        for t in range(iters):
            lam = cfg.em_lambda * (t + 1) / iters
            if t == iters - 1 and cfg.routing_grad == "final":
                R = R.detach()
            Rp = (R * a_in[..., None]).reshape(n, positions, S // positions, C)
            r = Rp.sum(2)                                               # (N, P, C)
            mu = torch.einsum("npic,npich->npch", Rp, Vp) / (r[..., None] + eps)
            var = torch.einsum("npic,npich->npch", Rp, (Vp - mu[:, :, None]) ** 2) / (r[..., None] + eps) + eps
            cost = (beta_u[:, None] + 0.5 * torch.log(var)).sum(-1) * r
            a = torch.sigmoid(lam * (beta_a - cost))
            if t == iters - 1:
                return mu.reshape(n, -1, H) if positions == 1 else mu, a.reshape(n, -1) if positions == 1 else a
            log_p = -(((Vp - mu[:, :, None]) ** 2) / (2 * var[:, :, None])
                      + 0.5 * torch.log(2 * np.pi * var[:, :, None])).sum(-1)
            L = (F.logsigmoid(lam * (beta_a - cost))[:, :, None] + log_p).reshape(n, S, C)
            lse_slot = torch.logsumexp(L, dim=2)                       # (N, S)
            top = torch.full((n, n_children), -torch.inf, dtype=V.dtype, device=V.device)
            top = top.scatter_reduce(1, child.expand(n, S), lse_slot.detach(), reduce="amax")
            Z = torch.zeros(n, n_children, dtype=V.dtype, device=V.device)
            Z = Z.index_add(1, child, torch.exp(lse_slot - top[:, child]))
            R = torch.exp(L - (top[:, child] + torch.log(Z[:, child]))[..., None])

    def route(self, u_hat):
        return dynamic_route(u_hat, self.cfg.routing_iters, self.cfg.routing_grad == "final")

    spread_margin = 0.2  # the spread loss's margin (the first epoch's)

    def loss(self, x, y):
        cfg = self.cfg
        v, lengths, recon = self.forward(x, y)
        t = F.one_hot(y, cfg.n_classes).to(lengths.dtype)
        if cfg.routing == "em":
            a_t = (lengths * t).sum(1, keepdim=True)
            margin = ((F.relu(self.spread_margin - (a_t - lengths)) * (1 - t)) ** 2).sum(1).mean()
        else:
            margin = (t * F.relu(cfg.m_plus - lengths) ** 2
                      + cfg.lam * (1 - t) * F.relu(lengths - cfg.m_minus) ** 2).sum(1).mean()
        rec = cfg.recon_weight * ((recon - x) ** 2).sum() / x.shape[0]
        return margin + rec, margin, rec

    def grads(self, x, y, input_grad=False):
        """Loss and d(loss)/d(every parameter) [and d/dx] by autograd, as host NumPy arrays."""
        for t in self.params.values():
            t.grad = None
        x = torch.as_tensor(np.asarray(x), dtype=self.dtype, device=self.device).requires_grad_(input_grad)
        y = torch.as_tensor(np.asarray(y), dtype=torch.int64, device=self.device)
        total, _, _ = self.loss(x, y)
        total.backward()
        g = {k: t.grad.detach().cpu().numpy() for k, t in self.params.items()}
        if input_grad:
            g["input"] = x.grad.detach().cpu().numpy()
        return float(total.detach()), g


def dynamic_route(u_hat, iters, final=False, bias=0):
    """Dynamic routing on û (N, I, J, D), ``bias`` (J, D) added to every s_j; ``final`` detaches
    everything but the last weighted sum and the bias."""
    u_for_b = u_hat.detach() if final else u_hat
    bias_for_b = bias.detach() if final and torch.is_tensor(bias) else bias
    b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype, device=u_hat.device)
    for r in range(iters):
        c = torch.softmax(b, dim=2)
        if r == iters - 1:
            return squash(torch.einsum("nij,nijd->njd", c.detach() if final else c, u_hat) + bias)
        v = squash(torch.einsum("nij,nijd->njd", c, u_for_b) + bias_for_b)
        b = b + torch.einsum("nijd,njd->nij", u_for_b, v)


class AutogradNetwork(AutogradCapsNet):
    """A network from a description (architecture.py) -- conv2d, relu, max_pool, flatten, linear,
    dropout, batch_norm, primary_caps (depthwise, either squash), dynamic_caps, attention_caps,
    conv_caps; the lengths or logits head, margin or
    cross-entropy loss, decoder -- under autograd, written from the description alone: the oracle
    for compositions (stacked routing, ConvCaps, the baseline CNN).  ``masks``: each Dropout's mask
    by layer name (channels-last, as the layer drew it), or the model's last ones (``from_model``)."""

    def __init__(self, description, params, device="cpu", dtype=torch.float32, masks=None, buffers=None,
                 training=True, drawn=None):
        super().__init__(None, params, device, dtype)
        self.arch = description
        self.masks = {k: torch.as_tensor(np.asarray(m), dtype=dtype, device=device) for k, m in (masks or {}).items()}
        # random routing's coefficients by layer name, (n, J, I) as the layer drew them
        self.drawn = {k: torch.as_tensor(np.asarray(c), dtype=dtype, device=device) for k, c in (drawn or {}).items()}
        # batch norm's running statistics (not learned); training: normalise by the batch's statistics
        self.buffers = {k: torch.as_tensor(np.asarray(b), dtype=dtype, device=device) for k, b in (buffers or {}).items()}
        self.training = training

    @classmethod
    def from_model(cls, model, device="cpu", dtype=torch.float32):
        masks = {name: model.B.to_numpy(layer.mask) for name, layer in model.body.leaves()
                 if getattr(layer, "mask", None) is not None and layer.training}
        state = model.state_dict()
        buffers = {k: state.pop(k) for k in model.buffers}
        drawn = {name: model.B.to_numpy(layer.drawn) for name, layer in model.body.leaves()
                 if getattr(layer, "drawn", None) is not None}
        return cls(model.architecture, state, device, dtype, masks, buffers, model.training, drawn)

    def forward(self, x, y=None):
        p, h = self.params, self.body(self.arch["body"], x, None, True)[0]  # x: images (N, C, H, W)
        if self.arch.get("head") == "logits":
            return h, h, None
        v = h
        lengths = v.norm(dim=-1)
        if not self.arch.get("decoder"):
            return v, lengths, None
        n, J = v.shape[0], v.shape[1]
        mask = F.one_hot(y if y is not None else lengths.argmax(1), J).to(v.dtype)
        z = (v * mask[..., None]).reshape(n, -1)
        n_dec = len(self.arch["decoder"]["hidden"]) + 1
        for k in range(1, n_dec + 1):
            z = z @ p[f"decoder{k}.W"] + p[f"decoder{k}.b"]
            z = F.relu(z) if k < n_dec else torch.sigmoid(z)
        return v, lengths, z.reshape(n, *x.shape[1:])

    def body(self, specs, h, grid, image, prefix=""):
        """(output, capsule grid, whether it is an image) of the layers ``specs`` from h; parameters
        named under ``prefix`` (a residual block's branches)."""
        p, names = self.params, {}
        for spec in specs:
            kind = spec["layer"]
            names[kind] = names.get(kind, 0) + 1
            name = prefix + (spec.get("name") or f"{kind}{names[kind]}")
            if kind == "conv2d":
                h = F.conv2d(h, p[name + ".W"].permute(3, 2, 0, 1), p[name + ".b"], stride=spec.get("stride", 1),
                             padding=spec.get("padding", 0))
            elif kind == "relu":
                h = F.relu(h)
            elif kind == "max_pool":
                h = F.max_pool2d(h, spec.get("kernel", 2), spec.get("stride") or spec.get("kernel", 2))
            elif kind == "flatten":
                h, image = (h.permute(0, 2, 3, 1) if image else h).reshape(h.shape[0], -1), False  # channels-last order
            elif kind == "linear":
                h = h @ p[name + ".W"] + p[name + ".b"]
            elif kind == "dropout":
                m = self.masks[name]
                h = h * (m.permute(0, 3, 1, 2) if image else m.reshape(h.shape))
            elif kind == "batch_norm":  # F.batch_norm on copies: the reference leaves the running statistics be
                h = F.batch_norm(h, self.buffers[name + ".running_mean"].clone(), self.buffers[name + ".running_var"].clone(),
                                 p[name + ".gamma"], p[name + ".beta"], self.training, spec.get("momentum", 0.1),
                                 spec.get("eps", 1e-5))
            elif kind == "primary_caps":
                s = self.conv(h * spec.get("scale", 1.0), name, spec.get("stride", 2),
                              spec.get("conv") == "depthwise")  # (N, T*K, H2, W2): W * (scale x) + b
                grid, image = s.shape[2:], False
                s = s.permute(0, 2, 3, 1).reshape(s.shape[0], -1, spec["types"], spec["dim"])
                h = exp_squash(s) if spec.get("squash") == "efficient" else squash(s)
            elif kind == "attention_caps":
                h, grid = self.attention_capsules(h, name), None
            elif kind == "dynamic_caps":
                W = p[name + ".W"]                                                   # (P|1, T, J, D, K)
                u = h.reshape(h.shape[0], -1, W.shape[1], W.shape[4])                # (N, P, T, K)
                P = u.shape[1]
                u_hat = torch.einsum("ptjdk,nptk->nptjd", W.expand(P, -1, -1, -1, -1), u)
                u_hat = u_hat.reshape(u.shape[0], -1, W.shape[2], W.shape[3])
                per_child = lambda t: t.expand(P, *t.shape[1:]).reshape(-1, *t.shape[2:])
                h, grid = self.route(name, spec, u_hat, u.reshape(u.shape[0], -1, W.shape[4]), per_child), None
            elif kind == "conv_caps":
                h, grid = self.conv_capsules(h, grid, name, spec)
            elif kind == "capsule_logits":
                h = (h * p[name + ".W"]).sum(-1) + p[name + ".b"]
            elif kind == "normalize":  # h (N, C, H, W): each channel's own mean and deviation
                shape = (1, -1, 1, 1)
                h = (h - h.new_tensor(spec["mean"]).reshape(shape)) / h.new_tensor(spec["std"]).reshape(shape)
            elif kind == "layer_norm":
                size = h.shape[1] if image else h.shape[-1]
                normed = lambda t: F.layer_norm(t, (size,), p[name + ".gamma"], p[name + ".beta"], spec.get("eps", 1e-5))
                h = normed(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) if image else normed(h)
            elif kind == "residual":  # the body's output plus the shortcut's, or plus the input
                out = self.body(spec["body"], h, grid, image, name + ".body.")
                side = self.body(spec["shortcut"], h, grid, image, name + ".shortcut.")[0] if spec.get("shortcut") \
                    else h
                h, grid, image = out[0] + side, out[1], out[2]
            else:
                raise ValueError(f"the autograd reference has no {kind}")
        return h, grid, image

    def attention_capsules(self, h, name):
        """Self-attention routing from the description's sizes: W (P|1, T, J, D, K), bias (P|1, T, J)."""
        W, bias = self.params[name + ".W"], self.params[name + ".bias"]
        u = h.reshape(h.shape[0], -1, W.shape[1], W.shape[4])                           # (N, P, T, K)
        W, bias = W.expand(u.shape[1], -1, -1, -1, -1), bias.expand(u.shape[1], -1, -1)
        u_hat = torch.einsum("ptjdk,nptk->nptjd", W, u).reshape(u.shape[0], -1, W.shape[2], W.shape[3])
        return attention_route(u_hat, bias.reshape(-1, W.shape[2]))

    def conv_capsules(self, u, grid, name, spec):
        """Windows by Tensor.unfold, each window of each sample routed on its own."""
        k, s = spec.get("kernel", 3), spec.get("stride", 1)
        W = self.params[name + ".W"]                                                 # (k*k*T, C, D, K)
        n, K = u.shape[0], W.shape[3]
        uw = u.reshape(n, grid[0], grid[1], -1, K).unfold(1, k, s).unfold(2, k, s)    # (N, OH, OW, T, K, k, k)
        oh, ow = uw.shape[1:3]
        uw = uw.permute(0, 1, 2, 5, 6, 3, 4).reshape(n * oh * ow, -1, K)             # (N*P, I, K)
        u_hat = torch.einsum("mik,icdk->micd", uw, W)
        v = self.route(name, spec, u_hat, uw, lambda t: t)
        return v.reshape(n, oh * ow, W.shape[1], W.shape[2]), (oh, ow)

    def route(self, name, spec, u_hat, u, per_child):
        """The layer's routing on û (N, I, J, D), from the child poses u (N, I, K) where it reads them;
        ``per_child`` lays a routing map (P|1, T, ...) out as (I, ...)."""
        from . import reference_routings as routings

        routing, final = spec.get("routing", "dynamic"), spec.get("routing_grad") == "final"
        if routing == "dynamic":
            return dynamic_route(u_hat, spec.get("iters", 3), final, self.params.get(name + ".bias", 0))
        own = {k: self.params[f"{name}.{k}"] for k in ("gamma", "beta", "beta_a", "beta_u") if f"{name}.{k}" in self.params}
        own.update({k: per_child(self.params[f"{name}.{k}"]) for k in ("W_route", "b_route")
                    if f"{name}.{k}" in self.params})
        options = {k: spec[k] for k in ("scaled", "alpha0", "kappa0", "psi0", "nu0", "vb_lambda") if k in spec}
        fixed = self.drawn[name].permute(0, 2, 1) if name in self.drawn else None
        if routing == "random" and fixed is None:  # none drawn by a model (a benchmark): draw as the layer does
            fixed = torch.softmax(torch.randn(u_hat.shape[:3], dtype=u_hat.dtype, device=u_hat.device), dim=2)
        v = routings.route(routing, u_hat, u, own, spec.get("iters", 3), options, fixed, final)
        bias = self.params.get(name + ".bias")
        if bias is not None:  # uniform and random coupling take dynamic routing's β_j on s_j
            c = fixed if fixed is not None else torch.full(u_hat.shape[:3], 1 / u_hat.shape[2], dtype=u_hat.dtype)
            v = squash(torch.einsum("nij,nijd->njd", c, u_hat) + bias)
        return v

    def loss(self, x, y):
        v, scores, recon = self.forward(x, y)
        loss = self.arch.get("loss") or {}
        kind = loss.get("loss", "cross_entropy" if self.arch.get("head") == "logits" else "margin")
        if kind == "cross_entropy":
            class_loss = F.cross_entropy(scores, y)
        elif kind == "nll":
            class_loss = -torch.log(scores.gather(1, y[:, None])).mean()
        else:
            t = F.one_hot(y, scores.shape[1]).to(scores.dtype)
            class_loss = (t * F.relu(loss.get("m_plus", 0.9) - scores) ** 2
                          + loss.get("lam", 0.5) * (1 - t) * F.relu(scores - loss.get("m_minus", 0.1)) ** 2).sum(1).mean()
        rec = 0 if recon is None else self.arch["decoder"]["weight"] * ((recon - x) ** 2).sum() / x.shape[0]
        return class_loss + rec, class_loss, rec
