"""CFP comparison tables (pure Python): rank correlation, per-combination rows, the ILP's layouts."""

from __future__ import annotations

import pytest

from meshplan.cfp import CfpOptions, ProfileSettings, analyze, model_graph, model_spec, profile
from meshplan.cfp.compare import combination_rows, ilp_layouts, ilp_plan, rank_correlation
from meshplan.cfp.price import price
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel


def test_rank_correlation():
    assert rank_correlation([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 31.0, 90.0]) == pytest.approx(1.0)
    assert rank_correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert rank_correlation([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) is None
    assert rank_correlation([1.0, 2.0], [1.0, 2.0]) is None


def test_rows_and_the_ilp_plan_priced_alike():
    a = analyze(model_graph(model_spec("gpt3-125m", 1, batch=8, seq_len=32)), LogicalMesh((4,), (1e-5,), (1e-9,)),
                CfpOptions(CostModel(flops_per_second=1e11)))
    table = combination_rows(a, profile(a, ProfileSettings(analytic=True)))
    assert len(table.rows) == sum(s.combinations for s in a.segments)
    assert {r.status for r in table.rows} == {"not run"} and all(r.measured_s is None for r in table.rows)
    for rows in table.by_segment().values():  # data parallel sends nothing; split contractions all-reduce
        assert min(r.volume for r in rows) == 0.0
        assert all(r.volume > 0.0 for r in rows if "K0" in r.labels)
    ilp = ilp_plan(a, None)
    assert price(a.graph, ilp_layouts(ilp), a.mesh, a.options.cost).time == pytest.approx(ilp.objective, rel=1e-9)
