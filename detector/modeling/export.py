"""Export a detector to TorchScript or ONNX, and check the file against the eager model.

The exported graph is ``DetectorForExport``: one RGB image ``[3, H, W]`` in, the
detections out, with the model's pre-processing (to float, normalise, pad to a multiple
of ``size_divisibility``), RPN, RoI heads, post-processing and NMS inside. Both formats
are produced by tracing (``torch.jit.trace``; ``torch.onnx.export(dynamo=False)``, the
TorchScript-based exporter that torchvision's detection models use). The model code
keeps every size that depends on the image as a tensor while tracing (see
``box_coder.clip_boxes``, ``rpn.top_count``, ``AnchorGenerator.grid_anchors``), so the
traced graph takes any image size and returns a variable number of detections.

``verify_export`` runs the file (TorchScript in torch, ONNX in onnxruntime) on test
images and matches its detections against the eager model's: the same count, and each
eager detection paired with an exported one of the same label whose coordinates differ
by at most ``box_tol + box_rtol * max(H, W)`` pixels (1e-3 px + 2e-5 of the image's
longer side: 2.9e-3 px at 96 px, 2.8e-2 px at 1333 px) and whose score differs by at
most ``score_tol`` (1e-4).

The relative term is float32 noise: ONNX Runtime's and PyTorch's convolution kernels
round differently, and through a ResNet-50 (random weights) the decoded boxes differ by
up to 1.06e-5 of the image's longer side (1.06e-2 px on a 999x600 image; see
docs/deploy.md). TorchScript runs PyTorch's own kernels and matches exactly.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .faster_rcnn import FasterRCNN

from detector.files import write_bytes
from detector.messages import DetectorError, first_line

FORMATS = ("torchscript", "onnx")
INSTALL_HINT = "pip install -e \".[export]\""
BOX_TOL = 1e-3  # pixels
BOX_RTOL = 2e-5  # of the image's longer side (float32 noise of other kernels on large images)
SCORE_TOL = 1e-4
DEFAULT_OPSET = 17
Detections = Tuple[Tensor, Tensor, Tensor]  # boxes [M, 4] float32, scores [M] float32, labels [M] int64


class ExportError(DetectorError, RuntimeError):
    """An export or parity-check failure, with a one-line message."""


def _size(image: Tensor) -> str:
    return "x".join(str(int(n)) for n in image.shape[-2:])


def image_to_float(image: Tensor) -> Tensor:
    """uint8 0..255 -> float32 0..1; a float image (0..1) is only cast. The export wrapper
    scripts it, so that a traced graph keeps the branch and takes either dtype."""
    if image.dtype == torch.uint8:
        return image.float() / 255.0
    return image.float()


class DetectorForExport(nn.Module):
    """The eval-mode ``FasterRCNN`` for one image, in a traceable form.

    Forward: ``image`` ``[3, H, W]`` RGB, uint8 0..255 or float 0..1 (the ONNX file fixes
    uint8) -> ``(boxes [M, 4] float32 x1y1x2y2 in the image's pixels, scores [M] float32,
    labels [M] int64 in 1..K)``, sorted by decreasing score. The same computation as
    ``FasterRCNN.forward`` in eval mode on ``[image]``.
    """

    def __init__(self, model: FasterRCNN) -> None:
        super().__init__()
        self.model = model
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
            self.to_float = torch.jit.script(image_to_float)

    def forward(self, image: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        m = self.model
        height, width = image.shape[-2], image.shape[-1]
        x = (self.to_float(image) - m.pixel_mean) / m.pixel_std
        d = m.size_divisibility
        batch = F.pad(x, [0, (d - width % d) % d, 0, (d - height % d) % d])[None]  # zeros after normalising
        sizes = [(height, width)]
        features = m.backbone(batch)
        proposals, _ = m.rpn(list(features.values()), (batch.shape[-2], batch.shape[-1]), sizes)
        pooled = [features[name] for name in m.backbone.pooled_levels]
        detections, _ = m.roi_heads(pooled, proposals, sizes)
        return detections[0]["boxes"], detections[0]["scores"], detections[0]["labels"]


def require_onnx() -> None:
    """Raise ``ExportError`` (one line, with the install command) when ``onnx`` or
    ``onnxruntime`` is missing."""
    missing = [name for name in ("onnx", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"ONNX export needs {' and '.join(missing)}: {INSTALL_HINT}")


def require_exportable(model: FasterRCNN) -> None:
    """Raise ``ExportError`` (one line naming the config key) for what tracing cannot
    export faithfully: Soft-NMS (``roi_heads.nms.type: soft``) is a Python loop over the
    boxes, so a trace would replay the example image's iteration count on every image
    (a silently wrong file)."""
    if model.roi_heads.soft_nms is not None:
        raise ExportError("roi_heads.nms.type=soft cannot be exported (Soft-NMS is a loop that tracing fixes "
                          "to the example image); export with roi_heads.nms.type=hard")


def export_model(model: FasterRCNN, fmt: str, path: str | os.PathLike, example: Tensor,
                 opset: int = DEFAULT_OPSET, metadata: Optional[Dict[str, str]] = None) -> None:
    """Trace ``DetectorForExport(model)`` on ``example`` (``[3, H, W]`` uint8) and write it.

    Args:
        model: the detector, on the CPU (tracing records devices); put in eval mode.
        fmt: ``"torchscript"`` (``torch.jit.save``) or ``"onnx"`` (input ``image``
            ``[3, height, width]`` uint8; outputs ``boxes``, ``scores``, ``labels`` with a
            dynamic ``detections`` axis).
        opset: ONNX opset (>= 11 for torchvision's NMS and RoIAlign).
        metadata: ONNX only: string pairs stored as the file's ``metadata_props`` (see
            ``export_metadata``), readable with onnxruntime's ``get_modelmeta()``.

    The graph is serialised in memory, then written by ``detector.files.write_bytes``
    (temporary file, fsync, rename): a full disk or a folder at ``path`` is an
    ``OutputError`` naming the path, and leaves no partial file.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    if model.device.type != "cpu":
        raise ExportError(f"export traces the model on the CPU; it is on {model.device}")
    require_exportable(model)
    wrapper = DetectorForExport(model.eval()).eval()
    with warnings.catch_warnings(), torch.no_grad():
        # Tracer warnings about Python values are expected (checks, loop counts over
        # levels); verify_export compares the result with the eager model.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*is deprecated.*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message="The feature will be removed.*", category=DeprecationWarning)
        # The indices of every advanced indexing are non-negative (from torch.where, labels).
        warnings.filterwarnings("ignore", message=".*aten::index operator of advanced indexing.*")
        # An opset newer than the exporter knows: it warns, then raises (_trace_onnx says it in one line).
        warnings.filterwarnings("ignore", message=".*opset version .* is not supported.*")
        buffer = io.BytesIO()
        if fmt == "torchscript":
            torch.jit.save(torch.jit.trace(wrapper, (example,), check_trace=False), buffer)
            write_bytes(path, buffer.getvalue())
            return
        _trace_onnx(wrapper, example, buffer, opset)
    import onnx  # optional dependency, checked by require_onnx

    proto = onnx.load_from_string(buffer.getvalue())
    if metadata:
        onnx.helper.set_model_props(proto, {str(k): str(v) for k, v in metadata.items()})
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"the ONNX file {path} is not valid: {first_line(exc)}") from None
    write_bytes(path, proto.SerializeToString())


def _trace_onnx(wrapper: DetectorForExport, example: Tensor, buffer: io.BytesIO, opset: int) -> None:
    """``torch.onnx.export`` of ``wrapper`` into ``buffer`` (the legacy TorchScript-based
    exporter: torchvision's NMS and RoIAlign), after the opset checks; an opset newer than
    this torch's exporter knows is one line. Called inside ``export_model``'s warning filters."""
    require_onnx()
    if opset < 11:
        raise ExportError(f"--opset must be >= 11 (NMS and RoIAlign), got {opset}")
    if wrapper.model.roi_heads.box_roi_pool.aligned and opset < 16:  # older RoiAlign has no half-pixel mode
        raise ExportError(f"roi_heads.aligned=true needs --opset >= 16, got {opset}")
    try:
        torch.onnx.export(
            wrapper, (example,), buffer, dynamo=False, opset_version=opset,
            input_names=["image"], output_names=["boxes", "scores", "labels"],
            dynamic_axes={"image": {1: "height", 2: "width"}, "boxes": {0: "detections"},
                          "scores": {0: "detections"}, "labels": {0: "detections"}},
        )
    except (RuntimeError, ValueError) as exc:
        if "opset" not in str(exc).lower():
            raise
        raise ExportError(f"--opset {opset}: torch {torch.__version__} cannot export it ({first_line(exc)}); "
                          f"use a lower opset (the default is {DEFAULT_OPSET})") from None


def export_metadata(class_names: Sequence[str], min_size_test: int, max_size_test: int) -> Dict[str, str]:
    """What a user of the exported file needs besides it: the class name of each label
    1..K (JSON list; label 0 is background) and the resize the model was tested with
    (shorter side to ``min_size_test``, longer side at most ``max_size_test``)."""
    return {"class_names": json.dumps(list(class_names)), "num_classes": str(len(class_names)),
            "input": "image: uint8 RGB [3, height, width], resized by the caller",
            "min_size_test": str(min_size_test), "max_size_test": str(max_size_test)}


def load_exported(fmt: str, path: str | os.PathLike, threads: int = 0) -> Callable[[Tensor], Detections]:
    """A function ``image [3, H, W] uint8 (CPU) -> (boxes, scores, labels)`` running the
    exported file: TorchScript through ``torch.jit.load``, ONNX through onnxruntime's CPU
    provider (``threads`` intra-op threads; 0 = onnxruntime's default)."""
    if not os.path.isfile(path):
        raise ExportError(f"exported file not found: {path}")
    if fmt == "torchscript":
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
                module = torch.jit.load(str(path), map_location="cpu").eval()
        except (RuntimeError, ValueError) as exc:
            raise ExportError(f"cannot load TorchScript file {path}: {first_line(exc)}") from None

        def run_torchscript(image: Tensor) -> Detections:
            try:
                with torch.no_grad():
                    boxes, scores, labels = module(image)
            except RuntimeError as exc:  # the interpreter's message ends with the failing op's error
                lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
                raise ExportError(f"running {path} on a {_size(image)} image failed: {lines[-1].strip()}") from None
            return boxes, scores, labels

        return run_torchscript
    require_onnx()
    import onnxruntime  # optional dependency, checked above

    try:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        # Idle threads sleep instead of spinning, as torch's under OMP_WAIT_POLICY=PASSIVE: spinning
        # threads steal the cores of whatever else runs (the eager model, when timed side by side).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types (InvalidGraph, Fail, ...)
        if "NOT_IMPLEMENTED" in str(exc):  # a valid file of a newer opset than this onnxruntime runs
            raise ExportError(f"onnxruntime {onnxruntime.__version__} cannot run {path} ({first_line(exc)}), so it "
                              f"is not checked: export with a lower --opset (the default is {DEFAULT_OPSET}) to check "
                              "it here") from None
        raise ExportError(f"cannot load ONNX file {path}: {first_line(exc)}") from None

    def run_onnx(image: Tensor) -> Detections:
        try:
            boxes, scores, labels = session.run(None, {"image": image.cpu().numpy()})
        except Exception as exc:  # onnxruntime's own exception types (Fail, InvalidArgument, ...)
            raise ExportError(f"running {path} on a {_size(image)} image failed: {first_line(exc)}") from None
        return torch.from_numpy(boxes), torch.from_numpy(scores), torch.from_numpy(labels)

    return run_onnx


@dataclass
class ParityReport:
    """The comparison of one image's detections (eager vs exported).

    Attributes:
        image_size: ``(H, W)``.
        num_eager, num_exported: detection counts.
        max_box_diff: largest coordinate difference (pixels) over matched pairs.
        max_score_diff: largest score difference over matched pairs.
        unmatched: eager detections with no exported detection of the same label within
            the tolerances.
        ok: same count and every detection matched.
    """

    image_size: Tuple[int, int]
    num_eager: int
    num_exported: int
    max_box_diff: float
    max_score_diff: float
    unmatched: int
    ok: bool

    def line(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (f"image {self.image_size[0]}x{self.image_size[1]}: {self.num_eager} eager / {self.num_exported} "
                f"exported detections, max |box diff| {self.max_box_diff:.2e} px, max |score diff| "
                f"{self.max_score_diff:.2e}, {self.unmatched} unmatched: {verdict}")


def compare_detections(eager: Detections, exported: Detections, image_size: Tuple[int, int],
                       box_tol: float = BOX_TOL, score_tol: float = SCORE_TOL,
                       box_rtol: float = BOX_RTOL) -> ParityReport:
    """Pair each eager detection (in order) with the unpaired exported detection of the
    same label closest in box coordinates; a pair counts when every coordinate agrees
    within ``box_tol + box_rtol * max(image_size)`` pixels and the scores within
    ``score_tol``. Pairing rather than comparing row by row tolerates two detections
    whose scores are closer than float noise swapping places."""
    e_boxes, e_scores, e_labels = (t.detach().cpu() for t in eager)
    x_boxes, x_scores, x_labels = (t.detach().cpu() for t in exported)
    e_boxes, x_boxes = e_boxes.double().reshape(-1, 4), x_boxes.double().reshape(-1, 4)
    e_scores, x_scores = e_scores.double(), x_scores.double()
    allowed = box_tol + box_rtol * max(image_size)
    free = torch.ones(len(x_boxes), dtype=torch.bool)
    max_box = max_score = 0.0
    unmatched = 0
    for i in range(len(e_boxes)):
        candidates = torch.where(free & (x_labels.long() == int(e_labels[i])))[0]
        if len(candidates) == 0:
            unmatched += 1
            continue
        box_diff = (x_boxes[candidates] - e_boxes[i]).abs().amax(dim=1)
        score_diff = (x_scores[candidates] - e_scores[i]).abs()
        j = int(torch.argmin(box_diff + score_diff))
        if box_diff[j] > allowed or score_diff[j] > score_tol:
            unmatched += 1
            continue
        free[candidates[j]] = False
        max_box, max_score = max(max_box, float(box_diff[j])), max(max_score, float(score_diff[j]))
    ok = unmatched == 0 and len(e_boxes) == len(x_boxes)
    return ParityReport(tuple(image_size), len(e_boxes), len(x_boxes), max_box, max_score, unmatched, ok)


def verify_export(model: FasterRCNN, fmt: str, path: str | os.PathLike, images: Sequence[Tensor],
                  box_tol: float = BOX_TOL, score_tol: float = SCORE_TOL,
                  box_rtol: float = BOX_RTOL) -> List[ParityReport]:
    """Run the exported file and the eager model on each ``[3, H, W]`` uint8 image and
    compare (``compare_detections``). Returns one report per image; the caller decides
    what a mismatch means (``tools/export.py`` exits with status 1). A model that
    cannot be exported (``require_exportable``) raises ``ExportError``: no file matches it."""
    require_exportable(model)
    run = load_exported(fmt, path)
    model.eval()
    reports = []
    for image in images:
        with torch.no_grad():
            det = model([image.to(model.device)])[0]
        eager = (det["boxes"], det["scores"], det["labels"])
        reports.append(compare_detections(eager, run(image.cpu()), tuple(image.shape[-2:]), box_tol, score_tol,
                                          box_rtol))
    return reports
