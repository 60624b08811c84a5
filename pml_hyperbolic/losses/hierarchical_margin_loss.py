"""Hierarchical-margin loss (supervised extension of Yan et al., CVPR 2021, Sec. 3.5).

Design note: docs/design/losses.md
"""
from __future__ import annotations

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import AvgNonZeroReducer

from ..distances import PoincareDistance
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import as_compute, check_bool, check_inputs_on_call, check_nonnegative, pair_masks, sub_loss_reducer_type
from .._batch_utils import self_match_mask
from ..hierarchy_levels import as_hierarchical_labels, pairwise_first_shared_level


MARGIN_FORMS = ("triplet", "contrastive")


def _count_below(sorted_rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(B, R) int64: #{m : sorted_rows[b, m] < values[b, r]} (``searchsorted``, side "left").

    For a few thresholds per row (K ≤ 32, e.g. the positives of an anchor) K comparisons over the
    (B, R) matrix are faster on CPU than aten's per-element binary search."""
    k = sorted_rows.shape[1]
    if k > 32:
        return torch.searchsorted(sorted_rows, values.contiguous(), side="left")
    count = (sorted_rows[:, :1] < values).to(torch.uint8)
    for m in range(1, k):
        count += sorted_rows[:, m:m + 1] < values
    return count.long()


def _mean_active_hinge(pos_dist: torch.Tensor, anchors: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    r"""Mean of the non-zero hinges :math:`[D_{ap} + g_{an}]_+` over every positive pair (a, p) and every n.

    ``pos_dist`` (P,): :math:`D_{ap}` of the P positive pairs, ``anchors`` (P,) their rows
    (non-decreasing, as ``torch.where`` lists them), ``gap`` (B, R): :math:`g_{an} = M_n(a, n) - D_{an}`,
    −inf where n is no negative of a. Per anchor, sort its K thresholds :math:`u = -D_{ap}`
    ascending; :math:`g_{an}` is active (non-zero hinge) for the pairs at sorted positions
    :math:`m \le b_{an} = \#\{m : u_m < g_{an}\}` (binary search). Binning each row's g by b
    (count and sum per bin) and taking suffix sums over the bins gives, for the pair at position m,
    :math:`c_m` = its number of active n and :math:`S_m` = the sum of their g, so

    .. math::
        \text{value} = \frac{\sum_{m} \big(c_m D_m + S_m\big)}{\max(1, \sum_m c_m)}

    equals ``hinge.sum() / count_nonzero(hinge)`` of the (P, R) hinge matrix, with the same
    gradient (:math:`c_m` to :math:`D_m`, the number of pairs it is active for to :math:`g_{an}`),
    in O(B·R log K) instead of O(P·R) (g > −D ⇔ D + g > 0 also in floating point: a rounded sum is
    zero only when the exact one is). Sums in float64: c·D and S nearly cancel.
    """
    rows = gap.shape[0]
    per_row = torch.bincount(anchors, minlength=rows)
    first = torch.cumsum(per_row, 0) - per_row
    rank = torch.arange(anchors.numel(), device=gap.device) - first[anchors]
    k = max(int(per_row.max()) if rows else 0, 1)
    thresholds = gap.new_full((rows, k), float("inf"))  # +inf padding: below no g, so no bin beyond K_a
    thresholds[anchors, rank] = -pos_dist.detach()
    thresholds, order = thresholds.sort(dim=1)
    position = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=gap.device).expand(rows, k))
    m = position[anchors, rank] + 1  # 1-based sorted position of each pair's threshold
    bins = _count_below(thresholds, gap.detach())  # (B, R) b_an in [0, K]
    active = bins > 0  # bin 0 (incl. every −inf) is active for no pair
    bins = bins.masked_fill(~active, 0)
    bin_count = torch.zeros(rows, k + 1, dtype=torch.float64, device=gap.device).scatter_add_(
        1, bins, active.to(torch.float64))
    bin_sum = torch.zeros(rows, k + 1, dtype=torch.float64, device=gap.device).scatter_add(
        1, bins, gap.to(torch.float64).masked_fill(~active, 0.0))  # no −inf enters a sum
    counts = bin_count.flip(1).cumsum(1).flip(1)[anchors, m]  # Σ over bins ≥ m
    sums = bin_sum.flip(1).cumsum(1).flip(1)[anchors, m]
    total = (counts * pos_dist.to(torch.float64) + sums).sum()
    return (total / counts.sum().clamp_min(1)).to(gap.dtype)


class HierarchicalMarginLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Margin loss with per-class-pair margins from running class-mean distances.

    With :math:`d_{ab}` the mean distance between samples of classes a and b (Eq. (6)) and
    :math:`d_a` the mean distance between distinct samples of class a (Eq. (7)), Yan et al. define

    .. math::
        M_p(a) = d_a + \gamma, \qquad M_n(a, b) = d_{ab} - d_a + \gamma \quad \text{(Eq. (8), (9))}

    and say the margins "can be integrated into any metric loss". ``margin_form`` picks how:

    * ``"triplet"`` (**default**): :math:`M_n` is the margin of a triplet loss, as the violate
      margin :math:`\beta + d_H(y_a, y_n) - S_{y_a}` of the hierarchical triplet loss their γ refers
      to (Ge, ECCV'18, their ref. [12]), over every (anchor i, positive j, negative l):

      .. math:: \mathcal{L} = \operatorname{red}_{(i,j,l)}[D_{ij} - D_{il} + M_n(y_i, y_l)]_+

      one sub-loss ``triplet_loss``; :math:`M_p` is not used.
    * ``"contrastive"``: the margins as the thresholds of a contrastive (pair) loss — PML
      ``ContrastiveLoss``'s form, sub-losses ``pos_loss`` and ``neg_loss``:

      .. math:: \mathcal{L} = \operatorname{red}_{(i,j) \in P}[D_{ij} - M_p(y_i)]_+
            + \operatorname{red}_{(i,l) \in N}[M_n(y_i, y_l) - D_{il}]_+

      ``HierarchicalMarginLoss(num_classes, gamma=0.1, margin_form="contrastive")`` with 1-D labels
      is Eq. (8)-(9) exactly as written (the paper gives no value of γ).

    Why the triplet form is the default: :math:`M_n` is a *gap* (a difference of two distances),
    which the contrastive form compares with an absolute distance, so that form can be met by
    shrinking every distance to the scale of γ without separating the classes; the triplet form
    compares :math:`D_{il}` with :math:`D_{ij}`, is scale free, and keeps separating.

    **Reduction.** Default ``AvgNonZeroReducer`` (mean over the non-zero hinges of each sub-loss).
    With it and no ``indices_tuple`` the sub-losses are reduced on dense hinge matrices and returned
    "already_reduced" (same values, no pair / triplet lists); any other reducer receives every pair
    (contrastive form) or every triplet (triplet form, ``reduction_type="triplet"``). An
    ``indices_tuple`` restricts the positive and negative pairs (PML's pair conversion); the
    triplet form then combines each listed positive pair with the same anchor's listed negatives.

    **Running estimates.** Buffers ``intra_mean`` (C,) and ``inter_mean`` (C, C) (with ``*_seen``
    flags) hold exponential moving averages. Each training-mode forward computes the batch's
    class-pair means from the *detached* distance matrix (pairs between ``embeddings`` and
    ``ref_emb``; self-pairs excluded) and, for every (class, class) pair present, sets
    ``est ← momentum·est + (1 − momentum)·batch`` (or ``est ← batch`` the first time). The margins
    use the updated estimates; classes never seen with ≥ 2 samples have d_a = 0. In eval mode the
    buffers are frozen. They are registered buffers, so ``state_dict`` checkpoints them.

    **Hierarchical (N, K) labels.** ``labels`` may also be (N, K): column k = cluster / class id at
    level k, finest first (the convention of :mod:`pml_hyperbolic.miners.hierarchy` and
    ``HierarchicalLogRatioLoss``). Column 0 is the class: it alone defines positives, the
    class-mean buffers and the [0, C) range check. A negative pair (i, l) gets the similarity
    level s_il ∈ {2, …, K + 1} at which i and l first share a cluster
    (:func:`~pml_hyperbolic.hierarchy_levels.pairwise_first_shared_level`; K + 1 = never) and the
    negative margin

    .. math::
        M_n(i, l) = d_{y_i y_l} - d_{y_i} + \gamma + \delta\,(s_{il} - 2)

    with δ = ``level_gamma``. This is Eq. (9) with its constant γ made level dependent, as in the
    hierarchical triplet loss its γ refers to (a negative that shares only a coarser cluster is
    pushed further). The nearest negatives (s_il = 2) keep exactly Eq. (9); 1-D labels, or (N, 1),
    give exactly the flat loss. The level term enters both forms' negative margin the same way.
    (``HyperbolicCrossBatchMemory`` stores 1-D labels: use it with 1-D labels only.)

    Args:
        num_classes: C; labels (column 0 of (N, K) labels) must lie in [0, C).
        gamma: γ ≥ 0, the constant of both margins; default 0.05 (the paper gives no value).
        momentum: EMA momentum of the running class means, in [0, 1); default 0.9.
        track_inter_class: keep the (C, C) running ``inter_mean``; ``False`` uses the current
            batch's d_ab instead (for very many classes, e.g. SOP's 11 318: a 512 MB buffer).
        level_gamma: δ ≥ 0, the margin added per hierarchy level beyond the first shared one
            ((N, K) labels only); ``None`` (default): δ = γ.
        margin_form: ``"triplet"`` (default) or ``"contrastive"`` (Eq. (8)-(9) as written).
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance()`` (default geometry); ``reducer``; ``embedding_regularizer``, ...).

    Raises:
        ValueError: ``margin_form`` unknown, ``num_classes`` not a positive int, ``gamma`` or
            ``level_gamma`` negative, ``momentum`` outside [0, 1); at call time, labels outside
            [0, C) or without labels.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) or (N, K) with one row per embedding, a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors; at
            construction, a boolean flag that is not a bool.

    Design note: docs/design/losses.md
    """

    def __init__(self, num_classes: int, gamma: float = 0.05, momentum: float = 0.9,
                 track_inter_class: bool = True, level_gamma: float | None = None,
                 margin_form: str = "triplet", **kwargs):
        if margin_form not in MARGIN_FORMS:
            raise ValueError(f"margin_form must be one of {MARGIN_FORMS}, got {margin_form!r}")
        self.margin_form = margin_form  # before super().__init__: it calls _sub_loss_names()
        super().__init__(**kwargs)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        self.num_classes = num_classes
        self.gamma = check_nonnegative(gamma, "gamma")
        self.level_gamma = self.gamma if level_gamma is None else check_nonnegative(level_gamma, "level_gamma")
        momentum = check_nonnegative(momentum, "momentum")
        if not momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.momentum = momentum
        self.track_inter_class = check_bool(track_inter_class, "track_inter_class")
        self.register_buffer("intra_mean", torch.zeros(num_classes))
        self.register_buffer("intra_seen", torch.zeros(num_classes, dtype=torch.bool))
        c2 = num_classes if self.track_inter_class else 0
        self.register_buffer("inter_mean", torch.zeros(c2, c2))
        self.register_buffer("inter_seen", torch.zeros(c2, c2, dtype=torch.bool))
        self.add_to_recordable_attributes(list_of_names=["gamma"], is_stat=False)
        check_inputs_on_call(self, hierarchical=True)

    def get_default_distance(self):
        return PoincareDistance()

    def get_default_reducer(self):
        return AvgNonZeroReducer()

    def _sub_loss_names(self):
        return ["triplet_loss"] if self.margin_form == "triplet" else ["pos_loss", "neg_loss"]

    def _check_range(self, labels, name):
        if labels is not None and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"{name} must lie in [0, num_classes={self.num_classes})")

    def _ema(self, est, seen, batch, present):
        upd = torch.where(seen, self.momentum * est + (1 - self.momentum) * batch, batch)
        return torch.where(present, upd, est), seen | present

    @staticmethod
    def _as_levels(labels, n, name):
        return as_hierarchical_labels(labels, name, n)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None,
                indices_tuple: tuple | None = None, ref_emb: torch.Tensor | None = None,
                ref_labels: torch.Tensor | None = None):
        """As PML's forward, but ``labels``/``ref_labels`` may be (N, K) hierarchical labels."""
        if labels is not None:
            self._as_levels(labels, embeddings.shape[0], "labels")  # one clear error for float/bool labels
        if labels is None or (labels.ndim == 1 and (ref_labels is None or ref_labels.ndim == 1)):
            return super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)  # flat: PML's
        self.reset_stats()
        levels = self._as_levels(labels, embeddings.shape[0], "labels").to(embeddings.device)
        if ref_emb is None:  # as PML: ref_labels without ref_emb are ignored
            ref_emb, ref_levels = embeddings, levels
        else:
            ref_levels = self._as_levels(ref_labels, ref_emb.shape[0], "ref_labels").to(ref_emb.device)
        loss_dict = self.compute_loss(embeddings, levels, indices_tuple, ref_emb, ref_levels)
        self.add_embedding_regularization_to_loss_dict(loss_dict, embeddings)
        return self.reducer(loss_dict, embeddings, levels[:, 0])

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        if labels is None or ref_labels is None:
            raise ValueError("labels are required (class-mean margins)")
        level_extra = None  # (B, R) δ·(s − 2) for (N, K) labels with K ≥ 2 (and δ > 0), else None: flat loss
        if labels.ndim == 2 or ref_labels.ndim == 2:
            levels = self._as_levels(labels, embeddings.shape[0], "labels")
            ref_levels = self._as_levels(ref_labels, ref_emb.shape[0], "ref_labels")
            if ref_levels.shape[1] != levels.shape[1]:
                raise ValueError(f"ref_labels must have the same number of levels K as labels "
                                 f"({levels.shape[1]}), got {ref_levels.shape[1]}")
            if levels.shape[1] > 1 and self.level_gamma != 0:
                s = pairwise_first_shared_level(levels, ref_levels)
                level_extra = (s - 2).clamp_min(0)  # int64 (B, R) levels beyond the first; × δ below
            labels, ref_labels = levels[:, 0], ref_levels[:, 0]
        self._check_range(labels, "labels")
        self._check_range(ref_labels, "ref_labels")
        pos, neg = pair_masks(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        mat = as_compute(self.distance(embeddings, ref_emb))
        same = ref_emb is embeddings
        # the batch's own copies inside a reference set (CrossBatchMemory enqueues the batch before
        # computing the loss): same label and bit-identical embedding; excluded like the diagonal
        copies = None
        if not same:
            with torch.no_grad():
                copies = self_match_mask(embeddings, ref_emb, labels.view(-1, 1) == ref_labels.view(1, -1))
        # batch class-pair means over all distinct (query, ref) pairs, compact class ids
        classes, inv = torch.unique(torch.cat([labels, ref_labels]), return_inverse=True)
        qi, ri = inv[: labels.numel()], inv[labels.numel():]
        Cb = classes.numel()
        with torch.no_grad():
            # Σ of D over (class a rows, class b columns): two index_adds, no one-hot products
            row_sums = mat.new_zeros(Cb, mat.shape[1]).index_add_(0, qi, mat)
            sums = mat.new_zeros(Cb, Cb).index_add_(1, ri, row_sums)
            n_q = torch.bincount(qi, minlength=Cb).to(mat.dtype)
            n_r = torch.bincount(ri, minlength=Cb).to(mat.dtype)
            cnt = torch.outer(n_q, n_r)
            if same:  # self-pairs excluded: their D (0 for a true distance) and their count
                sums.diagonal().sub_(mat.new_zeros(Cb).index_add_(0, qi, mat.diagonal()))
                cnt.diagonal().sub_(n_q)
            elif copies is not None and bool(copies.any()):
                r, c = copies.nonzero(as_tuple=True)
                sums.diagonal().sub_(mat.new_zeros(Cb).index_add_(0, qi[r], mat[r, c]))
                cnt.diagonal().sub_(torch.bincount(qi[r], minlength=Cb).to(mat.dtype))
        sums, cnt = (sums + sums.T) / 2, (cnt + cnt.T) / 2  # d_ab is symmetric
        batch_mean = sums / cnt.clamp_min(1)
        present = cnt > 0
        intra_b, intra_p = batch_mean.diagonal(), present.diagonal()
        buf_dtype = self.intra_mean.dtype
        if self.training:
            with torch.no_grad():
                new, seen = self._ema(self.intra_mean[classes], self.intra_seen[classes],
                                      intra_b.to(buf_dtype), intra_p)
                self.intra_mean[classes], self.intra_seen[classes] = new, seen
                if self.track_inter_class:
                    ix = torch.meshgrid(classes, classes, indexing="ij")
                    new, seen = self._ema(self.inter_mean[ix], self.inter_seen[ix], batch_mean.to(buf_dtype), present)
                    self.inter_mean[ix], self.inter_seen[ix] = new, seen
        d_a = torch.where(self.intra_seen[classes], self.intra_mean[classes],
                          torch.where(intra_p, intra_b.to(buf_dtype), torch.zeros_like(intra_b, dtype=buf_dtype)))
        if self.track_inter_class:
            ix = torch.meshgrid(classes, classes, indexing="ij")
            d_ab = torch.where(self.inter_seen[ix], self.inter_mean[ix], batch_mean.to(buf_dtype))
        else:
            d_ab = batch_mean.to(buf_dtype)
        d_a, d_ab = d_a.to(mat.dtype), d_ab.to(mat.dtype)
        if not (bool(pos.any()) or bool(neg.any())):
            return self.zero_losses()
        pos_margin = d_a[qi] + self.gamma  # (B,) M_p of each query's class
        if level_extra is not None:
            level_extra = level_extra.to(device=mat.device, dtype=mat.dtype) * self.level_gamma
        if self.margin_form == "triplet":
            return self._triplet_loss(mat, pos, neg, d_a[qi], d_ab.index_select(0, qi)[:, ri], level_extra)
        if indices_tuple is None and all(sub_loss_reducer_type(self, name) is AvgNonZeroReducer
                                         for name in self._sub_loss_names()):
            d_ab_pairs = d_ab.index_select(0, qi)[:, ri]
            if level_extra is not None:  # M_n += δ(s − 2); the positives' margin is untouched
                d_ab_pairs = d_ab_pairs + level_extra
            return self._dense_avg_non_zero(mat, pos, neg, pos_margin, d_ab_pairs)
        a1, p = torch.where(pos)
        a2, n = torch.where(neg)
        neg_margin = d_ab[qi[a2], ri[n]] - d_a[qi[a2]] + self.gamma
        if level_extra is not None:
            neg_margin = neg_margin + level_extra[a2, n]
        pos_losses = torch.relu(mat[a1, p] - pos_margin[a1])
        neg_losses = torch.relu(neg_margin - mat[a2, n])
        return {
            "pos_loss": {"losses": pos_losses, "indices": (a1, p), "reduction_type": "pos_pair"},
            "neg_loss": {"losses": neg_losses, "indices": (a2, n), "reduction_type": "neg_pair"},
        }

    def _triplet_loss(self, mat, pos, neg, d_a_rows, d_ab_pairs, level_extra):
        """[D_ij − D_il + M_n(i, l)]_+ over every (anchor i, positive j, negative l) of ``pos``/``neg``.

        Built per positive pair: (P, R) hinges for the P positive pairs against every reference
        (masked to the anchor's negatives), so memory is P × R, not B × R × R."""
        neg_margin = d_ab_pairs - d_a_rows.view(-1, 1) + self.gamma  # (B, R) M_n = d_ab − d_a + γ
        if level_extra is not None:
            neg_margin = neg_margin + level_extra
        a, p = torch.where(pos)
        # M_n − D_il once on (B, R), non-negatives at −inf (their hinge is then exactly 0 with a zero
        # gradient): one gather, one add and one clamp per (P, R) element instead of five passes
        gap = (neg_margin - mat).masked_fill(~neg, float("-inf"))
        if sub_loss_reducer_type(self, "triplet_loss") is AvgNonZeroReducer:
            value = _mean_active_hinge(mat[a, p], a, gap)
            return {"triplet_loss": {"losses": value, "indices": None, "reduction_type": "already_reduced"}}
        hinge = (mat[a, p].view(-1, 1) + gap[a]).clamp_min_(0)  # (P, R)
        k, n = torch.where(neg[a])
        return {"triplet_loss": {"losses": hinge[k, n], "indices": (a[k], p[k], n), "reduction_type": "triplet"}}

    def _dense_avg_non_zero(self, mat, pos, neg, pos_margin, d_ab_pairs):
        """Both sub-losses on the (B, R) matrix, each reduced as AvgNonZeroReducer would
        (mean over its non-zero hinges, 0 if none) without listing pairs: returned "already_reduced"."""
        pos_hinge = (mat - pos_margin.view(-1, 1)).clamp_min(0).masked_fill(~pos, 0.0)
        neg_margin = d_ab_pairs - (pos_margin - self.gamma).view(-1, 1) + self.gamma  # d_ab − d_a + γ
        neg_hinge = (neg_margin - mat).clamp_min(0).masked_fill(~neg, 0.0)
        out = {}
        for name, hinge in (("pos_loss", pos_hinge), ("neg_loss", neg_hinge)):
            n_active = torch.count_nonzero(hinge)
            value = hinge.sum() / n_active.clamp_min(1).to(hinge.dtype)
            out[name] = {"losses": value, "indices": None, "reduction_type": "already_reduced"}
        return out
