"""Detection drawings: captions on filled backgrounds, inside the image, small images
scaled up, ground truth and predictions in their own colours with a legend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.evaluation.plots import GT_COLOR, PRED_COLOR, draw_detections, render


def test_labels_stay_inside_a_64px_image():
    image = torch.full((3, 64, 64), 90, dtype=torch.uint8)
    pred = torch.tensor([[2.0, 1.0, 20.0, 30.0], [50.0, 30.0, 63.0, 60.0]])  # the second at the right edge
    gt = torch.tensor([[40.0, 0.0, 64.0, 20.0]])
    drawing = render(image, pred, ["circle 0.97", "rectangle 0.88"], gt_boxes=gt, gt_labels=["triangle"])
    out = drawing.image.permute(1, 2, 0).numpy()
    h, w = drawing.image_height, out.shape[1]
    assert drawing.scale >= 5 and min(h, w) >= 320  # scaled up so the text can be read
    assert len(drawing.label_boxes) == 3
    for (x1, y1, x2, y2), color in zip(drawing.label_boxes, [GT_COLOR, PRED_COLOR, PRED_COLOR]):
        assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h, (x1, y1, x2, y2)
        patch = out[y1:y2, x1:x2]
        filled = (patch == np.array(color, dtype=np.uint8)).all(axis=-1)
        text = (patch == 0).all(axis=-1)
        assert filled.mean() > 0.3 and text.any()  # a filled background with text on it
    # The caption of the box at the right edge was moved left to stay inside.
    x1, _, x2, _ = drawing.label_boxes[2]
    assert x2 == w and x1 < 50 * drawing.scale
    # The legend band under the image shows both colours.
    band = out[h:]
    for color in (GT_COLOR, PRED_COLOR):
        assert (band == np.array(color, dtype=np.uint8)).all(axis=-1).any()  # the legend has both


def test_draw_detections_puts_each_box_on_the_scaled_image():
    """The TensorBoard drawing (engine hooks): the image scaled by 7 (48 px -> 336 >= 320),
    ground truth and prediction outlines at 7x their coordinates in their own colours,
    the image's own pixels elsewhere, and the legend band below."""
    torch.manual_seed(0)
    image = torch.randint(0, 255, (3, 48, 80), dtype=torch.uint8)
    gt = torch.tensor([[5.0, 5.0, 30.0, 30.0]])
    pred = torch.tensor([[6.0, 4.0, 31.0, 29.0]])
    a = draw_detections(image, gt, pred, ["dog 0.50"])
    assert a.dtype == torch.uint8 and a.shape[0] == 3 and a.shape[2] == 80 * 7 and a.shape[1] > 48 * 7
    pixel = lambda y, x: tuple(a[:, y, x].tolist())  # noqa: E731
    for y in (100, 150, 190):  # the right and left edges, below the caption
        assert pixel(y, 30 * 7) == GT_COLOR and pixel(y, 5 * 7) == GT_COLOR
        assert pixel(y, 31 * 7) == PRED_COLOR and pixel(y, 6 * 7) == PRED_COLOR
    assert pixel(29 * 7, 120) == PRED_COLOR and pixel(30 * 7, 120) == GT_COLOR  # the bottom edges
    scaled = image.repeat_interleave(7, dim=1).repeat_interleave(7, dim=2)
    assert torch.equal(a[:, 230:336, 240:560], scaled[:, 230:336, 240:560])  # away from the boxes: untouched
    legend = a[:, 48 * 7:].permute(1, 2, 0).reshape(-1, 3)
    for color in (GT_COLOR, PRED_COLOR):
        assert (legend == torch.tensor(color, dtype=torch.uint8)).all(dim=1).any()


@pytest.mark.parametrize("num_classes", [3, 20, 80])
def test_pr_plot_is_readable_at_3_20_80_classes(tmp_path, num_classes):
    from PIL import Image

    from detector.evaluation.plots import plot_pr_curves

    rng = np.random.default_rng(0)
    curves = {}
    for k in range(num_classes):
        n = int(rng.integers(1, 40))
        recall = np.sort(rng.random(n))
        curves[f"class_{k}"] = (recall, np.sort(rng.random(n))[::-1], float(rng.random()))
    curves["empty"] = (np.zeros(0), np.zeros(0), float("nan"))
    path = plot_pr_curves(curves, tmp_path / "pr.png", ap_kind="VOC area AP")
    with Image.open(path) as img:
        w, h = img.size
    # One panel per class beyond 10 classes: the figure grows with the class count
    # (about 210 x 190 px per panel), so labels keep their size.
    cols = int(np.ceil(np.sqrt(len(curves))))
    assert w >= (900 if len(curves) <= 10 else 200 * cols)


def test_class_colours_are_distinct_and_stable_at_80_classes():
    from detector.evaluation.palette import class_color, palette

    colors = np.array([class_color(k) for k in range(1, 81)], dtype=np.float64)
    dist = np.linalg.norm(colors[:, None] - colors[None], axis=-1) + np.eye(80) * 1e9
    assert dist.min() >= 50  # any two of 80 classes are told apart
    palette.cache_clear()
    assert [class_color(k) for k in range(1, 81)] == [tuple(int(v) for v in c) for c in colors]  # recomputed: same
    # In two different images, a class's box is drawn in its colour.
    for seed in (0, 1):
        image = torch.randint(0, 255, (3, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        d = render(image, torch.tensor([[10.0, 10.0, 50.0, 50.0], [60.0, 5.0, 90.0, 40.0]]), ["a", "b"],
                   pred_classes=[7, 42], min_side=64)
        out = d.image.permute(1, 2, 0).numpy()
        assert tuple(out[30, 10]) == class_color(7) and tuple(out[30, 60]) == class_color(42)


def _overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("boxes", [
    [[10.0, 10.0, 60.0, 60.0], [12.0, 11.0, 58.0, 62.0]],  # two nearly identical boxes
    [[5.0, 0.0, 40.0, 30.0], [8.0, 2.0, 45.0, 35.0], [6.0, 1.0, 42.0, 20.0], [7.0, 3.0, 30.0, 40.0]],  # at the top edge
])
def test_captions_of_overlapping_boxes_do_not_overlap(boxes):
    image = torch.full((3, 80, 80), 200, dtype=torch.uint8)
    captions = [f"class_{i} 0.9{i}" for i in range(len(boxes))]
    d = render(image, torch.tensor(boxes), captions, pred_classes=list(range(1, len(boxes) + 1)))
    rects = d.label_boxes
    assert len(rects) == len(boxes)
    h, w = d.image_height, d.image.shape[2]
    for i, a in enumerate(rects):
        assert 0 <= a[0] < a[2] <= w and 0 <= a[1] < a[3] <= h
        for b in rects[i + 1:]:
            assert not _overlap(a, b), (a, b)


def test_legend_names_only_what_is_drawn():
    image = torch.full((3, 64, 64), 90, dtype=torch.uint8)
    pred = torch.tensor([[2.0, 1.0, 20.0, 30.0]])
    # Predictions only (tools/infer.py): no ground-truth entry, no green in the band.
    d = render(image, pred, ["circle 0.97"])
    assert d.legend == ["prediction"]
    band = d.image[:, d.image_height:].permute(1, 2, 0).reshape(-1, 3)
    assert not (band == torch.tensor(GT_COLOR, dtype=torch.uint8)).all(dim=1).any()
    # With classes: the classes drawn, by name; which outline is which only when both kinds are drawn.
    names = ["circle", "triangle", "rectangle"]
    d = render(image, pred, ["circle 0.97"], pred_classes=[1], class_names=names)
    assert d.legend == ["circle"]
    d = render(image, pred, ["circle 0.97"], gt_boxes=torch.tensor([[30.0, 30.0, 60.0, 60.0]]), gt_classes=[3],
               pred_classes=[1], class_names=names)
    assert d.legend == ["circle", "rectangle", "dashed: ground truth", "solid: prediction"]
    # Ground truth only (browsing a data set): no prediction entry.
    d = render(image, None, gt_boxes=pred, gt_labels=["circle"])
    assert d.legend == ["ground truth"]
    # Nothing drawn: no legend band.
    d = render(image, torch.zeros(0, 4))
    assert d.legend == [] and d.image.shape[1] == d.image_height


def test_infer_drawing_has_class_colours_and_no_ground_truth_legend():
    from detector.evaluation.inference import draw_predictions
    from detector.evaluation.palette import class_color

    image = np.full((64, 64, 3), 90, np.uint8)
    det = {"boxes": torch.tensor([[5.0, 5.0, 30.0, 30.0], [35.0, 35.0, 60.0, 60.0]]),
           "labels": torch.tensor([2, 3]), "scores": torch.tensor([0.9, 0.8])}
    out = draw_predictions(image, det, ["circle", "triangle", "rectangle"])
    scale = 5
    assert tuple(out[:, 20 * scale, 5 * scale].tolist()) == class_color(2)
    assert tuple(out[:, 50 * scale, 35 * scale].tolist()) == class_color(3)
    band = out[:, 64 * scale:].permute(1, 2, 0).reshape(-1, 3)
    assert not (band == torch.tensor(GT_COLOR, dtype=torch.uint8)).all(dim=1).any()
    for label in (2, 3):
        assert (band == torch.tensor(class_color(label), dtype=torch.uint8)).all(dim=1).any()


def test_legend_of_80_classes_wraps_inside_the_image():
    image = torch.full((3, 100, 100), 90, dtype=torch.uint8)
    boxes = torch.tensor([[float(i % 10) * 10, float(i // 10) * 12, float(i % 10) * 10 + 8, float(i // 10) * 12 + 9]
                          for i in range(80)])
    names = [f"class_{k}" for k in range(1, 81)]
    d = render(image, boxes, pred_classes=list(range(1, 81)), class_names=names)
    assert d.legend == names
    assert d.image.shape[2] == 100 * d.scale and d.image.shape[1] > d.image_height + 5 * (13 + 8)  # several rows


@pytest.mark.parametrize("h, w, scale", [(1, 60000, 1), (1, 3000, 1), (2, 1000, 4), (120, 160, 3)])
def test_thin_images_are_not_scaled_past_the_drawing_bound(h, w, scale):
    """A thin image is scaled up for its shorter side only as far as its longer side stays
    within MAX_DRAWN_SIDE (a 1 x 60000 PNG made infer draw 320 x 19,200,000 pixels and
    the process was killed for memory); ordinary sizes are scaled as before."""
    from detector.evaluation.plots import MAX_DRAWN_SIDE

    image = torch.zeros(3, h, w, dtype=torch.uint8)
    d = render(image, torch.tensor([[0.0, 0.0, 1.0, 1.0]]), ["a"])
    assert d.image_height == h * scale and d.image.shape[2] == w * scale
    assert max(d.image_height, d.image.shape[2]) <= max(MAX_DRAWN_SIDE, h, w)


# ----------------------------------------------------------------- fonts for class names


def _undrawn_by_default() -> tuple:
    """A letter or symbol that DejaVu Sans lacks but another installed font draws (the STIX
    fonts ship with matplotlib), and that font's characters."""
    import unicodedata

    from detector.evaluation import fonts

    installed = fonts._installed_fonts()
    default = frozenset().union(*(fonts._code_points(p) for n, p in installed if n == fonts.DEFAULT_FONT))
    for name, path in installed:
        extra = [chr(c) for c in sorted(fonts._code_points(path) - default) if unicodedata.category(chr(c))[0] in "LS"]
        if extra:
            return extra[0], fonts._code_points(path)
    pytest.skip("no installed font draws a character that DejaVu Sans lacks")


def test_class_names_no_installed_font_draws_are_one_warning(tmp_path, caplog, recwarn):
    """Chinese class names on a machine without a CJK font: every plot and picture is
    still written, with one warning naming the characters, not matplotlib's warning per
    character and figure (24 lines for two names)."""
    import logging

    from detector.evaluation import fonts
    from detector.evaluation.plots import plot_confusion_matrix, plot_pr_curves

    names = ["猫", "狗狗", "cat"]
    if not fonts.text_font(names).missing:
        pytest.skip("a CJK font is installed here")
    fonts._warn_undrawn.cache_clear()
    caplog.clear()
    curve = (np.array([0.5, 1.0]), np.array([1.0, 0.5]), 0.7)
    with caplog.at_level(logging.WARNING, logger="detector.evaluation"):
        plot_pr_curves({n: curve for n in names}, tmp_path / "pr.png")
        plot_confusion_matrix(np.eye(4, dtype=np.int64), names, tmp_path / "cm.png")
        render(torch.zeros(3, 64, 64, dtype=torch.uint8), torch.tensor([[4.0, 4.0, 40.0, 40.0]]), ["猫 0.9"],
               pred_classes=[1], class_names=names)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no installed font draws the characters '狗猫'" in said[0], said
    assert not [w for w in recwarn if "missing from font" in str(w.message)]
    assert (tmp_path / "pr.png").stat().st_size > 0 and (tmp_path / "cm.png").stat().st_size > 0


def test_class_names_are_drawn_with_an_installed_font_that_has_their_characters(tmp_path, recwarn, caplog):
    """A name with a character DejaVu Sans lacks is drawn with an installed font that has
    it, in the plots (matplotlib's font.family) and in pictures (PIL): nothing missing,
    no warning. Names DejaVu Sans draws leave the user's fonts alone."""
    import matplotlib.pyplot as plt
    from PIL import ImageFont

    from detector.evaluation import fonts

    char, chars = _undrawn_by_default()
    name = f"class {char}"
    font = fonts.text_font([name, "cat"])
    assert font.name and not font.missing and ord(char) in fonts._code_points(font.path) and chars
    with fonts.plot_font([name]) as used:
        assert plt.rcParams["font.family"][0] == used.name == font.name
    with fonts.plot_font(["cat", "dog"]) as used:
        assert used.name is None and plt.rcParams["font.family"] == plt.rcParamsDefault["font.family"]
    image = fonts.image_font([name], 12)
    assert isinstance(image, ImageFont.FreeTypeFont) and image.path == font.path
    render(torch.zeros(3, 64, 64, dtype=torch.uint8), torch.tensor([[4.0, 4.0, 40.0, 40.0]]), [name],
           pred_classes=[1], class_names=[name])
    assert not [w for w in recwarn if "missing from font" in str(w.message)] and not caplog.records


@pytest.mark.parametrize("num_classes", [11, 30])
def test_small_multiples_texts_do_not_overlap(num_classes):
    """The fixed layout of the PR panels: the figure's title, the panels' titles and the
    tick labels shown (left column, and under each column's last panel) are all inside
    the figure and overlap nothing but their own panel."""
    import matplotlib.pyplot as plt

    from detector.evaluation.plots import _small_multiples

    rng = np.random.default_rng(1)
    curves = {(f"class_{k}" if k % 3 else f"a_longer_class_name_{k}"): (np.sort(rng.random(9)), np.linspace(1, 0.1, 9),
                                                                         float(rng.random())) for k in range(num_classes)}
    fig = _small_multiples(curves, "Precision-recall per class", "VOC area AP")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [(-1, "suptitle", fig._suptitle.get_window_extent(renderer))]  # (panel, what, extent)
        panels = [ax for ax in fig.axes if ax.axison]
        assert len(panels) == len(curves)
        for i, ax in enumerate(panels):
            shown = [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_visible() and t.get_text()]
            boxes += [(i, "title", ax.title.get_window_extent(renderer)), (i, "axes", ax.get_window_extent(renderer))]
            boxes += [(i, f"tick {t.get_text()}", t.get_window_extent(renderer)) for t in shown]
        for panel, what, box in boxes:
            assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), (panel, what)
        shown_x = sum(1 for ax in panels for t in ax.get_xticklabels() if t.get_visible() and t.get_text())
        assert shown_x == 3 * int(np.ceil(np.sqrt(len(curves))))  # 0, 0.5, 1 under each column
        for a, (panel_a, what_a, box_a) in enumerate(boxes):
            for panel_b, what_b, box_b in boxes[a + 1:]:
                if panel_a != panel_b:
                    assert not box_a.overlaps(box_b), ((panel_a, what_a), (panel_b, what_b))
    finally:
        plt.close(fig)
