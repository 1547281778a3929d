"""Closed-form layout pricing: parsing, invariants over presets and devices, each technique's
effect in time and memory, any global batch, and the Korthikanti activation formula."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.cluster import DEVICES, Cluster, get_device
from meshplan.cost.links import exposed_seconds
from meshplan.errors import OptionsError
from meshplan.models.transformer import PRESETS
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import (
    DEFAULT_EFFICIENCY,
    UNCERTAINTY,
    LayoutPricer,
    check_layout,
    model_flops,
    price_layout,
    search_layouts,
)
from meshplan.simulator.layout import Layout, parse_layout

A100 = Cluster(8, 8, get_device("a100-80gb"))
GPT_175B = PRESETS["gpt3-175b"]


def price(text: str, model=GPT_175B, cluster=A100, batch=64, seq=2048, **kw):
    return price_layout(TrainingJob(model, batch, seq), cluster, parse_layout(text), **kw)


def test_parse_layout_round_trip_and_errors():
    layout = parse_layout("tp=8,pp=8,dp=16,vp=3,mb=1,sp=on,recompute=selective")
    assert layout == Layout(tp=8, pp=8, dp=16, vp=3, mb=1, sp=True, recompute="selective")
    assert parse_layout(layout.text()) == layout and layout.devices == 1024
    assert parse_layout("tp=2,zero=on,fp32grads=off,flash=off").distributed_optimizer
    for bad, message in (("tp=8,pq=2", "'pq=2' is not KEY=VALUE"), ("tp=x", "must be an integer"),
                         ("sp=maybe,tp=2", "must be on or off"), ("recompute=half", "recompute='half'"),
                         ("tp=0", "positive integer"), ("sp=on", "needs tp > 1"), ("dp=3,ep=2", "must divide")):
        with pytest.raises(OptionsError, match=message):
            parse_layout(bad)


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_mfu_at_most_one_and_memory_adds_up_for_every_preset(device):
    """The invariant: whatever the model and device, the best layout's MFU is at most 1 and its
    memory is the sum of its parts."""
    cluster = Cluster(4, 8, DEVICES[device])
    for name, model in PRESETS.items():
        job = TrainingJob(model.replace(layers=min(model.layers, 8)), 64, min(model.max_seq_len, 2048))
        for layout in (Layout(tp=8, pp=1, dp=4, mb=1, sp=True), Layout(tp=1, pp=8, dp=4, mb=2)):
            if check_layout(job, cluster, layout):
                continue
            found = price_layout(job, cluster, layout)
            assert 0 < found.mfu <= 1, (name, device, found.mfu)
            parts = found.memory
            assert parts.total == pytest.approx(sum(v for _, v in parts.items()), rel=1e-12)
            assert all(v >= 0 for _, v in parts.items())
            assert found.iteration_time == pytest.approx(found.pipeline_time + found.sync_time)


def test_moe_mfu_counts_the_activated_experts():
    mixtral = PRESETS["mixtral-8x7b"]
    job = TrainingJob(mixtral, 256, 4096)
    found = price_layout(job, Cluster(4, 8, get_device("h100-80gb")), Layout(tp=2, pp=2, dp=8, ep=8, mb=1, sp=True,
                                                                             distributed_optimizer=True))
    assert model_flops(job) < 0.3 * 6 * mixtral.num_params() * job.tokens
    assert 0.1 < found.mfu < 0.7
    dense_equivalent = price_layout(job, Cluster(4, 8, get_device("h100-80gb")),
                                    Layout(tp=2, pp=2, dp=8, ep=1, mb=1, sp=True, distributed_optimizer=True))
    # Expert parallelism holds 1/8 of the experts per device: far less weight memory.
    assert found.memory.weights < 0.35 * dense_equivalent.memory.weights


def test_korthikanti_activation_formula():
    """Korthikanti et al. 2022 Eq. 1-5, per layer and micro-batch on one device (bf16, GPT with
    dropout, no flash attention): sbh(34 + 5as/h)/t with sequence parallelism, 34 sbh/t with
    selective recompute too, 2 sbh/t under full recompute."""
    model = GPT_175B.replace(layers=8)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    cluster = Cluster(1, 8, get_device("a100-80gb"))

    def activations(recompute):
        layout = Layout(tp=8, pp=1, dp=1, mb=1, sp=True, recompute=recompute, flash=False)
        return price_layout(TrainingJob(model, 1, s), cluster, layout).memory.activations / model.layers

    assert activations("none") == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t, rel=1e-9)
    assert activations("selective") == pytest.approx(s * b * h * 34 / t, rel=1e-9)
    assert activations("full") == pytest.approx(2 * s * b * h / t, rel=1e-9)


def test_each_technique_moves_time_and_memory_the_right_way():
    base = "tp=8,pp=8,dp=1,mb=1,flash=off"
    none, sp = price(f"{base},recompute=none"), price(f"{base},sp=on,recompute=none")
    assert sp.memory.activations < none.memory.activations
    selective, full = price(f"{base},sp=on,recompute=selective"), price(f"{base},recompute=full")
    assert full.memory.activations < selective.memory.activations < sp.memory.activations
    assert sp.iteration_time < selective.iteration_time < full.iteration_time
    flash = price(f"{base.replace('flash=off', 'flash=on')},sp=on")
    assert flash.memory.activations < sp.memory.activations and flash.iteration_time < sp.iteration_time
    # The distributed optimizer shards the 12 bytes of Adam state over data parallel.
    plain, zero = price("tp=8,pp=1,dp=8,mb=1", batch=64), price("tp=8,pp=1,dp=8,mb=1,zero=on", batch=64)
    assert zero.memory.optimizer == pytest.approx(plain.memory.optimizer / 8)
    assert zero.memory.gradients == plain.memory.gradients
    overlapped = price("tp=8,pp=1,dp=8,mb=1,overlap=on", batch=64)
    assert overlapped.sync_time < plain.sync_time
    h100 = Cluster(8, 8, get_device("h100-80gb"))
    assert price("tp=8,pp=8,dp=1,mb=1,sp=on,fp8=on", cluster=h100).iteration_time < \
        price("tp=8,pp=8,dp=1,mb=1,sp=on", cluster=h100).iteration_time
    assert "no fp8 tensor cores" in check_layout(TrainingJob(GPT_175B, 64, 2048), A100, parse_layout("fp8=on"))
    # Interleaving shrinks the bubble.
    assert price(f"{base},vp=3,sp=on").pipeline_time < sp.pipeline_time


def test_context_parallelism_splits_long_sequences():
    model = PRESETS["llama3.1-8b"]
    cluster = Cluster(1, 8, get_device("h100-80gb"))
    job = TrainingJob(model, 16, 32768)
    one, two = (price_layout(job, cluster, Layout(tp=4, pp=1, dp=2 // cp, cp=cp, mb=1, sp=True)) for cp in (1, 2))
    assert two.memory.activations == pytest.approx(one.memory.activations / 2, rel=0.05)


def test_data_parallel_reduction_is_hierarchical():
    """With tp=1, eight data-parallel ranks share each node: reduce-scatter inside, 1/8 of the
    bytes across nodes: much cheaper than a flat ring at one GPU's NIC share."""
    model = PRESETS["gpt3-1.3b"]
    job = TrainingJob(model, 64, 2048)
    eight = price_layout(job, Cluster(8, 8, get_device("a100-80gb")), Layout(tp=1, pp=1, dp=64, mb=1))
    one = price_layout(job, Cluster(64, 1, get_device("a100-80gb")), Layout(tp=1, pp=1, dp=64, mb=1))
    assert eight.sync_time < 0.4 * one.sync_time


def test_stage_sends_use_the_link_they_cross():
    model = PRESETS["gpt3-1.3b"]
    job = TrainingJob(model, 64, 2048)
    inside = price_layout(job, Cluster(1, 8, get_device("v100-32gb")), Layout(tp=1, pp=8, dp=1, mb=1))
    across = price_layout(job, Cluster(8, 1, get_device("v100-32gb")), Layout(tp=1, pp=8, dp=1, mb=1))
    assert inside.iteration_time < across.iteration_time


def test_any_global_batch_plans_and_reports_idle_devices():
    job = TrainingJob(PRESETS["llama2-13b"], 7, 4096)
    search = search_layouts(job, Cluster(50, 4, get_device("v100-32gb")))
    best = search.best
    assert best is not None and best.fits and best.layout.dp <= 7
    assert best.idle_devices == 200 - best.layout.devices
    assert best.num_microbatches * best.layout.mb * best.layout.dp >= 7


def test_nothing_fits_names_the_memory():
    from meshplan.simulator.simulate import no_fit_message

    job = TrainingJob(PRESETS["llama2-70b"], 8, 512)
    cluster = Cluster(1, 4, get_device("v100-16gb"))
    search = search_layouts(job, cluster)
    assert search.best is None and search.leanest is not None
    message = no_fit_message(job, cluster, search)
    assert f"needs {search.leanest.memory.total / 1e9:.1f} GB per device" in message


def test_time_range_brackets_the_prediction():
    found = price("tp=8,pp=8,dp=1,mb=1,sp=on")
    low, high = found.time_range
    assert low < found.iteration_time < high
    assert low == pytest.approx(found.iteration_time * (1 + UNCERTAINTY[0]))
    assert replace(found.layout, vp=1) == found.layout


def test_layout_plan_round_trips_and_names_its_parts():
    from meshplan.plan import Plan
    from meshplan.simulator.simulate import layout_plan

    job = TrainingJob(PRESETS["llama2-13b"], 7, 4096)
    cluster = Cluster(50, 4, get_device("v100-32gb"))
    best = search_layouts(job, cluster).best
    plan = layout_plan(best, job, cluster, "auto")
    assert Plan.from_json(plan.to_json()) == plan
    assert sum(plan.metrics_under("memory.").values()) == pytest.approx(plan.prediction.peak_memory_bytes)
    low, high = plan.metrics_under("time_range.").values()
    assert low < plan.prediction.iteration_time_s < high
    assert any("stay idle" in note for note in plan.notes) == (best.idle_devices > 0)
    assert parse_layout(plan.option("layout")) == best.layout


def _every_stage_memory_and_sync(pricer):
    """The brute-force twin of the pricer's class leaders: every stage priced, the first most
    loaded stage's memory and the worst sync and step."""
    stages = pricer._stage_layers()
    worst = None
    for j, layers in enumerate(stages):
        found = pricer._stage_memory(j, layers)
        if worst is None or found.total > worst.total:
            worst = found
    return worst, [pricer._stage_sync(j, layers) for j, layers in enumerate(stages)]


@pytest.mark.parametrize("model", [PRESETS["llama2-7b"].replace(layers=25),
                                   PRESETS["moe-1.3b"].replace(layers=15)], ids=["dense", "moe-every-2"])
def test_stage_classes_price_like_every_stage(model):
    """Pricing one stage per class (the layout search's shortcut) gives the memory breakdown
    and the sync of pricing every stage, over pipelines deep and shallow, interleaved or not,
    every recomputation and sharding choice, dense and alternating MoE layers."""
    job, cluster = TrainingJob(model, 96, 2048), Cluster(16, 8, get_device("a100-80gb"))
    checked = 0
    for pp in (1, 2, 3, 5, 6, 8, 15):
        for recompute in ("none", "selective", "full"):
            for vp, zero, fsdp in ((1, False, False), (1, True, False), (1, False, True), (3, True, False)):
                layout = Layout(tp=2, pp=pp, dp=max(1, 64 // pp), vp=vp, mb=2, sp=True, recompute=recompute,
                                distributed_optimizer=zero, fsdp=fsdp, overlap=True)
                if check_layout(job, cluster, layout):
                    continue
                pricer = LayoutPricer(job, cluster, layout, DEFAULT_EFFICIENCY)
                worst, syncs = _every_stage_memory_and_sync(pricer)
                assert pricer.memory() == worst, layout.text()
                found = pricer._data_parallel(pricer._stage_layers(), 1e-3)
                exposed = [exposed_seconds(c, 1e-3, DEFAULT_EFFICIENCY.dp_overlap_tail) for c, _ in syncs]
                assert found == (max(exposed), max(o for _, o in syncs)), layout.text()
                checked += 1
    assert checked > 40
