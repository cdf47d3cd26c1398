"""The CPU path of ``blend.rasterize_to_pixels``: the Triton kernels' algorithm in torch, many tiles at once.

Tiles go in batches of up to TILE_BATCH. Each step takes the next CHUNK Gaussians of every live tile as one
[tiles, pixels, chunk] block; tiles whose pixels are all done (or whose list is used up) leave the batch,
so a dense tile costs what its pixels use before they saturate, and per-op overhead is shared by the batch.
The forward stores per pixel the final T and the last contributing Gaussian, as the kernel does; the
backward walks each tile back to front from there with the kernel's formulas (T recovered by division).
Each Gaussian's mean, conic and opacity gradients are sums over pixels of dL/dpower times a quadratic in
(mean - pixel); they come out of one batched matmul of dL/dpower against the pixel moments
[1, x, y, x^2, xy, y^2] taken in tile-local coordinates (small, so the expansion loses no precision).
"""

from __future__ import annotations

import torch

from warpforge.splat import reference as ref

CHUNK = 32  # Gaussians per step (the early-termination granularity)
TILE_BATCH = 1024  # tiles per batch: bounds the [tiles, pixels, chunk] temporaries (~32 MB each at 16x16)


def _geometry(C, th, tw, tile_size, width, height, device):
    """Tile origins [C*th*tw] (x0, y0), tile-local pixel centres [P] (fx, fy), and which pixels are inside."""
    t = torch.arange(C * th * tw, device=device) % (th * tw)
    x0, y0 = ((t % tw) * tile_size).float(), ((t // tw) * tile_size).float()
    ox, oy = ref.tile_pixels(tile_size, device)
    fx, fy = ox + 0.5, oy + 0.5
    inside = (x0[:, None] + ox < width) & (y0[:, None] + oy < height)
    return x0, y0, fx, fy, inside


def _per_tile(v, C, th, tw, tile_size, width, height, fill=0.0):
    """[C, H, W, k] image -> [C*th*tw, P, k] per tile, ``fill`` outside the image."""
    ts = tile_size
    v = torch.nn.functional.pad(v, (0, 0, 0, tw * ts - width, 0, th * ts - height), value=fill)
    return v.reshape(C, th, ts, tw, ts, -1).permute(0, 1, 3, 2, 4, 5).reshape(C * th * tw, ts * ts, -1)


def _ranges(offsets, n_isects):
    starts = offsets.reshape(-1).long()
    return starts, torch.cat([starts[1:], starts.new_tensor([n_isects])])


class _Chunk:
    """One step's Gaussians (sorted positions j [A, CH]) gathered, and their power at the tiles' pixels."""

    def __init__(self, flat, flatten_ids, j, jm, x0, y0, fx, fy):
        g = flatten_ids[j.clamp(0, flatten_ids.numel() - 1)].long()
        means, conics, self.colors, op = (v[g] for v in flat)
        self.g, self.jm = g, jm
        self.op = torch.where(jm, op, 0.0)  # past the range: opacity 0, alpha 0
        self.a, self.b, self.c = conics[..., 0], conics[..., 1], conics[..., 2]
        self.mx, self.my = means[..., 0] - x0[:, None], means[..., 1] - y0[:, None]  # tile-local [A, CH]
        self.dx = self.mx[:, None, :] - fx[None, :, None]  # [A, P, CH]
        self.dy = self.my[:, None, :] - fy[None, :, None]
        na, nb, nc = (-0.5 * self.a)[:, None, :], (-self.b)[:, None, :], (-0.5 * self.c)[:, None, :]
        self.power = (na * self.dx + nb * self.dy) * self.dx + nc * self.dy * self.dy
        # Far pixels have powers in the thousands below 0: exp() there lands in denormals, 4x slower on a
        # CPU. Any power below -20 gives alpha < 1/255 (opacity <= 1), skipped either way.
        self.power.clamp_(min=-20.0)


def blend_forward(means2d, conics, colors, opacities, backgrounds, width, height, tile_size, offsets, flatten_ids):
    """-> colours [C,H,W,D], alphas [C,H,W,1], final T [C,H,W], last contributing position [C,H,W] int64."""
    C, th, tw = offsets.shape  # colors are [C, N, D] or packed [nnz, D]: read only through flatten_ids
    D = colors.shape[-1]
    n_all, P, dev = C * th * tw, tile_size * tile_size, means2d.device
    flat = (means2d.reshape(-1, 2), conics.reshape(-1, 3), colors.reshape(-1, D), opacities.reshape(-1))
    starts, ends = _ranges(offsets, flatten_ids.numel())
    x0_all, y0_all, fx, fy, inside = _geometry(C, th, tw, tile_size, width, height, dev)
    out = means2d.new_zeros(n_all, P, D)
    T = means2d.new_ones(n_all, P)
    last = torch.full((n_all, P), -1, dtype=torch.long, device=dev)
    ar = torch.arange(CHUNK, device=dev)
    rank = (ar + 1).float()
    for b in range(0, n_all, TILE_BATCH):
        act = torch.arange(b, min(b + TILE_BATCH, n_all), device=dev)
        act = act[ends[act] > starts[act]]
        # state of the live tiles, compacted as tiles finish
        pos, end, x0, y0, live = starts[act], ends[act], x0_all[act], y0_all[act], inside[act]
        T_a, out_a, last_a = T[act], out[act], last[act]
        while act.numel():
            j = pos[:, None] + ar
            ch = _Chunk(flat, flatten_ids, j, j < end[:, None], x0, y0, fx, fy)
            alpha = (ch.op[:, None, :] * torch.exp(ch.power)).clamp_(max=ref.ALPHA_MAX)
            alpha = torch.where((ch.power <= 0) & (alpha >= ref.ALPHA_MIN), alpha, 0.0)
            om = 1.0 - alpha
            t_incl = torch.cumprod(om, -1).mul_(T_a[..., None])  # T after each Gaussian
            keep = (t_incl > ref.T_MIN) & live[..., None]  # a prefix of the chunk
            w = torch.where(keep, alpha * t_incl / om, 0.0)  # alpha * T before it
            out_a += torch.bmm(w, ch.colors)
            k = ((w > 0) * rank).amax(-1)  # 1 + chunk index of the last contributor, 0 if none
            last_a = torch.where(k > 0, pos[:, None] + k.long() - 1, last_a)
            n_keep = keep.sum(-1, keepdim=True)
            T_a = torch.where(n_keep[..., 0] > 0, t_incl.gather(-1, (n_keep - 1).clamp_(min=0))[..., 0], T_a)
            live = keep[..., -1]
            pos = pos + CHUNK
            more = (pos < end) & live.any(-1)
            if not bool(more.all()):
                gone = act[~more]
                T[gone], out[gone], last[gone] = T_a[~more], out_a[~more], last_a[~more]
                act, pos, end, x0, y0, live, T_a, out_a, last_a = (
                    v[more] for v in (act, pos, end, x0, y0, live, T_a, out_a, last_a))
    geo = (C, th, tw, tile_size, width, height)
    img, alphas = ref.assemble_tiles(out, T, *geo, backgrounds)
    final_T = ref.tiles_to_image(T[..., None], *geo)[..., 0]
    last_pos = ref.tiles_to_image(last[..., None], *geo)[..., 0]
    return img, alphas, final_T, last_pos


def blend_backward(means2d, conics, colors, opacities, backgrounds, width, height, tile_size, offsets, flatten_ids,
                   T_img, last_img, v_out, v_alphas, absgrad):
    """-> [v_means2d, v_conics, v_colors, v_opacities], v_absgrad (or None). The background's gradient is
    the caller's (sum over pixels of T * v_out)."""
    C, th, tw = offsets.shape
    D = colors.shape[-1]
    n_all, dev = C * th * tw, means2d.device
    flat = (means2d.reshape(-1, 2), conics.reshape(-1, 3), colors.reshape(-1, D), opacities.reshape(-1))
    grads = [torch.zeros_like(v) for v in flat]
    v_abs = torch.zeros_like(flat[0]) if absgrad else None
    geo = (C, th, tw, tile_size, width, height)
    T = _per_tile(T_img[..., None], *geo, fill=1.0)[..., 0]
    last = _per_tile(last_img[..., None], *geo, fill=-1)[..., 0]
    vc = _per_tile(v_out, *geo)  # [n_all, P, D]
    va = _per_tile(v_alphas, *geo)[..., 0]
    if backgrounds is not None:  # out = ... + T_final * bg: the same (1 - alpha)-chain as alpha = 1 - T_final
        va = va - (vc * backgrounds.repeat_interleave(th * tw, 0)[:, None, :]).sum(-1)
    fin = T * va  # d loss / d alpha_i = ... + fin / (1 - alpha_i)
    x0_all, y0_all, fx, fy, _ = _geometry(C, th, tw, tile_size, width, height, dev)
    moments = torch.stack([torch.ones_like(fx), fx, fy, fx * fx, fx * fy, fy * fy], -1)  # [P, 6]
    starts, ends = _ranges(offsets, flatten_ids.numel())
    his = torch.minimum(ends, last.amax(-1) + 1)
    ar = torch.arange(CHUNK, device=dev)
    for b in range(0, n_all, TILE_BATCH):
        act = torch.arange(b, min(b + TILE_BATCH, n_all), device=dev)
        act = act[his[act] > starts[act]]
        hi, st, x0, y0 = his[act], starts[act], x0_all[act], y0_all[act]
        T_a, behind_a, fin_a, vc_a, last_a = T[act], torch.zeros_like(T[act]), fin[act], vc[act], last[act]
        while act.numel():
            j = hi[:, None] - 1 - ar  # back to front: chunk index 0 is the hindmost
            ch = _Chunk(flat, flatten_ids, j, j >= st[:, None], x0, y0, fx, fy)
            vis = torch.exp(ch.power)
            raw = ch.op[:, None, :] * vis
            alpha = raw.clamp(max=ref.ALPHA_MAX)
            valid = (j[:, None, :] <= last_a[..., None]) & (ch.power <= 0) & (alpha >= ref.ALPHA_MIN)
            a = torch.where(valid, alpha, 0.0)
            om = 1.0 - a
            r = torch.cumprod(om, -1)  # product over this Gaussian and the ones behind it in the chunk
            t_excl = T_a[..., None] / r  # T before each Gaussian
            w = a * t_excl
            gdot = torch.bmm(vc_a, ch.colors.transpose(1, 2))  # [A, P, CH] colour . v_out
            wg = w * gdot
            behind = behind_a[..., None] + (torch.cumsum(wg, -1) - wg)  # colour behind, dotted with v_out
            v_alpha = gdot * t_excl + (fin_a[..., None] - behind) / om
            v_pow = torch.where(valid & (raw <= ref.ALPHA_MAX), raw * v_alpha, 0.0)  # dL/dpower; the clamp cuts it
            S = torch.matmul(v_pow.transpose(1, 2), moments)  # [A, CH, 6] sums over pixels
            s0, sx, sy, sxx, sxy, syy = S.unbind(-1)
            mx, my = ch.mx, ch.my
            sdx, sdy = mx * s0 - sx, my * s0 - sy  # sums of v_pow * dx, v_pow * dy, ...
            sdxdx = mx * mx * s0 - 2.0 * mx * sx + sxx
            sdxdy = mx * my * s0 - mx * sy - my * sx + sxy
            sdydy = my * my * s0 - 2.0 * my * sy + syy
            jm = ch.jm
            gm = ch.g[jm]
            # power = -(a dx^2 / 2 + b dx dy + c dy^2 / 2), dx = mean - pixel
            grads[0].index_add_(0, gm, -torch.stack([ch.a * sdx + ch.b * sdy, ch.b * sdx + ch.c * sdy], -1)[jm])
            grads[1].index_add_(0, gm, -torch.stack([0.5 * sdxdx, sdxdy, 0.5 * sdydy], -1)[jm])
            grads[2].index_add_(0, gm, torch.bmm(w.transpose(1, 2), vc_a)[jm])
            grads[3].index_add_(0, gm, torch.where(ch.op > 0, s0 / ch.op, 0.0)[jm])
            if v_abs is not None:  # absgrad
                av, bv, cv = ch.a[:, None, :], ch.b[:, None, :], ch.c[:, None, :]
                ax = (v_pow * (av * ch.dx + bv * ch.dy)).abs().sum(1)
                ay = (v_pow * (bv * ch.dx + cv * ch.dy)).abs().sum(1)
                v_abs.index_add_(0, gm, torch.stack([ax, ay], -1)[jm])
            T_a = T_a / r[..., -1]
            behind_a = behind_a + wg.sum(-1)
            hi = hi - CHUNK
            more = hi > st
            if not bool(more.all()):
                act, hi, st, x0, y0, T_a, behind_a, fin_a, vc_a, last_a = (
                    v[more] for v in (act, hi, st, x0, y0, T_a, behind_a, fin_a, vc_a, last_a))
    grads = [g.view(v.shape) for g, v in zip(grads, (means2d, conics, colors, opacities))]
    return grads, (v_abs.view(means2d.shape) if v_abs is not None else None)
