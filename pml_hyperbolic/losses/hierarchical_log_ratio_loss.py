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


class HierarchicalLogRatioLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Log-ratio loss driven by hierarchical similarity levels.

    For a triplet (i, j, l):

    .. math::
        \ell_{ijl} = \Big(\log \frac{D(z_i, z_j) + \epsilon}{D(z_i, z_l) + \epsilon}
            - (s_{ij} - s_{il}) \log \Omega\Big)^2

    (Yan et al. Eq. (5), :math:`\log \Omega^{s_{ij} - s_{il}}`; plain, not squared, distances as in
    the log-ratio loss of Kim et al. CVPR'19 it builds on).

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

    Why the default Ω is 1.2, not the paper's 10: Ω sets the distance ratios asked between
    similarity levels, 1 : Ω : Ω² : …; ratios as large as 1 : 10 : 100 cannot be reached, so every
    residual keeps one sign and the squared log-ratio stops regressing the ratios: it only pushes
    log D_il − log D_ij up, which the optimiser gets by collapsing the batch where the distance is
    nearly linear. Ω was chosen on a validation split of the training classes.

    Args:
        omega: Ω > 1, default 1.2; ``omega=10.0`` gives the paper's setting.
        eps: ε > 0 added to distances inside both logs (log 0 guard), default 1e-6.
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance()`` (default geometry): the paper embeds in the Poincaré ball; ``reducer``, ...).

    Raises:
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

    def __init__(self, omega: float = 1.2, eps: float = 1e-6, **kwargs):
        super().__init__(**kwargs)
        omega = check_positive(omega, "omega")
        if not omega > 1:
            raise ValueError(f"omega must be > 1 (more similar => closer), got {omega!r}")
        self.omega = omega
        self.eps = check_positive(eps, "eps")
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
        mat = as_compute(self.distance(embeddings, ref_emb))
        if self.distance.is_inverted:
            raise ValueError("distance must be a distance (is_inverted=False): the loss takes log D")
        if indices_tuple is not None:
            a, j, l = lmu.convert_to_triplets(indices_tuple, levels[:, 0], ref_levels[:, 0])
            if a.numel() == 0:
                return self.zero_losses()
            ratio = torch.log(mat[a, j] + self.eps) - torch.log(mat[a, l] + self.eps)
            target = (s[a, j] - s[a, l]).to(mat.dtype) * log_omega
            losses = (ratio - target) ** 2
            return {"loss": {"losses": losses, "indices": (a, j, l), "reduction_type": "triplet"}}
        y = torch.log(mat + self.eps) - s.to(mat.dtype) * log_omega  # x_ij and y_il share this form
        K = levels.shape[1]
        bins = s.clone()
        if ref_emb is embeddings:
            bins.fill_diagonal_(0)  # bin 0: never a partner, never a farther sample
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
