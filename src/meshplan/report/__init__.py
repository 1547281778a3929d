"""Reports: plans as text, HTML charts, JAX PartitionSpecs, Chrome traces and diffs (docs/report.md).

They read `Plan`s and never plan."""

from meshplan.report.diff import diff_plans
from meshplan.report.html import html_report
from meshplan.report.intra_text import layer_rows, print_intra_plan
from meshplan.report.layouts import ParameterLayout, parameter_layouts, stage_parallelism
from meshplan.report.load import load_plan
from meshplan.report.partition_specs import partition_spec_tree, python_source
from meshplan.report.text import OpFilter, print_report, render
from meshplan.report.timeline import chrome_trace, iteration_spans

__all__ = ["OpFilter", "ParameterLayout", "chrome_trace", "diff_plans", "html_report", "iteration_spans", "layer_rows",
           "load_plan", "parameter_layouts", "partition_spec_tree", "print_intra_plan", "print_report", "python_source",
           "render", "stage_parallelism"]
