"""Feature maps φ: the kernel that linear attention puts in place of exp(q·k).

A feature map turns a query or key of head dim D into D_f non-linear features so that
φ(q)·φ(k) stands in for the softmax kernel. Maps are small stateless objects (FAVOR+
caches its random projection, regenerated from a seed) with

- ``out_dim(d)``: the feature dimension D_f for head dim d;
- ``__call__(x, start=0, rescale_rows=False)``: features of x (..., N, d), whose rows sit
  at positions start, start+1, ... (only cosFormer looks at positions). With
  ``rescale_rows=True`` the caller divides each row by its own normaliser, so the map may
  scale rows by positive constants (FAVOR+ uses this to keep exp from overflowing);
- ``approximates_exp``: True when the map approximates exp(scale·q·k) itself, so the
  attention scale belongs inside it (√scale on q and k) rather than on the readout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class FeatureMap:
    approximates_exp: bool = False

    def out_dim(self, d: int) -> int:
        return d

    def __call__(self, x: Tensor, start: int = 0, rescale_rows: bool = False) -> Tensor:
        raise NotImplementedError

    def for_call(self, end_position: int, stateful: bool) -> FeatureMap:
        """The map to use for a call whose last key sits at ``end_position - 1``."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__.lower()}()"


class Identity(FeatureMap):
    """φ(x) = x: plain linear attention (RetNet, Lightning, GLA use it)."""

    def __call__(self, x, start=0, rescale_rows=False):
        return x


class EluPlusOne(FeatureMap):
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, arXiv 2006.16236)."""

    def __call__(self, x, start=0, rescale_rows=False):
        return F.elu(x).add_(1)  # elu's backward reads its input, so its output may be reused

    def __repr__(self):
        return "elu+1"


class ReLU(FeatureMap):
    """φ(x) = max(x, 0)."""

    def __call__(self, x, start=0, rescale_rows=False):
        return F.relu(x)


class SiLU(FeatureMap):
    """φ(x) = x·σ(x), the activation DeltaNet and Gated DeltaNet put on q and k."""

    def __call__(self, x, start=0, rescale_rows=False):
        return F.silu(x)


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al. 2021, arXiv 2102.11174, eq. 28).

    r = [relu(x), relu(-x)] (2d); φ_ν(x) = concat over i = 1..ν of r ⊙ roll(r, i): 2dν
    features, each a product of two rectified coordinates, so that distinct keys land
    on nearly orthogonal sparse features.
    """

    def __init__(self, nu: int = 1):
        if not isinstance(nu, int) or nu < 1:
            raise ValueError(f"DPFP(nu): expected a positive int, got {nu!r}")
        self.nu = nu

    def out_dim(self, d):
        return 2 * d * self.nu

    def __call__(self, x, start=0, rescale_rows=False):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([r * r.roll(i, dims=-1) for i in range(1, self.nu + 1)], dim=-1)

    def __repr__(self):
        return f"dpfp(nu={self.nu})"


class Taylor2(FeatureMap):
    """Second-order Taylor features of exp (Based, Arora et al. 2024, arXiv 2402.18668).

    φ(x) = [1, x, vec(x xᵀ)/√2] so that φ(q)·φ(k) = 1 + q·k + (q·k)²/2, the Taylor
    expansion of exp(q·k) to second order; always positive (1 + t + t²/2 > 0).
    D_f = 1 + d + d² (Based projects to d = 16 first: 273 features).
    """

    approximates_exp = True

    def out_dim(self, d):
        return 1 + d + d * d

    def __call__(self, x, start=0, rescale_rows=False):
        outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) * (1 / math.sqrt(2))
        return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)

    def __repr__(self):
        return "taylor2()"


class FAVORPlus(FeatureMap):
    """Positive orthogonal random features (Performer, Choromanski et al. 2020, arXiv 2009.14794).

    φ(x) = exp(W x - |x|²/2) / √m with the m rows of W drawn as blocks of orthogonal
    Gaussian directions, each row rescaled to the norm of a Gaussian vector; then
    E[φ(q)·φ(k)] = exp(q·k) (Lemma 1 of the paper). W comes from ``seed`` (same seed,
    same features); ``redraw()`` draws new features, as the paper does during training.

    Rows of queries may be stabilised by their max logit (a per-row constant that the
    normaliser cancels). Keys are not: a per-key or per-call constant would not cancel
    between calls that pass a state, so key features are computed as exp of at most
    |w|²/2 (finite in float32 for head dims up to ~128).
    """

    approximates_exp = True

    def __init__(self, num_features: int | None = None, seed: int = 0):
        if num_features is not None and (not isinstance(num_features, int) or num_features < 1):
            raise ValueError(f"FAVORPlus(num_features): expected a positive int or None, got {num_features!r}")
        self.num_features = num_features
        self.seed = seed
        self._cache: dict = {}

    def features(self, d: int) -> int:
        """m: d·ln d by default (the paper's Theorem 4 regime), at least d."""
        return self.num_features or max(d, int(d * math.log(d)))

    def out_dim(self, d):
        return self.features(d)

    def redraw(self, seed: int | None = None) -> None:
        self.seed = self.seed + 1 if seed is None else seed
        self._cache.clear()

    def projection(self, d: int, dtype: torch.dtype, device) -> Tensor:
        if torch.compiler.is_compiling():  # no cache to fill inside a graph: drawn by an opaque op on every call
            return _orthogonal_gaussian_op(self.features(d), d, self.seed).to(device=device, dtype=dtype)
        key = (d, dtype, str(device))
        if key not in self._cache:
            self._cache[key] = orthogonal_gaussian(self.features(d), d, self.seed).to(device=device, dtype=dtype)
        return self._cache[key]

    def __call__(self, x, start=0, rescale_rows=False):
        w = self.projection(x.shape[-1], x.dtype, x.device)
        logits = x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)
        if rescale_rows:
            logits = logits - logits.amax(-1, keepdim=True)
        return torch.exp(logits) * (1 / math.sqrt(w.shape[0]))

    def __repr__(self):
        return f"favor+(num_features={self.num_features}, seed={self.seed})"


def orthogonal_gaussian(m: int, d: int, seed: int) -> Tensor:
    """(m, d) float64: stacked blocks of d orthonormal rows (QR of a Gaussian matrix),
    each row scaled to the norm of an independent d-dimensional Gaussian vector."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(math.ceil(m / d), d, d, generator=gen, dtype=torch.float64))
    # Householder QR fixes the sign of R's diagonal, which biases Q's directions; flipping
    # each column by that sign makes Q uniformly (Haar) distributed, as the estimate needs.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    w = q.transpose(-1, -2).reshape(-1, d)[:m]
    norms = torch.randn(m, d, generator=gen, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return w * norms


# A generator cannot be created inside a torch.compile graph: compiled calls draw the
# projection through this op, which the graph keeps as one opaque node.
@torch.library.custom_op("attnkit_mechanisms::orthogonal_gaussian", mutates_args=())
def _orthogonal_gaussian_op(m: int, d: int, seed: int) -> Tensor:
    return orthogonal_gaussian(m, d, seed)


@_orthogonal_gaussian_op.register_fake
def _(m: int, d: int, seed: int) -> Tensor:
    return torch.empty(m, d, dtype=torch.float64)


class CosReweight(FeatureMap):
    """cosFormer (Qin et al. 2022, arXiv 2202.08791): ReLU features re-weighted by
    cos(π/2 · (i - j)/M), decomposed as cos·cos + sin·sin so it stays linear:
    φ(x_i) = [relu(x_i) cos θ_i, relu(x_i) sin θ_i], θ_i = π i / (2M).

    ``max_len`` is M, which must exceed every distance i - j. None takes the paper's
    choice, the length of the sequence, which needs the whole sequence in one call:
    calls that pass or return a state must fix it.
    """

    def __init__(self, max_len: int | None = None):
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"cosformer max_len: expected a positive int or None, got {max_len!r}")
        self.max_len = max_len

    def out_dim(self, d):
        return 2 * d

    def for_call(self, end_position, stateful):
        if self.max_len is None:
            if stateful:
                raise ValueError(
                    "max_len: cosFormer's re-weighting horizon M must be fixed for calls that pass or return a state; "
                    "build the mechanism with context= (cosformer) or feature_map=CosReweight(max_len) at least the "
                    "longest sequence; attnkit.nn.TransformerLM and attnkit.hf.use pass the model's context length"
                )
            return CosReweight(max(end_position, 1))
        if end_position > self.max_len:
            raise ValueError(
                f"max_len: cosFormer was built with max_len={self.max_len} but this call reaches position {end_position}"
            )
        return self

    def __call__(self, x, start=0, rescale_rows=False):
        if self.max_len is None:
            raise ValueError("max_len: cosFormer needs its horizon M; call for_call() first")
        pos = torch.arange(start, start + x.shape[-2], device=x.device, dtype=x.dtype)
        theta = (pos * (math.pi / (2 * self.max_len))).unsqueeze(-1)
        r = F.relu(x)
        return torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=-1)

    def __repr__(self):
        return f"cosformer(max_len={self.max_len})"


class _Normalised(FeatureMap):
    """A feature map whose rows are rescaled after ``inner``; subclasses say how (``normalise``)."""

    def __init__(self, inner: FeatureMap, eps: float = 1e-6):
        self.inner, self.eps = inner, eps

    @property
    def approximates_exp(self):
        return self.inner.approximates_exp

    def out_dim(self, d):
        return self.inner.out_dim(d)

    def for_call(self, end_position, stateful):
        inner = self.inner.for_call(end_position, stateful)
        return self if inner is self.inner else type(self)(inner, self.eps)

    def __call__(self, x, start=0, rescale_rows=False):
        return self.normalise(self.inner(x, start))

    def normalise(self, f: Tensor) -> Tensor:
        raise NotImplementedError


class L2Norm(_Normalised):
    """inner(x) / |inner(x)|: unit-norm keys keep the delta rule's update a contraction
    (DeltaNet, Yang et al. 2024, arXiv 2406.06484)."""

    def normalise(self, f):
        return f * torch.rsqrt((f * f).sum(-1, keepdim=True) + self.eps)

    def __repr__(self):
        return f"l2norm({self.inner!r})"


class SumNorm(_Normalised):
    """inner(x) / Σ inner(x): features that sum to one (Schlag et al. 2021, arXiv 2102.11174,
    Sec. 4.2), used with the delta rule in place of the attention normaliser. Sums below
    1e-6 (an all-zero DPFP row) divide by 1e-6 instead of making NaN."""

    def normalise(self, f):
        return f / f.sum(-1, keepdim=True).clamp_min(self.eps)

    def __repr__(self):
        return f"sumnorm({self.inner!r})"


_NAMED = {
    "identity": Identity,
    "elu+1": EluPlusOne,
    "relu": ReLU,
    "silu": SiLU,
    "dpfp": DPFP,
    "taylor2": Taylor2,
    "favor+": FAVORPlus,
    "cosformer": CosReweight,
    "silu+l2": lambda: L2Norm(SiLU()),
    "dpfp+sum": lambda: SumNorm(DPFP()),
}


def feature_map(spec) -> FeatureMap:
    """A FeatureMap from an instance or one of the names in ``FEATURE_MAPS``."""
    if isinstance(spec, FeatureMap):
        return spec
    if isinstance(spec, str) and spec in _NAMED:
        return _NAMED[spec]()
    raise ValueError(f"feature_map: expected a FeatureMap or one of {', '.join(_NAMED)}, got {spec!r}")


FEATURE_MAPS = tuple(_NAMED)
