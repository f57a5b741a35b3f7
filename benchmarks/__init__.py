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
Tasks: ``train`` (with ``--count-ops`` / ``--profile``), ``infer``, ``data``, ``eval``,
``time-to-accuracy`` and ``scaling`` (docs/performance.md).

Modules: ``timing`` (runners, statistics, machine), ``memory`` (peak memory of this
process), ``batches``, ``torchvision_ref`` (torchvision's model built like a config, and
its references/detection training iteration: the one place that trains it), ``steps``
(the timed steps), ``profiling``, ``tasks`` (the timed tasks, and an exported file
against the eager model for ``tools/export.py --time``), ``coco_case`` (the scoring
reference of ``--task eval``), ``time_to_accuracy``, ``scaling`` (1 vs 2 ranks under
DDP, all-reduce share, the ``train.ddp_*`` sweep), ``records_memory`` (memory of the
annotation records at scale: parse, forked workers, ranks), ``coco_file`` (a COCO file
of any size for it), ``run`` (the entry).

A top-level package next to ``detector``, not part of it: nothing in ``detector``
imports it. It runs from a checkout (``tools/benchmark.py`` puts the checkout on
``sys.path``; pytest has ``pythonpath = ["."]``).
"""

from .run import TASKS, format_summary, run_benchmark

__all__ = ["TASKS", "format_summary", "run_benchmark"]
