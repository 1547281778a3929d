"""CFP: ParallelBlocks, segment deduplication, profile-then-search intra-op planning.

The three passes: `analyze` (Graph + mesh -> ParallelBlocks and unique segments), `profile`
(every strategy combination of each unique segment, measured on the devices or priced by the
cost model), `search` (one strategy per block for the whole model). Analysis and search are
pure Python; only profiling and measuring touch JAX. See docs/cfp.md.
"""

from meshplan.cfp.analysis import Analysis, CfpOptions, analyze
from meshplan.cfp.blocks import ParallelBlock
from meshplan.cfp.cache import ProfileCache
from meshplan.cfp.derive import BlockStrategy
from meshplan.cfp.models import ModelSpec, model_graph, model_spec
from meshplan.cfp.profile import (
    CombinationProfile,
    Profiles,
    ProfileSettings,
    SegmentProfile,
    SegmentTask,
    load_profiles,
    profile,
    run_task,
    segment_tasks,
)
from meshplan.cfp.search import CfpPlan, search, search_exhaustive
from meshplan.cfp.segments import Occurrence, Segment

__all__ = [
    "Analysis", "BlockStrategy", "CfpOptions", "CfpPlan", "CombinationProfile", "ModelSpec", "Occurrence",
    "ParallelBlock", "ProfileCache", "ProfileSettings", "Profiles", "Segment", "SegmentProfile", "SegmentTask",
    "analyze", "load_profiles", "model_graph", "model_spec", "profile", "run_task", "search", "search_exhaustive",
    "segment_tasks",
]
