"""`nsa bench attention --graphs`: every timed call (NSA, dense, fla; forward and forward+backward) is timed as a
CUDA-graph replay, and a call that cannot be captured gives no time (and no ratio) instead of an eager one. The
capture and the timing need a GPU; here they are replaced by recorders. Also the profile's GPU busy time."""

import pytest

import nsa.bench.attention as bench


@pytest.fixture
def recorded(monkeypatch):
    calls = {"graphed": [], "timed": []}
    monkeypatch.setattr(bench, "make_inputs", lambda *args, **kwargs: ["ins"])
    monkeypatch.setattr(bench, "_nsa", lambda ins: "nsa")
    names = {"flash": "dense", "cudnn": "cudnn"}
    monkeypatch.setattr(bench, "_dense_inputs", lambda ins: [])
    monkeypatch.setattr(bench, "_dense", lambda tensors, backend="flash": (names[backend], tensors))
    monkeypatch.setattr(bench, "_fla", lambda ins: ("fla", []))
    monkeypatch.setattr(bench, "_fwd_bwd", lambda forward, tensors: forward + "+bwd")
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)

    def graphed(fn):
        calls["graphed"].append(fn)
        return None if fn == "fla+bwd" else ("replay", fn)  # fla's backward "cannot be captured"

    def timed(fn, queued=False):
        calls["timed"].append(fn)
        times = {"nsa": 1.0, "dense": 2.0, "cudnn": 1.5, "fla": 3.0}
        return times[(fn[1] if isinstance(fn, tuple) else fn).split("+")[0]]

    def host(fn):
        calls.setdefault("host", []).append(fn)
        return 0.5

    monkeypatch.setattr(bench, "_graphed", graphed)
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "_host", host)
    return calls


def test_graphs_time_replays_of_every_call(recorded):
    row = bench.compare("paper", 2048, backward=True, use_fla=True, graphs=True)
    assert "host" not in recorded and "nsa_host_fwd_ms" not in row  # a replay has no host time to speak of
    fns = ["nsa", "dense", "cudnn", "fla", "nsa+bwd", "dense+bwd", "cudnn+bwd", "fla+bwd"]
    assert recorded["graphed"] == fns
    assert recorded["timed"] == [("replay", f) for f in fns if f != "fla+bwd"]
    assert row["speedup_fwd"] == 2.0 and row["vs_cudnn_fwd"] == 1.5 and row["vs_fla_fwd"] == 3.0
    assert row["fla_fwdbwd_ms"] is None and row["vs_fla_fwdbwd"] is None  # not captured: no eager stand-in


def test_without_graphs_nothing_is_captured(recorded):
    row = bench.compare("paper", 2048, backward=True, use_fla=True)
    assert recorded["graphed"] == []
    assert recorded["timed"] == ["nsa", "dense", "cudnn", "fla", "nsa+bwd", "dense+bwd", "cudnn+bwd", "fla+bwd"]
    assert row["speedup_fwdbwd"] == 2.0 and row["vs_cudnn_fwdbwd"] == 1.5
    # Each eager call's host time too: NSA's forward and forward+backward, dense's forward.
    assert recorded["host"] == ["nsa", "dense", "nsa+bwd"]
    assert row["nsa_host_fwd_ms"] == row["dense_host_fwd_ms"] == row["nsa_host_fwdbwd_ms"] == 0.5


def test_gpu_busy_time_is_the_union_of_kernels_and_counts_only_long_gaps():
    """`nsa bench train --profile` reports how much of a step some kernel runs: overlapping kernels count once,
    CPU events not at all, and idle gaps over 0.1 ms are summed apart."""
    from types import SimpleNamespace as Event

    import torch

    from nsa.bench.common import gpu_busy_ms

    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    spans = [(400, 500), (0, 100), (50, 150), (520, 600), (560, 580)]  # microseconds, out of order
    events = [Event(device_type=gpu, time_range=Event(start=a, end=b)) for a, b in spans]
    events.append(Event(device_type=cpu, time_range=Event(start=0, end=10_000)))
    busy, gaps = gpu_busy_ms(events)
    assert busy == pytest.approx(0.33) and gaps == pytest.approx(0.25)


def test_a_graphed_call_keeps_what_its_graph_reads_alive(monkeypatch):
    """The graph reads the captured call's inputs where they were at capture: the replay must hold the call (and
    what its closure holds), or a caller that keeps only the replay lets them be freed and overwritten (how
    item_order.py's first form failed with illegal memory accesses)."""
    import contextlib
    import gc
    import weakref

    import nsa.bench.common as common

    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    class FakeStream:
        def wait_stream(self, other):
            """Ordering between streams has nothing to do without a GPU."""

    monkeypatch.setattr(common.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(common.torch.cuda, "current_stream", lambda: FakeStream())
    monkeypatch.setattr(common.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(common.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(common.torch.cuda, "graph", lambda g: contextlib.nullcontext())

    class Inputs:
        """Stands for the tensors only the captured call holds."""

    inputs = Inputs()
    alive = weakref.ref(inputs)
    replay = common.graphed(lambda held=inputs: held)
    del inputs
    gc.collect()
    assert alive() is not None
    replay()
    assert FakeGraph.replays == 1
    del replay
    gc.collect()
    assert alive() is None  # held by the replay, not leaked


def test_host_time_is_the_issuing_of_a_call_while_the_gpu_is_busy(monkeypatch):
    """host_ms times only the host's part of a call: the GPU is given a long spin first (so nothing waits on it)
    and synchronised only after the timed calls."""
    import time

    from nsa.bench import common

    events = []
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(common.torch.cuda, "_sleep", lambda cycles: events.append(("spin", cycles)))
    monkeypatch.setattr(common.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(common.torch.cuda, "get_device_properties", lambda i: type("P", (), {"clock_rate": 1_000})())

    def call():
        events.append("call")
        time.sleep(0.002)

    ms = common.host_ms(call, reps=5, gpu_busy_s=0.5)
    assert 1.5 < ms < 20
    assert events == ["call", "sync", ("spin", 500_000)] + ["call"] * 5 + ["sync"]
