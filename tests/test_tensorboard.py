"""TensorBoard: the event files read back hold the training scalars, the evaluation
metrics, images with boxes and the config text."""

from __future__ import annotations


import pytest

from detector.engine.log import read_jsonl
from detector.engine.trainer import build_trainer
from conftest import tiny_config



@pytest.mark.slow
def test_event_files_hold_scalars_images_and_config(tmp_path):
    data = tmp_path / "shapes"
    out = tmp_path / "run"
    cfg = tiny_config(
        data, out, "data.shapes.num_val=3", "roi_heads.score_thresh=0.0", "eval.score_thresh=0.0",
        "solver.images_per_gpu=1", "solver.reference_batch_size=1", "solver.max_iter=2", "solver.warmup_iters=1",
        "solver.steps=[100]", "solver.param_groups=[{match: backbone.body, lr_mult: 0.5}]",
        "train.amp.enabled=true", "train.amp.dtype=bfloat16",  # float16 is refused on a CPU
        "train.deterministic=false",
        "train.eval_period=0", "train.vis_images=2", "train.tensorboard=true", "eval.images_per_gpu=3",
    )
    trainer = build_trainer(cfg)
    result = trainer.train()
    trainer.close()
    assert result.iteration == 2 and "AP" in result.metrics

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    scalars = set(tags["scalars"])
    expected = {
        "loss/total_loss", "loss/loss_rpn_cls", "loss/loss_rpn_box", "loss/loss_roi_cls", "loss/loss_roi_box",
        "lr/backbone.body", "lr/default", "lr/default/norm", "train/grad_norm",
        "time/iter", "time/data", "train/images_per_sec", "memory/peak_mb",
        "eval/AP", "eval/AP50", "eval/AP75", "eval/mAP_voc07",
    }
    assert expected <= scalars, expected - scalars
    assert "train/amp_scale" not in scalars  # bfloat16 needs no GradScaler (float16's scale: test_trainer, on CUDA)
    assert [e.step for e in ea.Scalars("loss/total_loss")] == [1, 2]
    jsonl = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"]
    assert [e.value for e in ea.Scalars("loss/total_loss")] == pytest.approx([r["total_loss"] for r in jsonl], rel=1e-6)
    lr_ratio = [b.value / d.value for b, d in zip(ea.Scalars("lr/backbone.body"), ea.Scalars("lr/default"))]
    assert lr_ratio == pytest.approx([0.5, 0.5])
    assert ea.Scalars("eval/AP")[-1].value == pytest.approx(result.metrics["AP"], abs=1e-6)
    assert {"val/detections_0", "val/detections_1"} <= set(tags["images"])
    img = ea.Images("val/detections_0")[-1]
    assert img.step == 2 and img.width > 0 and img.height > 0
    assert any(t.startswith("config") for t in tags["tensors"])
    # Per class: a PR curve (counts, precision, recall at 101 thresholds) and the COCO AP.
    from tensorboard.util import tensor_util

    from detector.data.shapes import CLASS_NAMES

    for name in CLASS_NAMES:
        assert f"eval/pr_curve/{name}" in tags["tensors"], tags["tensors"]
        curve = tensor_util.make_ndarray(ea.Tensors(f"eval/pr_curve/{name}")[-1].tensor_proto)
        assert curve.shape == (6, 101)  # TP, FP, TN, FN, precision, recall
        tp, fp, fn, recall = curve[0], curve[1], curve[3], curve[5]
        assert (tp + fn == tp[0] + fn[0]).all() and (fp >= 0).all()  # every object counted at every threshold
        assert ((recall >= 0) & (recall <= 1)).all()
        assert f"eval/AP_per_class/{name}" in scalars
        assert ea.Scalars(f"eval/AP_per_class/{name}")[-1].step == 2
