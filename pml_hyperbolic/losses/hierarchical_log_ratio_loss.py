"""Log-ratio loss with hierarchical similarity (Yan et al., "Unsupervised Hyperbolic Metric
Learning", CVPR 2021, Eq. (4)-(5))."""
from __future__ import annotations

import math

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from ..distances import PoincareDistance
from ..hierarchy_levels import as_hierarchical_labels, pairwise_first_shared_level
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import as_compute, check_inputs_on_call, check_positive, sub_loss_reducer_type


def _per_level_tables(y: torch.Tensor, bins: torch.Tensor, K: int):
    """Per row i and bin b (0 = excluded, 1..K+1 = similarity level): count, Σy, Σy² (float64)."""
    shape = (y.shape[0], K + 2)
    yd = y.double()
    count = torch.zeros(shape, dtype=torch.float64, device=y.device).scatter_add_(
        1, bins, torch.ones_like(yd))
    sum1 = torch.zeros(shape, dtype=torch.float64, device=y.device).scatter_add(1, bins, yd)
    sum2 = torch.zeros(shape, dtype=torch.float64, device=y.device).scatter_add(1, bins, yd * yd)
    return count, sum1, sum2


def _one_sided_dense(y: torch.Tensor, bins: torch.Tensor, K: int):
    """Per pair (i, j) with level t = bins[i, j] in 1..K: the mean over the farther set
    {l : bins[i, l] > t} of relu(y_ij − y_il)², and whether that set is non-empty.

    Per level t the farther values of each row are sorted once; for every partner j the terms with
    y_il < y_ij are n·y_ij² − 2·y_ij·Σy_il + Σy_il², read from prefix sums at the sorted position
    of y_ij (O(K·B² log B), no B³ tensor)."""
    yd = y.double()
    n, m = yd.shape
    out = torch.zeros_like(yd)
    has = torch.zeros(yd.shape, dtype=torch.bool, device=y.device)
    zero_col = torch.zeros(n, 1, dtype=yd.dtype, device=y.device)
    for t in range(1, K + 1):
        pairs = bins == t
        if not bool(pairs.any()):
            continue
        far = bins > t
        n_far = far.sum(1, keepdim=True)
        vals = torch.where(far, yd, torch.full_like(yd, float("inf")))
        srt, _ = torch.sort(vals, dim=1)
        finite = torch.where(torch.isfinite(srt), srt, torch.zeros_like(srt))
        p1 = torch.cat([zero_col, finite.cumsum(1)], 1)
        p2 = torch.cat([zero_col, (finite * finite).cumsum(1)], 1)
        k = torch.searchsorted(srt.detach().contiguous(), yd.detach().contiguous())  # #farther values < y_ij
        k = torch.minimum(k, n_far.expand(-1, m))
        s1, s2 = p1.gather(1, k), p2.gather(1, k)
        total = (k.to(yd.dtype) * yd * yd - 2 * yd * s1 + s2).clamp_min(0)  # float64: no real cancellation
        mean = total / n_far.clamp_min(1).to(yd.dtype)
        valid = pairs & (n_far > 0)
        out = torch.where(valid, mean, out)
        has = has | valid
    return out, has


def _radius_detached(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the same value whose gradient has no radial component: x/‖x‖ · stop_grad(‖x‖)."""
    norm = x.norm(dim=-1, keepdim=True)
    return x / norm.clamp_min(torch.finfo(x.dtype).tiny) * norm.detach()


class HierarchicalLogRatioLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Log-ratio loss driven by hierarchical similarity levels.

    For a triplet (i, j, l):

    .. math::
        \ell_{ijl} = \Big(\log \frac{D(z_i, z_j) + \epsilon}{D(z_i, z_l) + \epsilon}
            - (s_{ij} - s_{il}) \log \Omega\Big)^2

    (Yan et al. Eq. (5), :math:`\log \Omega^{s_{ij} - s_{il}}`; plain, not squared, distances as in
    the log-ratio loss of Kim et al. CVPR'19 it builds on). With ``one_sided=True`` (the default) only
    a farther sample that is not yet :math:`\Omega^{s_{il} - s_{ij}}` times as far costs:

    .. math::
        \ell^{+}_{ijl} = \Big[\log \frac{D(z_i, z_j) + \epsilon}{D(z_i, z_l) + \epsilon}
            - (s_{ij} - s_{il}) \log \Omega\Big]_+^2 .

    Why one-sided by default: in the ball, distance ratios are not scale-free. Far from the origin
    :math:`D(x, y) \approx d_0(x) + d_0(y) + 2\log\sin(\theta/2)/\sqrt{c}`, so moving every point
    outward pulls all ratios towards 1. The two-sided square penalises ratios *above* the target too,
    and its cheapest way to shrink them is that radial drift: trained on pseudo-labels it ends with
    every embedding at the clip radius (the radius then carries nothing). The hinge never asks a
    ratio to shrink, so it has no outward pull; ``one_sided=False`` is the paper's regression.

    **Similarity levels.** ``labels`` is 1-D (one level) or (N, K) with column k the cluster id at
    level k, finest first (as ``HierarchicalPseudoLabeler.fit_predict`` returns). s_ij is the
    1-based level at which i and j *first* share a cluster: 1 = same finest cluster = merged
    earliest = most similar, K + 1 = never merged within the K levels (1-D labels: 1 same class, 2
    different). With Ω > 1, s_ij < s_il asks D_il = Ω^{s_il − s_ij}·D_ij: more similar ⇒ closer.

    **Triplets.** With an ``indices_tuple`` (PML triplets, e.g. ``HierarchicalSimilarityMiner``):
    exactly those, one element each ("triplet"). Without: *all* dense triplets per anchor, i.e. every
    (i, j, l) with j, l ≠ i and s_ij < s_il — computed exactly without enumerating them: for fixed
    (i, j) the mean over its l's is :math:`(x_{ij} - \mu_i(t))^2 + \sigma^2_i(t)` with
    :math:`x_{ij} = \log(D_{ij}+\epsilon) - s_{ij}\log\Omega`, :math:`y_{il}` likewise, and
    μ, σ² the mean / variance of :math:`y_{il}` over {l : s_il > t}, t = s_ij. Per anchor, one pass
    bins the row by level (count, Σy, Σy² per level, accumulated in float64; σ² = E[y²] − μ²) and
    suffix sums over the K + 1 levels give μ_i(t), σ²_i(t): O(B²) time and memory, B³ triplets
    never formed. Each (i, j) contributes its mean over l as one element ("pos_pair"), so the
    default ``MeanReducer`` averages anchor–partner pairs (each pair weighted equally, as in
    Kim et al.'s per-anchor dense triplets), not raw triplets; with ``MeanReducer`` that average is
    itself summed from the per-level tables (:math:`\sum_{j:\,s_{ij}=t}(x_{ij}-\mu)^2 =
    \Sigma x^2 - 2\mu\Sigma x + n\mu^2`) and returned "already_reduced"; other reducers get the
    per-pair elements.

    **Radius.** With ``train_radius=False`` (the default) the loss's value is unchanged but its
    gradient reaches the embeddings without its radial component: each point is moved along its
    sphere of constant d₀, :math:`\nabla_{x}\ell \mapsto (I - \hat x\hat x^\top)\nabla_{x}\ell`
    (computed as :math:`x/\lVert x\rVert \cdot \operatorname{sg}(\lVert x\rVert)`), so the loss
    trains directions and leaves the radius to the head's initialisation or to other terms (e.g.
    ``RadialCalibrationLoss``). Why: distance ratios in the ball change with the radius alone (near
    the origin they are those of Euclidean space, far out they tend to 1), so a loss on ratios always
    has a radial way down: outward for the two-sided square, inward for the one-sided hinge, where
    the points' different radii then reorder the Poincaré neighbours of a query. ``train_radius=True``
    lets the full gradient through (the paper's setting).

    Why the default Ω is 1.2, not the paper's 10: Ω sets the distance ratios asked between
    similarity levels, 1 : Ω : Ω² : …; ratios as large as 1 : 10 : 100 cannot be reached, so every
    residual keeps one sign and the squared log-ratio stops regressing the ratios: it only pushes
    log D_il − log D_ij up, which the optimiser gets by collapsing the batch where the distance is
    nearly linear. Ω was chosen on a validation split of the training classes.

    Args:
        omega: Ω > 1, default 1.2; ``omega=10.0`` gives the paper's setting.
        eps: ε > 0 added to distances inside both logs (log 0 guard), default 1e-6.
        one_sided: True (default): the hinge :math:`\ell^{+}`; False: the paper's squared residual.
        train_radius: False (default): no radial gradient (see **Radius**); True: the full gradient.
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance()`` (default geometry): the paper embeds in the Poincaré ball; ``reducer``, ...).

    With ``one_sided=True`` the dense path sorts, per anchor and level, the farther samples'
    :math:`y_{il}` once and reads :math:`\sum_{l:\,y_{il} < x_{ij}} (x_{ij} - y_{il})^2` from prefix sums
    at the sorted position of :math:`x_{ij}` (O(K·B² log B)); each (i, j) is one "pos_pair" element.

    Raises:
        TypeError: ``one_sided`` or ``train_radius`` not a bool.
        ValueError: ``omega`` ≤ 1 or ``eps`` ≤ 0; at call time, a ``distance`` that is a similarity
            (``is_inverted``), or ``labels`` / ``ref_labels`` with different numbers of levels.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) or (N, K) with one row per embedding, a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors.

    Design note: docs/design/losses.md
    """

    def __init__(self, omega: float = 1.2, eps: float = 1e-6, one_sided: bool = True, train_radius: bool = False,
                 **kwargs):
        if not isinstance(one_sided, bool):
            raise TypeError(f"one_sided must be a bool (True: only too-small ratios cost; False: the paper's "
                            f"squared regression), got {type(one_sided).__name__} {one_sided!r}")
        if not isinstance(train_radius, bool):
            raise TypeError(f"train_radius must be a bool (False: the loss moves directions only; True: the full "
                            f"gradient, the paper's), got {type(train_radius).__name__} {train_radius!r}")
        super().__init__(**kwargs)
        omega = check_positive(omega, "omega")
        if not omega > 1:
            raise ValueError(f"omega must be > 1 (more similar => closer), got {omega!r}")
        self.omega = omega
        self.eps = check_positive(eps, "eps")
        self.one_sided = one_sided
        self.train_radius = train_radius
        self.add_to_recordable_attributes(list_of_names=["omega"], is_stat=False)
        check_inputs_on_call(self, hierarchical=True)

    def get_default_distance(self):
        return PoincareDistance()

    def get_default_reducer(self):
        return MeanReducer()

    @staticmethod
    def _as_levels(labels, n, name):
        return as_hierarchical_labels(labels, name, n)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None,
                indices_tuple: tuple | None = None, ref_emb: torch.Tensor | None = None,
                ref_labels: torch.Tensor | None = None):
        """As PML's forward, but ``labels``/``ref_labels`` may be (N, K) hierarchical labels."""
        self.reset_stats()
        levels = self._as_levels(labels, embeddings.shape[0], "labels").to(embeddings.device)
        if ref_emb is None:
            ref_emb, ref_levels = embeddings, levels
        else:
            ref_levels = self._as_levels(ref_labels, ref_emb.shape[0], "ref_labels").to(ref_emb.device)
            if ref_levels.shape[1] != levels.shape[1]:
                raise ValueError(f"ref_labels must have the same number of levels K as labels "
                                 f"({levels.shape[1]}), got {ref_levels.shape[1]}")
        loss_dict = self.compute_loss(embeddings, levels, indices_tuple, ref_emb, ref_levels)
        self.add_embedding_regularization_to_loss_dict(loss_dict, embeddings)
        return self.reducer(loss_dict, embeddings, levels[:, 0])

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        levels = self._as_levels(labels, embeddings.shape[0], "labels")
        ref_levels = self._as_levels(ref_labels, ref_emb.shape[0], "ref_labels")
        s = pairwise_first_shared_level(levels, ref_levels)
        log_omega = math.log(self.omega)
        if self.train_radius:
            mat = as_compute(self.distance(embeddings, ref_emb))
        else:
            emb_d = _radius_detached(embeddings)
            mat = as_compute(self.distance(emb_d, emb_d if ref_emb is embeddings else _radius_detached(ref_emb)))
        if self.distance.is_inverted:
            raise ValueError("distance must be a distance (is_inverted=False): the loss takes log D")
        if indices_tuple is not None:
            a, j, l = lmu.convert_to_triplets(indices_tuple, levels[:, 0], ref_levels[:, 0])
            if a.numel() == 0:
                return self.zero_losses()
            ratio = torch.log(mat[a, j] + self.eps) - torch.log(mat[a, l] + self.eps)
            gap = (s[a, j] - s[a, l]).to(mat.dtype)
            residual = ratio - gap * log_omega
            if self.one_sided:  # only a farther sample that is not Ω^gap times as far costs
                residual = torch.relu(-torch.sign(gap) * residual)
            losses = residual ** 2
            return {"loss": {"losses": losses, "indices": (a, j, l), "reduction_type": "triplet"}}
        y = torch.log(mat + self.eps) - s.to(mat.dtype) * log_omega  # x_ij and y_il share this form
        K = levels.shape[1]
        bins = s.clone()
        if ref_emb is embeddings:
            bins.fill_diagonal_(0)  # bin 0: never a partner, never a farther sample
        if self.one_sided:
            per_pair, valid = _one_sided_dense(y, bins, K)
            i, j = torch.where(valid)
            if i.numel() == 0:
                return self.zero_losses()
            losses = per_pair[i, j].to(mat.dtype)
            return {"loss": {"losses": losses, "indices": (i, j), "reduction_type": "pos_pair"}}
        count, sum1, sum2 = _per_level_tables(y, bins, K)
        # farther set of a pair at level t: bins t+1 .. K+1 (suffix sums over the bins)
        farther = [torch.flip(torch.flip(v, [1]).cumsum(1), [1])[:, 2:] for v in (count, sum1, sum2)]
        n_far, mu = farther[0], farther[1] / farther[0].clamp_min(1)  # (B, K), column t - 1
        var = (farther[2] / farther[0].clamp_min(1) - mu * mu).clamp_min(0)
        has_farther = n_far > 0
        if sub_loss_reducer_type(self) is MeanReducer:
            # Σ_{j in bin t} (y_ij − μ_t)² + σ²_t = Σy² − 2μ_t Σy + n_t (μ_t² + σ²_t), from the tables
            n_t, s1_t, s2_t = count[:, 1:K + 1], sum1[:, 1:K + 1], sum2[:, 1:K + 1]
            per_level = s2_t - 2 * mu * s1_t + n_t * (mu * mu + var)
            n_pairs = (n_t * has_farther).sum()
            if float(n_pairs) == 0:
                return self.zero_losses()
            loss = (torch.where(has_farther, per_level, 0.0).sum() / n_pairs).to(mat.dtype)
            return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}
        level_idx = bins.clamp(1, K) - 1
        valid = (bins >= 1) & (bins <= K) & has_farther.gather(1, level_idx)
        i, j = torch.where(valid)
        if i.numel() == 0:
            return self.zero_losses()
        t_idx = level_idx[i, j]
        losses = ((y[i, j].double() - mu[i, t_idx]) ** 2 + var[i, t_idx]).to(mat.dtype)
        return {"loss": {"losses": losses, "indices": (i, j), "reduction_type": "pos_pair"}}
