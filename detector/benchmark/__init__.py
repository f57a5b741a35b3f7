"""Speed and memory benchmarks: training step, inference, data loading, COCO scoring.

Every timed task follows the same recipe:

- ``warmup`` untimed iterations first (allocator, caches, lazy initialisation, workers);
- then ``iters`` timed iterations, each bracketed by ``torch.cuda.synchronize()`` on
  CUDA so the time is the device's, not the launch queue's;
- the result is the median time per iteration (seconds), its spread (mean, std, min,
  max, inter-quartile range), images per second from the median, and peak memory:
  ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak resident set size on
  CPU (``VmHWM``, reset per iteration through ``/proc/self/clear_refs`` where the
  kernel allows it, else the lifetime ``ru_maxrss`` of ``resource.getrusage``).

``--compare-torchvision`` builds :class:`torchvision.models.detection.FasterRCNN` with
the same backbone, FPN, anchors, samplers, head sizes, thresholds and normalisation
(:func:`build_torchvision_model`) and times it on the same cached batches in the same
process. The two models alternate iteration by iteration (the order flips every
iteration), so background load on a shared machine affects both alike. The reported
``ratio`` is ours / torchvision in images per second (> 1: ours is faster).

Entry point: :func:`run_benchmark` (``tools/benchmark.py`` parses arguments and calls it).

Modules: ``timing`` (runners, statistics, machine), ``memory`` (peak memory, a
command's process tree), ``batches``, ``torchvision_ref`` (the torchvision counterpart),
``steps`` (the timed steps), ``profiling``, ``tasks``, ``coco_case`` (the scoring
reference), ``loader_sweep`` (loader throughput by worker count), ``tta`` (time to
accuracy against torchvision's references/detection recipe), ``canvas_cost`` (padded
pixels of ``model.canvas_sizes``), ``scaling`` (1 vs 2 ranks under DDP, all-reduce share,
the ``train.ddp_*`` sweep), ``run`` (the entry).

This package is the top layer of the library: nothing in ``detector`` imports it.
"""

from .run import TASKS, format_summary, run_benchmark

__all__ = ["TASKS", "format_summary", "run_benchmark"]
