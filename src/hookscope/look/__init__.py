"""Look: per-call model summaries with operator-level FLOPs, and feature-map grids."""

from ._grid import feature_grid, feature_grids
from ._summary import Summary, SummaryRow, summary

__all__ = ["Summary", "SummaryRow", "feature_grid", "feature_grids", "summary"]
