"""Reports: plans as text and JSON."""

from meshplan.report.intra_text import layer_rows, print_intra_plan

__all__ = ["layer_rows", "print_intra_plan"]
