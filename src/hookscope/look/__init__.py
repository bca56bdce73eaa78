"""Look: per-call model summaries with operator-level FLOPs."""

from ._summary import Summary, SummaryRow, summary

__all__ = ["Summary", "SummaryRow", "summary"]
