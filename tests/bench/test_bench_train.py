"""`nsa bench train` builds each row's trainer as a run would (its config, a run folder for the telemetry) and
takes a data source from the overrides, such as packed documents with their boundaries. The timing needs a GPU."""

from pathlib import Path

from nsa.bench.training import bench_config, bench_trainer
from nsa.train.distributed import init_distributed

TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.mlp_hidden=64", "train.device=cpu", "parallel.compile=false"]


def test_a_bench_row_trains_on_the_documents_of_its_overrides(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cfg = bench_config(None, TINY + ["data.source=embedded", "data.document_masking=true"], "nsa", 256, 512, 3)
    assert cfg.data.source == "embedded" and cfg.data.masks_documents()
    trainer = bench_trainer(cfg, init_distributed("cpu", 60, False))
    try:
        assert trainer.run_dir == Path(cfg.train.out_dir) / cfg.train.run_name and trainer.run_dir.is_dir()
        loss, norm = trainer.train_step()
        assert loss.item() > 0 and norm.item() > 0 and trainer.step == 1
    finally:
        trainer.data.train.close()


def test_triton_packed_is_set_by_its_flag_and_recorded_in_the_results_environment(monkeypatch, capsys):
    from nsa.bench.common import environment
    from nsa.cli import main
    from nsa.ops.tuning import TUNING

    monkeypatch.setattr(TUNING, "gluon_packed", True)
    assert "gluon_packed" not in environment()["tuning"]
    # Without a GPU the benchmark stops with its one-line error, after the flag took effect.
    assert main(["bench", "attention", "--docs", "64k:2k"]) != 0 and TUNING.gluon_packed is True
    assert main(["bench", "attention", "--docs", "64k:2k", "--triton-packed"]) != 0
    assert TUNING.gluon_packed is False and environment()["tuning"] == {"gluon_packed": False}
    assert "needs a CUDA GPU" in capsys.readouterr().err
