"""Block transforms for joint weight + activation (W4A4) quantization.

For a linear layer ``y = x @ W`` (``W [C, R]``, jaxlm's ``[in, out]``) and a block-diagonal
invertible ``T = diag(T_1 .. T_{C/B})``, ``y = (T x) . (T^{-T} W)`` exactly, and the W4A4
product is ``Q(T x) . Q(T^{-T} W)`` with both operands quantized in blocks of ``B`` along
``C`` (``B`` = 32 for MXFP4, 16 for NVFP4, the group for INT4):

* `identity_transform`: RTN, ``T_i = I``;
* `hadamard_transform`: one shared normalised Sylvester Hadamard ``H_B`` per block
  (QuaRot-style, Ashkboos et al. 2024);
* `wush_transform`: WUSH (arXiv 2512.00956; IST-DASLab/WUSH ``get_transform(..., 'wush')``),
  a distinct non-orthogonal ``T_i`` per block built in closed form from the calibration
  second moment ``H`` and the weights, exactly as the reference code does:

  1. damp ``H += 0.01 mean(diag H) I`` until the Cholesky factorisation succeeds, upper
     factor ``U`` (``U^T U = H``);
  2. per block ``i`` (RTN mode): ``y_i = U_ii W_i`` (``W_i`` the block's ``B`` input rows);
  3. SVD ``y_i = V diag(s) Uh^T``; ``s <- s / sqrt(R)``, ``s <- s + 0.01 mean(s)``;
  4. ``T_i = H_B diag(s)^{1/2} V^T U_ii^{-T}`` (``hadamard=False``: the ``'wus'`` variant
     without ``H_B``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.quant.formats import QFormat, fake_quant, fake_quant_tokens, get_format
from kernels_pallas.formats import walsh_hadamard


def _check_blocks(C: int, block: int) -> int:
    if C % block:
        raise ValueError(f"input size {C} is not a multiple of the block size {block}")
    return C // block


def identity_transform(C: int, block: int) -> jax.Array:
    """``[C/B, B, B]`` identities (plain RTN)."""
    return jnp.broadcast_to(jnp.eye(block, dtype=jnp.float32), (_check_blocks(C, block), block, block))


def hadamard_transform(C: int, block: int) -> jax.Array:
    """``[C/B, B, B]``: the normalised Hadamard ``H_B / sqrt(B)`` in every block."""
    H = jnp.asarray(walsh_hadamard(block), jnp.float32)  # already normalised
    return jnp.broadcast_to(H, (_check_blocks(C, block), block, block))


def damped_cholesky_upper(H: np.ndarray, damp: float = 0.01, tries: int = 100) -> np.ndarray:
    """Upper ``U`` with ``U^T U = H + k damp mean(diag H) I`` for the smallest ``k >= 1``
    that factorises (the reference damps before the first try)."""
    H = np.asarray(H, np.float64)
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < np.inf:
        raise ValueError(f"damp={damp!r} is invalid: must be a finite number > 0 (a fraction of H's mean diagonal)")
    step = damp * float(np.mean(np.diag(H)))
    if not step > 0:
        raise ValueError("the calibration second moment has a non-positive mean diagonal")
    eye = np.eye(H.shape[0])
    for k in range(1, tries + 1):
        try:
            return np.linalg.cholesky(H + k * step * eye).T
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError(f"H is not positive definite after {tries} dampings")


def wush_transform(H, W, block: int, *, hadamard: bool = True, damp: float = 0.01) -> jax.Array:
    """WUSH's per-block transforms ``[C/B, B, B]`` for ``W [C, R]`` and ``H = E[x x^T]``
    ``[C, C]`` (RTN inner rounding: ``y_i = U_ii W_i``). Computed in float64 on the host."""
    W = np.asarray(W, np.float64)
    C, R = W.shape
    n = _check_blocks(C, block)
    if np.shape(H) != (C, C):
        raise ValueError(f"H has shape {np.shape(H)}, expected ({C}, {C}) for W of shape {W.shape}")
    if R < block:
        raise ValueError(f"WUSH needs at least {block} output columns (the block size), W has {R}")
    U = damped_cholesky_upper(H, damp)
    Hb = walsh_hadamard(block).astype(np.float64) if hadamard else np.eye(block)
    out = np.empty((n, block, block))
    for i in range(n):
        sl = slice(i * block, (i + 1) * block)
        Uii = U[sl, sl]
        out[i] = wush_block(Uii, Uii @ W[sl], Hb)
    return jnp.asarray(out, jnp.float32)


def wush_block(Uii: np.ndarray, y: np.ndarray, Hb: np.ndarray) -> np.ndarray:
    """One WUSH block (float64): SVD ``y = V diag(s) Uh^T`` of the block target ``y [B, R]``,
    ``s <- s / sqrt(R) + 0.01 mean(s / sqrt(R))``, ``T_i = Hb diag(s)^{1/2} V^T U_ii^{-T}``.
    ``y = U_ii W_i`` in RTN mode; GPTQ mode (`jaxlm.quant.gptq`) adds the propagated error."""
    V, s, _ = np.linalg.svd(y, full_matrices=False)
    s = s / np.sqrt(y.shape[1])
    s = s + 0.01 * s.mean()
    if not s.max() > 0:  # an all-zero block target (dead input channels): any invertible T serves
        s = np.ones_like(s)
    return Hb @ np.diag(np.sqrt(s)) @ V.T @ np.linalg.inv(Uii).T


def transform_activations(x: jax.Array, T: jax.Array) -> jax.Array:
    """``T x`` blockwise over the last axis: ``x [..., C]`` -> ``[..., C]``."""
    n, B, _ = T.shape
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], n, B)
    return jnp.einsum("...ng,nhg->...nh", xb, T).reshape(x.shape)


def transform_weights(W: jax.Array, T: jax.Array) -> jax.Array:
    """``T^{-T} W`` blockwise over the input axis: ``W [C, R]`` -> ``[C, R]``."""
    n, B, _ = T.shape
    Wb = W.astype(jnp.float32).reshape(n, B, W.shape[-1])
    return jnp.linalg.solve(jnp.swapaxes(T, 1, 2), Wb).reshape(W.shape)


def w4a4_matmul(x: jax.Array, W: jax.Array, T: jax.Array, fmt: str | QFormat) -> jax.Array:
    """``Q(T x) . Q(T^{-T} W)``: both operands fake-quantized in blocks along ``C`` (the
    output error of a W4A4 layer under transform ``T``); activations per token
    (`fake_quant_tokens`), as the quantized models run them."""
    fmt = get_format(fmt)
    if T.shape[1] != fmt.block:
        raise ValueError(f"transform blocks are {T.shape[1]}, the {fmt.name} block is {fmt.block}")
    xq = fake_quant_tokens(transform_activations(x, T), fmt)
    wq = fake_quant(transform_weights(W, T), fmt, axis=-2)
    return jnp.dot(xq, wq)
