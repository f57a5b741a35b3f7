"""``ops.greedy_scan``: greedy NMS's sequential pass on the device in one kernel. Its
packing of the suppression matrix; its Triton kernel against the pass as tensor
operations, in Triton's interpreter on the CPU; and one call in a compiled graph where
the blocked resolution unrolls thousands of operators. Its agreement with
``torchvision.ops.nms`` is tested through ``static_nms(method="scan")`` in
tests/test_static_nms.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torchvision.ops import box_iou, nms

from detector.modeling.nms import resolve_method, static_nms
from detector.ops import greedy_scan as gs
from detector.ops.greedy_scan import greedy_scan, greedy_scan_reference, pack_suppression

from conftest import ROOT


def test_pack_suppression_puts_column_32w_plus_b_in_bit_b_of_word_w():
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 31, 32, 33, 100):
        sup = torch.rand(2, 5, cols, generator=gen) > 0.5
        words = pack_suppression(sup)
        assert words.shape == (2, 5, (cols + 31) // 32) and words.dtype == torch.int64
        bits = (words[..., None] >> torch.arange(32)) & 1  # [2, 5, W, 32]
        unpacked = bits.flatten(2)[..., :cols].bool()
        assert torch.equal(unpacked, sup)
        assert (bits.flatten(2)[..., cols:] == 0).all() and (words >= 0).all()


def test_the_reference_pass_keeps_what_torchvision_keeps():
    gen = torch.Generator().manual_seed(1)
    xy = torch.rand(1, 200, 2, generator=gen) * 100
    boxes = torch.cat((xy, xy + torch.rand(1, 200, 2, generator=gen) * 30 + 1), -1)[0]
    scores = torch.rand(200, generator=gen)
    order = scores.argsort(descending=True)
    sup = (box_iou(boxes[order], boxes[order]) > 0.5).triu(1)
    keep = greedy_scan_reference(pack_suppression(sup[None]), torch.ones(1, 200, dtype=torch.bool))[0]
    assert order[keep].tolist() == nms(boxes, scores, 0.5).tolist()


KERNEL_CASES = r"""
import torch
from torchvision.ops import box_iou
from detector.ops import greedy_scan as gs

assert type(gs._greedy_scan_kernel).__name__ == "InterpretedFunction", type(gs._greedy_scan_kernel)
gen = torch.Generator().manual_seed(0)
cases = []
for num, spread in ((1, 100), (31, 50), (32, 50), (33, 50), (64, 30), (150, 100), (300, 200)):
    xy = torch.rand(3, num, 2, generator=gen) * spread
    boxes = torch.cat((xy, xy + torch.rand(3, num, 2, generator=gen) * 30 + 1), -1)
    valid = torch.rand(3, num, generator=gen) > 0.2
    cases.append((boxes, valid, 0.5))
x = torch.arange(100.0)  # a chain: each box suppresses the next only; every other one is kept
chain = torch.stack((x, torch.zeros(100), x + 10, torch.full((100,), 10.0)), 1)[None]
cases.append((chain, torch.ones(1, 100, dtype=torch.bool), 0.7))
same = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(1, 40, 1)  # identical boxes: the first one stays
cases.append((same, torch.ones(1, 40, dtype=torch.bool), 0.5))
cases.append((same, torch.zeros(1, 40, dtype=torch.bool), 0.5))  # nothing valid
for boxes, valid, thr in cases:
    num = boxes.shape[1]
    sup = torch.stack([box_iou(b, b) > thr for b in boxes]) & torch.ones(num, num, dtype=torch.bool).triu(1)
    words = gs.pack_suppression(sup & valid[:, :, None])
    got, want = gs.greedy_scan_triton(words, valid), gs.greedy_scan_reference(words, valid)
    assert torch.equal(got, want), (num, thr)
assert gs.greedy_scan_triton(torch.zeros(2, 0, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool)).shape == (2, 0)
print("cases", len(cases), "chain kept", int(gs.greedy_scan_reference(
    gs.pack_suppression((box_iou(chain[0], chain[0]) > 0.7).triu(1)[None]), torch.ones(1, 100, dtype=torch.bool)).sum()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on the CPU)")
def test_the_triton_kernel_keeps_what_the_reference_pass_keeps_in_the_interpreter():
    """The kernel that CUDA runs, run by Triton's interpreter on CPU tensors: random sets
    of 1 to 300 boxes (word boundaries at 32 and 64), a 100-box chain, identical boxes,
    nothing valid, no boxes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", KERNEL_CASES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cases 10 chain kept 50" in out.stdout


@pytest.mark.slow  # Triton's compiler API is the pinned torch's Triton's (3.6-3.8 checked)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernel_compiles_to_gpu_code_without_a_gpu(capability):
    """Triton's real pipeline (not its interpreter) lowers the kernel to a cubin for an
    A100 (8.0) and an H100 (9.0), at R50-FPN 1x's sizes (2000 boxes, 63 words)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from detector.ops import greedy_scan as scan
    signature = {"words_ptr": "*i64", "valid_ptr": "*i8", "keep_ptr": "*i8", "num_words": "i32",
                 "NUM": "constexpr", "BLOCK_W": "constexpr"}
    src = ASTSource(fn=scan._greedy_scan_kernel, signature=signature, constexprs={"NUM": 2000, "BLOCK_W": 64})
    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 1})
    assert len(kernel.asm["cubin"]) > 1000 and ".target sm_%d" % capability in kernel.asm["ptx"]


def _graph_nodes(fn, *args) -> int:
    """Operators in the one graph ``torch.compile(fullgraph=True)`` makes of ``fn``."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(node.op == "call_function" for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    assert len(counts) == 1
    return counts[0]


def test_one_call_in_the_compiled_graph_where_the_blocks_unroll():
    """The scan is one operator of a graph compiled whole; the blocked resolution of 600
    boxes (the demo's proposals per level) unrolls into thousands, which is what made the
    first GPU run compile for minutes and launch a kernel for each."""
    gen = torch.Generator().manual_seed(2)
    xy = torch.rand(2, 600, 2, generator=gen) * 200
    boxes = torch.cat((xy, xy + torch.rand(2, 600, 2, generator=gen) * 40 + 1), -1)
    scores = torch.rand(2, 600, generator=gen)

    def run(method):
        return lambda b, s: static_nms(b, s, 0.7, 300, method=method)

    scan, blocks = _graph_nodes(run("scan"), boxes, scores), _graph_nodes(run("blocks"), boxes, scores)
    assert scan < 60 and blocks > 30 * scan, (scan, blocks)
    compiled = torch.compile(run("scan"), fullgraph=True, dynamic=False, backend="aot_eager")
    torch._dynamo.reset()
    got, want = compiled(boxes, scores), static_nms(boxes, scores, 0.7, 300, method="blocks")
    assert torch.equal(got.keep, want.keep) and torch.equal(got.valid, want.valid)


def test_the_operator_has_a_fake_kernel_for_tracing():
    words = torch.zeros(3, 7, 1, dtype=torch.int64, device="meta")
    out = greedy_scan(words, torch.ones(3, 7, dtype=torch.bool, device="meta"))
    assert out.shape == (3, 7) and out.dtype == torch.bool and out.device.type == "meta"


@pytest.mark.gpu
def test_cuda_scan_keeps_what_torchvision_keeps_and_replays_in_a_cuda_graph():
    """On CUDA ``static_nms`` runs the kernel (``method="auto"``): torchvision's choice on a
    3000-box chain and on random sets, also replayed from a captured CUDA graph."""
    x = torch.arange(3000.0)
    chain = torch.stack((x, torch.zeros(3000), x + 10, torch.full((3000,), 10.0)), 1).cuda()
    scores = torch.linspace(1.0, 0.0, 3000, device="cuda")
    res = static_nms(chain[None], scores[None], 0.7, 3000)
    assert res.keep[0][res.valid[0]].tolist() == list(range(0, 3000, 2)) and not res.unconverged.any()
    gen = torch.Generator().manual_seed(3)
    xy = torch.rand(4, 2000, 2, generator=gen) * 800
    boxes = torch.cat((xy, xy + torch.rand(4, 2000, 2, generator=gen) * 100 + 1), -1).cuda()
    rand_scores = torch.rand(4, 2000, generator=gen).cuda()  # no ties: CUDA's nms sort is not stable
    want = [nms(b, s, 0.7)[:1000].tolist() for b, s in zip(boxes, rand_scores)]
    static_nms(boxes, rand_scores, 0.7, 1000)  # compiles the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = static_nms(boxes, rand_scores, 0.7, 1000)
    graph.replay()
    torch.cuda.synchronize()
    assert [k[v].tolist() for k, v in zip(captured.keep, captured.valid)] == want


def test_scan_is_chosen_only_on_gpus_that_triton_supports(monkeypatch):
    """"auto" takes the kernel on CUDA GPUs of compute capability 7.0 and later (with
    Triton), and the blocked resolution elsewhere: on a Pascal GPU (6.1), the CPU, or
    without Triton."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gs, "triton", object())
    for capability, method in (((6, 1), "blocks"), ((7, 0), "scan"), ((9, 0), "scan")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_method("auto", cuda) == method, capability
    assert resolve_method("auto", torch.device("cpu")) == "blocks"
    monkeypatch.setattr(gs, "triton", None)
    assert resolve_method("auto", cuda) == "blocks"
