"""The static training forward (``detector.modeling.static_forward``) against the eager
model on the tiny config: the same losses and gradients with the same weights, batch
and random draws; padding the ground truth changes nothing; bad inputs get one line."""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import pytest
import torch

from detector.config import ConfigError, load_config
from detector.modeling import build_model
from detector.modeling.static_forward import make_static_batch, pad_ground_truth, static_losses

from conftest import TINY_CONFIG

CANVAS = "model.canvas_sizes=[[96,96]]"


def tiny_model(*overrides: str):
    cfg = load_config(TINY_CONFIG, ["model.num_classes=3", CANVAS, *overrides])
    torch.manual_seed(0)
    return build_model(cfg).train()


def random_batch(seed: int, images: int = 2, max_boxes: int = 6) -> Tuple[List[torch.Tensor], List[Dict]]:
    """Images of 64..96 px with 0..max_boxes-1 random boxes each."""
    g = torch.Generator().manual_seed(seed)
    ims, targets = [], []
    for i in range(images):
        h, w = (int(v) for v in torch.randint(64, 97, (2,), generator=g))
        ims.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        k = int(torch.randint(0, max_boxes, (1,), generator=g))
        xy = torch.rand(k, 2, generator=g) * torch.tensor([w - 24.0, h - 24.0])
        wh = torch.rand(k, 2, generator=g) * 20 + 4
        targets.append({"boxes": torch.cat((xy, xy + wh), 1), "labels": torch.randint(1, 4, (k,), generator=g),
                        "image_id": 100 + i})
    return ims, targets


def losses_and_grads(model, fn, seed: int = 5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    losses = fn()
    sum(losses.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


def assert_same(a, b, rtol=1e-5, atol=1e-7):
    (la, ga), (lb, gb) = a, b
    assert la.keys() == lb.keys()
    for k in la:
        torch.testing.assert_close(la[k], lb[k], rtol=rtol, atol=atol, msg=k)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_static_losses_and_gradients_equal_the_eager_step(seed):
    model = tiny_model()
    ims, targets = random_batch(seed)
    max_gt = max(max(t["boxes"].shape[0] for t in targets), 1)  # the eager step's padded count
    eager = losses_and_grads(model, lambda: model(ims, targets))
    static = losses_and_grads(model, lambda: static_losses(model, make_static_batch(model, ims, targets, max_gt))[0])
    assert_same(eager, static)
    assert all(torch.isfinite(v) for v in eager[0].values())


def test_padding_the_ground_truth_changes_nothing():
    # Every labelled anchor and RoI is sampled (batch sizes above the candidate counts),
    # so the draws do not depend on the padded counts.
    model = tiny_model("roi_heads.batch_size_per_image=4096", "roi_heads.positive_fraction=1.0")
    ims, targets = random_batch(4, images=3)
    runs = [losses_and_grads(model, lambda g=g: static_losses(model, make_static_batch(model, ims, targets, g))[0])
            for g in (5, 12, 40)]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])


def test_too_many_boxes_are_reported_by_name(caplog):
    targets = [{"boxes": torch.tensor([[0.0, 0, 10, 10]] * 5), "labels": torch.ones(5, dtype=torch.int64),
                "image_id": 77}]
    with caplog.at_level(logging.WARNING, logger="detector"):
        boxes, labels, valid = pad_ground_truth(targets, 3, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "image 77" in lines[0] and "data.max_gt_per_image=3" in lines[0]
    assert valid.tolist() == [[True, True, True]] and boxes.shape == (1, 3, 4)


def test_static_step_needs_canvas_sizes():
    with pytest.raises(ConfigError, match="'train.static_step' needs 'model.canvas_sizes'"):
        load_config(TINY_CONFIG, ["train.static_step=true"])
    cfg = load_config(TINY_CONFIG, ["train.static_step=true", CANVAS, "rpn.nms_max_iters=4",
                                    "data.max_gt_per_image=7"])
    assert cfg.rpn.nms_max_iters == 4 and cfg.data.max_gt_per_image == 7
    with pytest.raises(ConfigError, match="rpn.nms_max_iters"):
        load_config(TINY_CONFIG, ["rpn.nms_max_iters=0"])
    with pytest.raises(ConfigError, match="data.max_gt_per_image"):
        load_config(TINY_CONFIG, ["data.max_gt_per_image=0"])


def test_a_batch_that_fits_no_canvas_is_refused():
    model = tiny_model("model.canvas_sizes=[[64,64]]")
    ims, targets = random_batch(1)
    with pytest.raises(ValueError, match="model.canvas_sizes"):
        make_static_batch(model, ims, targets, 5)


def test_the_compiled_static_losses_read_only_parameters_buffers_and_the_batch():
    """Every tensor the one graph takes in is a parameter or buffer of the model (they
    move with it) or a field of the batch. Any other tensor (a plain attribute) stays in
    host memory when the model moves to a GPU: the graph then copies it at every call, a
    host sync that also fails a CUDA-graph capture (the anchor generator's cell anchors
    did, on the first GPU run)."""
    model = tiny_model("train.static_step=true")
    ims, targets = random_batch(1)
    batch = make_static_batch(model, ims, targets, 8)
    sources: List[str] = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                name = node.meta["grapharg"].source.name
                sources.append(name() if callable(name) else name)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda b: static_losses(model, b, 4), backend=backend, fullgraph=True, dynamic=False)
    fn(batch)
    assert any("['b']" in s for s in sources) and any("_parameters" in s for s in sources)
    others = [s for s in sources if "['b']" not in s and "_parameters" not in s and "_buffers" not in s]
    assert others == []
