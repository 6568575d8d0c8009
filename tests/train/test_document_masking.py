"""Training and evaluation with data.document_masking: the batches' boundaries reach the model, resume stays exact,
and masking off trains as the model did before boundaries existed."""

import pytest
import torch

from nsa.config import load_config
from nsa.eval.runner import _run_config as eval_run_config
from nsa.model import Transformer
from nsa.train.loop import train
from nsa.train.resume_rules import config_changes, split_changes, with_added_keys
from nsa.typed_config import to_dict

# Windows of 512 bytes over chapters of a few thousand: most batches hold a document boundary.
FAST = [
    "model.dim=64", "model.n_layers=2", "model.mlp_hidden=192", "model.head_dim=16",
    "train.seq_len=512", "train.batch_size=2", "train.warmup_steps=2", "train.log_every=1",
    "train.eval_every=0", "train.sample_tokens=0", "train.progress=false", "telemetry.health_every=0",
    "train.device=cpu",  # exact losses and call counts: the CPU's arithmetic (the GPU tests below say cuda)
]


def _spy_on_the_model(monkeypatch) -> list:
    """The cu_seqlens of every forward the trainer makes (None when it passes none)."""
    calls = []
    forward = Transformer.forward

    def spy(self, tokens, targets=None, cu_seqlens=None):
        calls.append(cu_seqlens)
        return forward(self, tokens, targets, cu_seqlens)

    monkeypatch.setattr(Transformer, "forward", spy)
    return calls


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_training_with_masking_passes_each_batchs_boundaries_and_learns(tmp_path, monkeypatch, attention):
    calls = _spy_on_the_model(monkeypatch)
    common = FAST + [f"model.attention={attention}", f"train.out_dir={tmp_path}", "train.steps=8",
                     "train.eval_every=8", "train.eval_batches=2"]
    masked = train(load_config(None, common + ["train.run_name=masked", "data.document_masking=true"]))
    assert len(calls) == 8 + 2 and all(c is not None and c.shape == (2 * 512 + 1,) for c in calls)
    assert any(int((c[1:] > c[:-1]).sum()) > 2 for c in calls)  # a boundary inside a row
    assert masked.last_loss < masked.first_loss - 0.5 and masked.val_loss is not None
    calls.clear()
    plain = train(load_config(None, common + ["train.run_name=plain", "data.document_masking=false"]))
    assert calls == [None] * 10
    assert plain.losses[1] == masked.losses[1]  # the same weights and batches, but
    assert plain.losses[8] != masked.losses[8]  # attention that crosses documents


def test_masking_off_calls_the_model_with_inputs_and_targets_alone(tmp_path, monkeypatch):
    arities = []
    forward = Transformer.forward
    monkeypatch.setattr(Transformer, "forward", lambda self, *args: arities.append(len(args)) or forward(self, *args))
    train(load_config(None, FAST + [f"train.out_dir={tmp_path}", "train.steps=2", "train.eval_every=2",
                                    "train.eval_batches=1", "data.document_masking=false"]))
    assert arities == [2, 2, 2]  # two steps, one validation batch: as before document masking existed


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_a_masked_run_resumes_with_the_uninterrupted_losses_exactly(tmp_path, attention):
    common = FAST + [f"model.attention={attention}", f"train.out_dir={tmp_path}", "train.steps=6",
                     "data.document_masking=true"]
    full = train(load_config(None, common + ["train.run_name=full"]))
    part = train(load_config(None, common + ["train.run_name=cut", "train.stop_after=3"]))
    rest = train(load_config(None, common + ["train.run_name=cut"]))
    assert sorted(rest.losses) == [4, 5, 6]
    assert {**part.losses, **rest.losses} == full.losses  # bit-identical


def test_document_masking_is_fixed_on_resume_and_runs_saved_before_it_existed_trained_without():
    saved = to_dict(load_config(None, []))
    del saved["data"]["document_masking"]
    now = to_dict(load_config(None, []))
    fixed, applied = split_changes(config_changes(with_added_keys(saved), now))
    assert fixed == {"data.document_masking": (False, "auto")} and not applied
    off = to_dict(load_config(None, ["data.document_masking=false"]))
    assert split_changes(config_changes(with_added_keys(saved), off)) == ({}, {})
    assert "document_masking" not in saved["data"]  # the saved mapping is left as it was
    # Evaluation reads such a run's validation batches as it trained on them.
    assert eval_run_config(saved, []).data.masks_documents() is False
    assert eval_run_config(to_dict(load_config(None, [])), []).data.masks_documents() is True
    assert eval_run_config(saved, ["data.document_masking=true"]).data.masks_documents() is True


@pytest.mark.parametrize("attention,checkpointing", [("dense", "true"), ("nsa", "false")])
def test_the_compiled_blocks_train_on_packed_documents(tmp_path, attention, checkpointing):
    common = FAST + [f"train.out_dir={tmp_path}", "train.steps=3", f"model.attention={attention}",
                     "data.document_masking=true"]
    compiled = train(load_config(None, common + ["train.run_name=c", "parallel.compile=true",
                                                 f"parallel.activation_checkpointing={checkpointing}"]))
    eager = train(load_config(None, common + ["train.run_name=e"]))
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU machine)")
@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_cuda_graph_steps_on_packed_documents_give_the_eager_losses(tmp_path, attention):
    common = FAST + [f"train.out_dir={tmp_path}", "train.steps=4", "train.eval_every=2", "train.eval_batches=2",
                     "train.device=cuda", "parallel.allow_single_process=true", f"model.attention={attention}",
                     "data.document_masking=true"]
    graphed = train(load_config(None, common + ["train.run_name=g", "parallel.compile=true",
                                                "parallel.cudagraphs=true"]))
    eager = train(load_config(None, common + ["train.run_name=e", "parallel.compile=false"]))
    for step, loss in eager.losses.items():
        assert graphed.losses[step] == pytest.approx(loss, rel=2e-3), step
    assert graphed.val_loss == pytest.approx(eager.val_loss, rel=2e-3)
