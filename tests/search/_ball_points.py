"""Seeded ball points shared by the search tests."""
import torch


def ball_points(n, d, c, seed, max_radius=0.95, dtype=torch.float32):
    """n points of the ball of curvature -c: uniform directions, sqrt(c)|x| uniform in [0, max_radius)
    (drawn in float64, returned in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g, dtype=torch.float64) * max_radius / c ** 0.5
    return x.to(dtype)


def clustered(n, d, c, seed, centres=None, d0_low=1.5, d0_high=3.2):
    """(float32 ball points, centres): directions clustered around n // 50 random centres (or the
    given ones), distances from the origin uniform in [d0_low, d0_high)."""
    g = torch.Generator().manual_seed(seed)
    if centres is None:
        centres = torch.randn(max(1, n // 50), d, generator=g)
    v = centres[torch.randint(0, len(centres), (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = d0_low + (d0_high - d0_low) * torch.rand(n, 1, generator=g)
    return (v * torch.tanh(c ** 0.5 * d0 / 2) / c ** 0.5).float(), centres
