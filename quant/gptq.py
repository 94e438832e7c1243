"""GPTQ (Frantar et al., 2022): round columns one at a time and push each column's rounding error
onto the columns not yet rounded, through the inverse Hessian H = Σ xᵀx of the layer's inputs.

Pure maths on tensors: w [N, K] and H [K, K] in, integer codes [N, K] and group scales [N, K/G] out,
on any of the grids of quant.grids (value = code * scale of its group). Every row is independent
given H, so a fused matrix can be cut into row slices with different grids.
"""
from __future__ import annotations

import torch

from quant.grids import binary_rtn, int_rtn, ternary_rtn

GRIDS = ("tri", "tri-dense", "bin", "int4", "int8")


def check_grid(grid: str) -> None:
    if grid not in GRIDS:
        raise ValueError(f"unknown quantization grid '{grid}': use one of {', '.join(GRIDS)}")


def code_range(grid: str) -> tuple[int, int]:
    """Smallest and largest integer code of a grid (binary codes skip 0)."""
    check_grid(grid)
    qmax = {"int4": 7, "int8": 127}.get(grid, 1)
    return -qmax, qmax


def rtn(w: torch.Tensor, grid: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest on `grid` with its scale rule: codes int8 [N, K], scales float32 [N, K/G]."""
    check_grid(grid)
    if grid in ("tri", "tri-dense"):
        return ternary_rtn(w, group_size)
    if grid == "bin":
        return binary_rtn(w, group_size)
    return int_rtn(w, 4 if grid == "int4" else 8, group_size)


def round_with_scale(w: torch.Tensor, scale: torch.Tensor, grid: str) -> torch.Tensor:
    """Nearest code for w [..] given its scale [..] (same shape): float codes on the grid."""
    if grid == "bin":
        return torch.where(w >= 0, 1.0, -1.0)
    lo, hi = code_range(grid)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, torch.clamp(torch.round(w / safe), lo, hi), torch.zeros_like(w))


REFIT_CHUNK_BYTES = 32 << 20  # refit_scales: float32 bytes of one chunk's [rows, K/G, K] products
HESSIAN_FLOAT64_MAX = 8192  # inputs up to which Hessians are kept and factored in float64 (512 MB at most)


def hessian_dtype(k: int) -> torch.dtype:
    """float64 for Hessians of up to HESSIAN_FLOAT64_MAX inputs, else float32 (a 21504-wide FFN's Hessian
    is 1.8 GB in float32; GPTQ's reference factors in float32 at every size)."""
    return torch.float64 if k <= HESSIAN_FLOAT64_MAX else torch.float32


def damped_cholesky(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factor L of H + λI (L Lᵀ) with λ = damp · mean diag(H), in hessian_dtype(K).

    Dead inputs (H[i, i] = 0, never active in the calibration data) get H[i, i] = 1 so H stays
    invertible; their weights do not change the layer's output on that data. A near-singular H (few
    tokens, duplicated inputs) is retried with 10x more damping, up to five times. Returns L [K, K] and
    the dead mask [K]. Holds one K×K besides the caller's and L: the damped copy goes once factored."""
    k = hessian.shape[0]
    diagonal = hessian.diagonal().to(hessian_dtype(k))  # [K]
    dead = diagonal == 0
    diagonal = torch.where(dead, torch.ones_like(diagonal), diagonal)
    damping = damp * float(diagonal.mean())
    for attempt in range(6):
        h = hessian.to(hessian_dtype(k), copy=True)  # [K, K]
        h.diagonal().copy_(diagonal + damping * (10 ** attempt))
        chol, info = torch.linalg.cholesky_ex(h)
        del h
        if int(info) == 0:
            return chol, dead
    raise ValueError("the Hessian is not positive definite even with strong damping: "
                     "give more calibration tokens")


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of (H + λI)⁻¹ (damped_cholesky's damping), in hessian_dtype(K). Returns
    the factor [K, K] and the dead mask [K]. Holds at most two K×K matrices besides the caller's (a
    21504-wide FFN: 1.8 GB fewer at the peak than keeping the damped copy)."""
    for attempt in range(6):
        chol, dead = damped_cholesky(hessian, damp * (10 ** attempt))
        inverse = torch.cholesky_inverse(chol)
        del chol
        factor, info = torch.linalg.cholesky_ex(inverse, upper=True)
        del inverse
        if int(info) == 0:
            return factor, dead
    raise ValueError("the Hessian is not positive definite even with strong damping: "
                     "give more calibration tokens")


def asymmetric_target(w: torch.Tensor, cross: torch.Tensor, hessian: torch.Tensor, damp: float,
                      strength: float = 1.0) -> torch.Tensor:
    """The weights GPTQ should approach so that the layer, fed the quantized model's inputs x̃, gives the
    float model's outputs W x (x: the float model's own inputs): min_Q Σ ‖Q x̃ − W x‖² = Σ ‖(Q − W') x̃‖²
    + const for W' = W + W D H̃⁻¹, D = Σ (x − x̃) x̃ᵀ, H̃ = Σ x̃ x̃ᵀ ("asymmetric calibration", GPTQv2 /
    GPTAQ, Li et al. 2025). w [N, K]; cross = W D [N, K]; hessian H̃ [K, K], damped as GPTQ damps it.
    strength scales the correction (0: w itself, GPTQ's own target; 1: the whole correction).
    Returns W' float32 [N, K] (w + strength · cross (H̃ + λI)⁻¹; dead inputs keep w)."""
    if strength == 0:
        return w.float()
    chol, dead = damped_cholesky(hessian.to(w.device), damp)  # [K, K] lower
    # X = cross (H̃ + λI)⁻¹  ⇔  (H̃ + λI) Xᵀ = crossᵀ (symmetric)
    shift = torch.cholesky_solve(cross.to(chol.dtype).T.contiguous(), chol).T  # [N, K]
    del chol
    shift[:, dead] = 0.0
    return (w.to(shift.dtype) + strength * shift).float()


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, grid: str, group_size: int = 128, damp: float = 0.01,
                  block_size: int = 128, act_order: bool = False, scales: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32, hessian [K, K] = Σ xᵀx of the layer's inputs. grid: "tri" | "tri-dense" | "bin" |
    "int4" | "int8". Returns codes int8 [N, K] on the grid and scales float32 [N, K/G] (value = code *
    scale of its group).

    Columns are rounded in order (or by decreasing H[i, i] with act_order) in lazy blocks of
    `block_size`: the error of a column goes to the rest of its block at once and to the columns after
    the block in one matmul. A group's scale is chosen by the grid's own rule (quant.grids) on the
    error-updated weights of the group when its first column is reached; with act_order the groups
    stay contiguous in the original order and their scales are fixed up front from w ("static groups").
    Given `scales` [N, K/G] (e.g. from `refit_scales`), only the codes are chosen, for those scales.
    """
    check_grid(grid)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    if hessian.shape != (k, k):
        raise ValueError(f"the Hessian has shape {tuple(hessian.shape)}, expected ({k}, {k})")
    if damp <= 0 or block_size < 1:
        raise ValueError(f"damp must be > 0 and block_size >= 1 (got {damp}, {block_size})")
    work = w.detach().float().clone()  # [N, K], updated in place with the error feedback
    hinv, dead = inverse_hessian_factor(hessian.to(w.device), damp)
    hinv = hinv.float()  # [K, K] upper
    work[:, dead] = 0.0
    fixed = scales is not None or act_order  # scales set up front ("static groups")
    if scales is not None:
        scales = scales.detach().float().to(w.device).clone()  # [N, K/G]
    elif act_order:
        _, scales = rtn(work, grid, group_size)  # static groups, from the unquantized weights
    else:
        scales = torch.zeros(n, k // group_size, dtype=torch.float32, device=w.device)  # [N, K/G]
    order = torch.arange(k, device=w.device)
    if act_order:
        order = torch.argsort(torch.diag(hessian).to(w.device), descending=True, stable=True)
        work = work[:, order]
        hinv, _ = inverse_hessian_factor(hessian.to(w.device)[order][:, order], damp)
        hinv = hinv.float()
    codes = torch.zeros(n, k, dtype=torch.float32, device=w.device)  # [N, K] in permuted order
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block = work[:, b0:b1].clone()  # [N, B]
        errors = torch.zeros_like(block)  # [N, B]
        h_block = hinv[b0:b1, b0:b1]  # [B, B]
        for j in range(b1 - b0):
            col = int(order[b0 + j])
            group = col // group_size
            if not fixed and col % group_size == 0:
                # the group starts here: its scale from the current (error-updated) weights; columns
                # past this block still owe the lazy update of the block's columns done so far
                end = b0 + j + group_size
                pending = work[:, b1:end] - errors[:, :j] @ hinv[b0:b0 + j, b1:end]  # [N, end - b1]
                current = torch.cat([block[:, j:], pending], dim=1)[:, :group_size]  # [N, G]
                scales[:, group] = rtn(current, grid, group_size)[1][:, 0]
            s = scales[:, group]  # [N]
            q = round_with_scale(block[:, j], s, grid)  # [N]
            codes[:, b0 + j] = q
            err = (block[:, j] - q * s) / h_block[j, j]  # [N]
            block[:, j:] -= err[:, None] * h_block[j, j:][None, :]
            errors[:, j] = err
        work[:, b1:] -= errors @ hinv[b0:b1, b1:]
    if act_order:
        codes = codes[:, torch.argsort(order)]
    return codes.to(torch.int8), scales


def refit_scales(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, hessian: torch.Tensor,
                 group_size: int, damp: float = 0.01, chunk_bytes: int = REFIT_CHUNK_BYTES) -> torch.Tensor:
    """Given the codes, the group scales that minimise the layer's output error on the calibration
    inputs, per row: min_s (w − V s)ᵀ H (w − V s), V [K, K/G] holding the row's code values by group.
    The normal equations (Vᵀ H V) s = Vᵀ H w are one small (K/G)² system per row (H damped as GPTQ
    damps it). A row keeps its old scales where the solution is not better, not finite, or makes a
    scale ≤ 0 (codes and their signs are left as they are). w [N, K], codes [N, K], scales [N, K/G]
    → scales float32 [N, K/G]. Rows go in chunks whose [rows, K/G, K] products stay under chunk_bytes;
    the products run in float32 (in float64 they cost more than GPTQ itself), the small systems are
    solved in float64."""
    n, k = w.shape
    groups = k // group_size
    dtype = torch.float32
    h = hessian.to(device=w.device, dtype=dtype, copy=True)  # [K, K]
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    hg = h.view(groups, group_size, k)  # [G, g, K]
    out = scales.detach().float().clone()  # [N, G]
    rows_per_chunk = max(1, chunk_bytes // (groups * k * h.element_size()))
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, n)
        v = codes[r0:r1].to(dtype)  # [R, K] code values
        wr = w[r0:r1].to(dtype)  # [R, K]
        q = torch.einsum("rgi,gik->rgk", v.view(-1, groups, group_size), hg)  # [R, G, K]: Σ_i∈g v_i H_i,:
        a = torch.einsum("rghj,rhj->rgh", q.view(-1, groups, groups, group_size),
                         v.view(-1, groups, group_size)).double()  # [R, G, G] = Vᵀ H V
        b = torch.einsum("rgk,rk->rg", q, wr).double()  # [R, G] = Vᵀ H w
        del q
        empty = torch.diagonal(a, dim1=1, dim2=2) <= 0  # [R, G]: groups whose codes are all 0
        old = out[r0:r1].double()  # [R, G]
        a = a + torch.diag_embed(empty.double())  # an empty group keeps its scale: a row s_g = old_g
        b = torch.where(empty, old, b)
        new = torch.linalg.solve(a, b.unsqueeze(-1)).squeeze(-1)  # [R, G]

        def error(s: torch.Tensor) -> torch.Tensor:  # [R]: (w − V s)ᵀ H (w − V s)
            d = wr - v * s.to(dtype).repeat_interleave(group_size, dim=1)  # [R, K]
            return ((d @ h) * d).sum(1)
        ok = torch.isfinite(new).all(1) & (new > 0).all(1) & (error(new) < error(old))  # [R]
        out[r0:r1] = torch.where(ok[:, None], new, old).float()
    return out


def row_errors(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, hessian: torch.Tensor,
               group_size: int, chunk_rows: int = 1024) -> torch.Tensor:
    """Each row's output error on the calibration inputs, (w − ŵ)ᵀ H (w − ŵ): float64 [N] (computed in
    float32, chunk_rows rows at a time)."""
    dtype = torch.float32
    h = hessian.to(device=w.device, dtype=dtype)  # [K, K] (no copy when it is already that)
    out = []
    for r0 in range(0, w.shape[0], chunk_rows):
        sl = slice(r0, r0 + chunk_rows)
        d = w[sl].to(dtype) - codes[sl].to(dtype) * scales[sl].to(dtype).repeat_interleave(group_size, dim=1)
        out.append(((d @ h) * d).sum(1).double())  # [R]
    return torch.cat(out)


def gptq_with_refits(w: torch.Tensor, hessian: torch.Tensor, grid: str, group_size: int = 128, damp: float = 0.01,
                     block_size: int = 128, act_order: bool = False, refits: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ, then `refits` rounds of least-squares scales for the codes (`refit_scales`), each round
    after the first starting with GPTQ codes for the current scales. Each row keeps the best codes and
    scales it has seen, so the result is never worse than plain GPTQ on the calibration inputs."""
    codes, scales = gptq_quantize(w, hessian, grid, group_size, damp, block_size, act_order)
    best = row_errors(w, codes, scales, hessian, group_size)  # [N]
    trial_codes, trial = codes, scales
    for refit in range(refits):
        if refit:
            trial_codes, _ = gptq_quantize(w, hessian, grid, group_size, damp, block_size, act_order, scales=trial)
        trial = refit_scales(w, trial_codes, trial, hessian, group_size, damp)
        err = row_errors(w, trial_codes, trial, hessian, group_size)
        better = err < best  # [N]
        codes = torch.where(better[:, None], trial_codes, codes)
        scales = torch.where(better[:, None], trial, scales)
        best = torch.minimum(best, err)
    return codes, scales
