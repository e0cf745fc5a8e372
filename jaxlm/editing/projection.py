"""CrispEdit's matrix-free Kronecker eigenbasis projector (Ikram et al., ICML 2026,
arXiv 2602.15823; the projector of the reference code's ``ProjectedAdam``).

With ``A = U_A diag(s_A) U_A^T`` and ``B = U_B diag(s_B) U_B^T``, the eigenvalues of
``A (x) B`` are ``M[i, j] = s_A[i] s_B[j]`` with eigenvectors ``u_A,i (x) u_B,j``. The
top-energy directions are the fewest largest ``M[i, j]`` whose sum reaches ``energy`` of
the trace; a gradient ``G [d_in, d_out]`` is projected onto the rest::

    P(G) = U_A ((U_A^T G U_B) * keep) U_B^T,     keep = M < tau,

never forming the ``(d_in d_out)^2`` matrix. ``energy=0`` keeps everything (plain
fine-tuning); with ``B = I`` the ranking is by ``A`` alone (AlphaEdit/Adam-NSCL's
activation null space, `activation_only`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxlm.editing.kfac import KFACFactors


@struct.dataclass
class KroneckerProjector:
    """Per edited layer ``n``: ``U_A [n, d_in, d_in]``, ``U_B [n, d_out, d_out]``,
    ``keep [n, d_in, d_out]`` (True: low-curvature direction, kept)."""

    U_A: jax.Array
    U_B: jax.Array
    keep: jax.Array

    def __call__(self, G: jax.Array) -> jax.Array:
        """Project ``G [n, d_in, d_out]`` (or one layer ``[d_in, d_out]`` when n == 1... use
        `project_one` for a single layer)."""
        chex.assert_equal_shape((G, self.keep))
        return jax.vmap(project_one)(G, self.U_A, self.U_B, self.keep)

    @property
    def kept_fraction(self) -> jax.Array:
        return jnp.mean(self.keep.astype(jnp.float32), axis=(1, 2))


def project_one(G, U_A, U_B, keep):
    """``U_A ((U_A^T G U_B) * keep) U_B^T`` for one layer."""
    coeffs = jnp.einsum("ia,ij,jb->ab", U_A, G.astype(jnp.float32), U_B)
    return jnp.einsum("ia,ab,jb->ij", U_A, coeffs * keep, U_B).astype(G.dtype)


def energy_mask(s_A: jax.Array, s_B: jax.Array, energy: float) -> jax.Array:
    """``keep [d_in, d_out]``: False on the fewest largest ``s_A[i] s_B[j]`` holding
    ``energy`` of their sum (the reference code's ``searchsorted(cumsum) + 1`` rule)."""
    M = jnp.maximum(s_A, 0)[:, None] * jnp.maximum(s_B, 0)[None, :]
    if energy <= 0:
        return jnp.ones(M.shape, bool)
    s = jnp.sort(M.ravel())[::-1]
    # cumsum(s) >= energy * sum(s), without dividing (XLA's multiply-by-reciprocal put 20/25
    # one ulp under 0.8, which blocked a whole tied group) and with a few ulps of slack for
    # float32 sums that land on the threshold
    target = energy * jnp.sum(s) * (1 - 1e-6)
    r = jnp.minimum(jnp.searchsorted(jnp.cumsum(s), target) + 1, s.size)
    # no curvature at all: no direction holds any energy, so none is blocked
    return (M < s[r - 1]) | (jnp.sum(s) <= 0)


def check_energy(energy: float) -> float:
    if isinstance(energy, bool) or not isinstance(energy, (int, float)) or not 0 <= energy < 1:
        raise ValueError(f"energy={energy!r} is invalid: must be a fraction in [0, 1) (CrispEdit uses 0.8-0.99)")
    return float(energy)


def projector_from_factors(factors: KFACFactors, energy: float, *, activation_only: bool = False) -> KroneckerProjector:
    """Eigendecompose each layer's factors and keep the directions outside the top
    ``energy`` of ``A (x) B`` (of ``A (x) I`` with ``activation_only``)."""
    energy = check_energy(energy)
    s_A, U_A = jnp.linalg.eigh(factors.A.astype(jnp.float32))
    s_B, U_B = jnp.linalg.eigh(factors.B.astype(jnp.float32))
    if activation_only:
        s_B = jnp.ones_like(s_B)
        U_B = jnp.broadcast_to(jnp.eye(s_B.shape[-1]), U_B.shape)
    keep = jax.vmap(lambda a, b: energy_mask(a, b, energy))(s_A, s_B)
    return KroneckerProjector(U_A=U_A, U_B=U_B, keep=keep)


def explicit_projector(proj: KroneckerProjector, layer: int = 0) -> jax.Array:
    """The dense ``(d_in d_out)^2`` projector of one layer, for tests on small sizes:
    ``(U_A (x) U_B) diag(vec keep) (U_A (x) U_B)^T`` acting on row-major ``vec(G)``."""
    U = jnp.kron(proj.U_A[layer], proj.U_B[layer])
    return U @ jnp.diag(proj.keep[layer].ravel().astype(U.dtype)) @ U.T


def project_updates(projectors) -> optax.GradientTransformation:
    """An optax transformation that projects each update leaf with its `KroneckerProjector`
    (``projectors`` mirrors the update tree, a projector where a leaf is edited and None
    where it passes through). Chain it before any optimizer:
    ``optax.chain(project_updates(P), optax.adam(lr))`` projects raw gradients, then
    takes an Adam step, as CrispEdit's ``ProjectedAdam``."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        projected = jax.tree.map(
            lambda u, p: u if p is None else p(u), updates, projectors,
            is_leaf=lambda x: x is None or isinstance(x, KroneckerProjector),
        )
        return projected, state

    return optax.GradientTransformation(init, update)
