"""Extract: dataset-scale feature extraction into a Zarr store (``zarr`` extra), bounded in
memory, resumable after a crash, and on Ray Data (``ray`` extra) with the same result."""

from ._extract import extract
from ._reader import FeatureStore, open_features

__all__ = ["FeatureStore", "extract", "open_features"]
