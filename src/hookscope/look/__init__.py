"""Look: per-call model summaries with operator-level FLOPs, and feature-map grids."""

from ._grid import feature_grid, feature_grids
from ._shapes import NestedShape, ShapeTree, format_shape
from ._summary import Summary, SummaryRow, summary

__all__ = [
    "NestedShape",
    "ShapeTree",
    "Summary",
    "SummaryRow",
    "feature_grid",
    "feature_grids",
    "format_shape",
    "summary",
]
