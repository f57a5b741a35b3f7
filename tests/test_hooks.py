"""The loop's hooks, driven through their public methods with a hand-made LoopState."""

from __future__ import annotations

import errno
import logging
import math
import json
import datetime
import os
import signal

import pytest
import torch
from torch import nn

from detector.engine.checkpointing import Checkpointer, CheckpointWriteError
from detector.engine.hooks import (
    EvalHook,
    EvaluationError,
    MetricsWriter,
    NonFiniteGuard,
    NonFiniteLossError,
    PeriodicCheckpointer,
    SignalHook,
)
from detector.engine.log import LOG_WIDTH, DeviceCounter, EventWriters, JSONLWriter, read_jsonl, setup_logging
from detector.engine.train_loop import LoopState
from detector.engine.step import StepResult

NAMES = ("total_loss", "loss_a", "loss_b")


def result(a: float, b: float, grad_norm: float = 1.0, stop: bool = False) -> StepResult:
    total = a + b
    bad = not math.isfinite(total)
    return StepResult(torch.tensor([total, a, b]), NAMES, torch.tensor(grad_norm), bad, bad, stop)


def run_steps(hooks, state: LoopState, results) -> None:
    for r in results:
        state.step = r
        state.iteration += 1
        state.batch_images = 2
        for h in hooks:
            h.after_step(state)


class Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(4.0))


def make_checkpointer(tmp_path, module: nn.Module, opt=None, keep_last: int = 0) -> Checkpointer:
    opt = opt or torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return Checkpointer(tmp_path, lambda: {"model": module.state_dict(), "optimizer": opt.state_dict()}, keep_last=keep_last)


# --------------------------------------------------------------------------- metrics


def test_metrics_writer_means_names_lrs_and_counts_skipped(tmp_path, caplog):
    model = Params()
    opt = torch.optim.SGD([{"params": [model.w], "lr": 0.02, "name": "default"}])
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.002, "name": "backbone.body"})
    writers = EventWriters(jsonl=JSONLWriter(tmp_path / "metrics.jsonl"))
    hook = MetricsWriter(3, opt, writers, torch.device("cpu"))
    state = LoopState(max_iter=4)
    with caplog.at_level(logging.INFO, logger="detector.engine"):
        hook.before_train(state)
        run_steps([hook], state, [result(1.0, 2.0, 4.0), result(float("nan"), 1.0, float("nan")), result(3.0, 4.0, 2.0),
                                  result(5.0, 5.0, 1.0)])
        state.status = "finished"
        hook.after_train(state)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == [3, 4]
    first = recs[0]
    # Means over the finite steps only; the NaN step is counted.
    assert (first["total_loss"], first["loss_a"], first["loss_b"]) == (5.0, 2.0, 3.0)
    assert first["grad_norm"] == 3.0 and first["nonfinite_skipped"] == 1
    assert first["lr"] == 0.02 and first["lr/default"] == 0.02 and first["lr/backbone.body"] == 0.002
    assert recs[1]["total_loss"] == 10.0 and recs[1]["nonfinite_skipped"] == 0
    # The console line names each group's LR.
    assert "lr[default] 0.02" in caplog.text and "lr[backbone.body] 0.002" in caplog.text and "eta" in caplog.text


def test_metrics_writer_logs_the_lr_each_iteration_used(tmp_path):
    """The step steps the scheduler before the hooks run: the groups then hold the next
    iteration's LR, which was logged (iteration 1 showed the second warmup value, and a
    drop at step N showed at iteration N although N trained at the old LR)."""
    from detector.engine.optim import WarmupLRScheduler

    model = Params()
    opt = torch.optim.SGD([{"params": [model.w], "lr": 0.1, "name": "default"}])
    sched = WarmupLRScheduler(opt, max_iter=10, steps=[3], warmup_iters=2, warmup_factor=0.01)
    used = []
    hook = MetricsWriter(1, opt, EventWriters(jsonl=JSONLWriter(tmp_path / "metrics.jsonl")), torch.device("cpu"),
                         scheduler=sched)
    state = LoopState(max_iter=10)
    for _ in range(4):
        used.append(opt.param_groups[0]["lr"])  # what the optimizer step of this iteration uses
        sched.step()
        run_steps([hook], state, [result(1.0, 1.0)])
    assert [r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == pytest.approx(used, rel=1e-12)
    assert used[0] == pytest.approx(0.001) and used[3] == pytest.approx(0.01)


def test_metrics_writer_progress_bar_keeps_log_lines_out_of_the_console(tmp_path, capsys, caplog):
    model = Params()
    opt = torch.optim.SGD([{"params": [model.w], "lr": 0.5, "name": "default"}])
    hook = MetricsWriter(1, opt, EventWriters(), torch.device("cpu"), progress_bar=True)
    state = LoopState(max_iter=2)
    with caplog.at_level(logging.DEBUG, logger="detector.engine"):
        hook.before_train(state)
        run_steps([hook], state, [result(1.0, 1.0), result(1.0, 2.0)])
        state.status = "finished"
        hook.after_train(state)
    err = capsys.readouterr().err
    assert "train: 100%" in err and "2/2" in err and "loss 3.0000" in err
    # The full line still goes to the log (DEBUG: log.txt), not to the console at INFO.
    lines = [r for r in caplog.records if "iter 2/2" in r.getMessage()]
    assert lines and all(r.levelno == logging.DEBUG for r in lines)


def test_failed_run_leaves_a_stopped_record(tmp_path):
    opt = torch.optim.SGD(Params().parameters(), lr=0.1)
    writers = EventWriters(jsonl=JSONLWriter(tmp_path / "m.jsonl"))
    hook = MetricsWriter(10, opt, writers, torch.device("cpu"))
    state = LoopState(max_iter=5, iteration=3, status="failed", error="boom")
    hook.after_train(state)
    assert read_jsonl(tmp_path / "m.jsonl") == [{"iteration": 3, "type": "stopped", "reason": "boom"}]


STAT_NAMES = ("roi/fg_cls_accuracy", "rpn/num_pos_anchors")


def with_stats(r: StepResult, fg_acc: float, pos: float) -> StepResult:
    r.stats, r.stat_names = torch.tensor([fg_acc, pos]), STAT_NAMES
    return r


class Scalars:
    """A TensorBoard writer stand-in: the scalars written, by step."""

    def __init__(self) -> None:
        self.by_step = {}

    def scalars(self, values, step):
        self.by_step[step] = dict(values)

    def close(self):
        pass


def test_metrics_writer_stats_are_means_over_defined_steps_and_counters_grow(tmp_path, caplog):
    opt = torch.optim.SGD(Params().parameters(), lr=0.1)
    tb = Scalars()
    writers = EventWriters(jsonl=JSONLWriter(tmp_path / "m.jsonl"), tb=tb)
    count = torch.zeros((), dtype=torch.int64)
    counter = DeviceCounter("static/nms_unconverged", count, "it grew by {count}: raise key 'rpn.nms_max_iters'")
    hook = MetricsWriter(4, opt, writers, torch.device("cpu"), counters=[counter])
    state = LoopState(max_iter=6)
    nan = float("nan")
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        hook.before_train(state)
        first = [with_stats(result(1.0, 2.0), nan, 4.0), with_stats(result(nan, 1.0, nan), 0.0, 100.0),
                 with_stats(result(1.0, 2.0), 0.5, 6.0), with_stats(result(1.0, 2.0), 1.0, 8.0)]
        run_steps([hook], state, first[:3])
        count += 3  # the step's in-place update
        run_steps([hook], state, first[3:] + [with_stats(result(1.0, 2.0), nan, 1.0)])
        run_steps([hook], state, [with_stats(result(1.0, 2.0), nan, 2.0)])
    first_rec, second_rec = [r for r in read_jsonl(tmp_path / "m.jsonl") if r["type"] == "train"]
    # The non-finite step is left out; NaN (undefined) values are left out of the means.
    assert first_rec["roi/fg_cls_accuracy"] == 0.75 and first_rec["rpn/num_pos_anchors"] == 6.0
    assert "roi/fg_cls_accuracy" not in second_rec and second_rec["rpn/num_pos_anchors"] == 1.5
    assert (first_rec["static/nms_unconverged"], second_rec["static/nms_unconverged"]) == (3, 0)
    assert tb.by_step[4]["rpn/num_pos_anchors"] == 6.0 and tb.by_step[4]["static/nms_unconverged"] == 3
    assert [r.getMessage() for r in caplog.records] == ["it grew by 3: raise key 'rpn.nms_max_iters'"]


def _metrics_rank(rank: int, world_size: int, folder: str) -> None:
    """A spawned rank: losses and statistics differ by rank; rank 1 has no defined
    foreground accuracy. Rank 0 writes the record."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        opt = torch.optim.SGD(Params().parameters(), lr=0.1)
        writers = EventWriters(jsonl=JSONLWriter(os.path.join(folder, "m.jsonl"))) if rank == 0 else EventWriters()
        hook = MetricsWriter(2, opt, writers, torch.device("cpu"), world_size=world_size, is_main=rank == 0)
        state = LoopState(max_iter=2)
        acc = [0.2, 0.4] if rank == 0 else [float("nan")] * 2
        run_steps([hook], state, [with_stats(result(1.0 + rank, 2.0), acc[i], 10.0 * (rank + 1) + i)
                                  for i in range(2)])
        dist.barrier()  # neither rank tears the group down while its peer still uses it
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_metrics_writer_averages_stats_over_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_metrics_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    (rec,) = read_jsonl(tmp_path / "m.jsonl")
    assert rec["loss_a"] == 1.5 and rec["total_loss"] == 3.5
    assert rec["rpn/num_pos_anchors"] == pytest.approx(15.5)  # (10, 11, 20, 21)
    assert rec["roi/fg_cls_accuracy"] == pytest.approx(0.3)  # rank 1's are undefined


# --------------------------------------------------------------------------- checkpoints


def test_periodic_and_final_checkpoints(tmp_path):
    module = Params()
    ck = make_checkpointer(tmp_path, module, keep_last=2)
    hook = PeriodicCheckpointer(ck, period=2)
    state = LoopState(max_iter=7)
    run_steps([hook], state, [result(1.0, 1.0)] * 7)
    state.status = "finished"
    hook.after_train(state)
    d = tmp_path / "checkpoints"
    assert sorted(p.name for p in d.iterdir()) == ["iter_0000006.pth", "iter_0000007.pth", "last.pth"]
    assert ck.saved["last.pth"] == 7 and ck.newest == d / "last.pth"


def test_stop_writes_last_once(tmp_path):
    ck = make_checkpointer(tmp_path, Params())
    hook = PeriodicCheckpointer(ck, period=2)
    state = LoopState(max_iter=10)
    run_steps([hook], state, [result(1.0, 1.0)] * 4)  # last.pth at 4 by the period
    mtime = (tmp_path / "checkpoints" / "last.pth").stat().st_mtime_ns
    state.status = "interrupted"
    hook.after_train(state)
    assert (tmp_path / "checkpoints" / "last.pth").stat().st_mtime_ns == mtime  # not rewritten
    run_steps([hook], state, [result(1.0, 1.0)])
    hook.after_train(state)
    assert torch.load(tmp_path / "checkpoints" / "last.pth", weights_only=True)["model"]["w"].tolist() == [0, 1, 2, 3]
    assert ck.saved["last.pth"] == 5


def test_nonfinite_state_is_never_saved(tmp_path, caplog):
    module = Params()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ck = make_checkpointer(tmp_path, module, opt)
    assert ck.save(["last.pth"], 1) == tmp_path / "checkpoints" / "last.pth"
    with torch.no_grad():
        module.w[2] = float("inf")
    with caplog.at_level(logging.ERROR, logger="detector.engine"):
        assert ck.save(["iter_0000002.pth", "last.pth"], 2) is None
    assert "NOT written" in caplog.text and "w" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pth"]
    assert ck.newest == tmp_path / "checkpoints" / "last.pth" and ck.newest_iteration == 1
    # Finite weights but a poisoned momentum buffer: refused too.
    with torch.no_grad():
        module.w[2] = 0.0
    module.w.grad = torch.full((4,), float("nan"))
    opt.step()
    module.w.data.copy_(torch.arange(4.0))
    assert ck.save(["last.pth"], 3) is None


def test_full_disk_is_one_line_naming_output_dir_and_keeps_last(tmp_path, monkeypatch):
    ck = make_checkpointer(tmp_path, Params())
    ck.save(["last.pth"], 1)

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(["iter_0000002.pth", "last.pth"], 2)
    monkeypatch.undo()
    msg = str(e.value)
    assert "\n" not in msg and f"train.output_dir={tmp_path}" in msg and "(no space left on the device)" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pth"]  # no .tmp left
    assert torch.load(tmp_path / "checkpoints" / "last.pth", weights_only=True)["model"]["w"].tolist() == [0, 1, 2, 3]
    assert ck.saved["last.pth"] == 1


# --------------------------------------------------------------------------- non-finite guard


def test_guard_names_a_finite_checkpoint_from_before_the_failing_steps(tmp_path, caplog):
    module = Params()
    ck = make_checkpointer(tmp_path, module)
    hooks = [NonFiniteGuard(3, ck), PeriodicCheckpointer(ck, period=1)]
    state = LoopState(max_iter=100)
    nan = result(float("nan"), 1.0, float("nan"))
    run_steps(hooks, state, [result(1.0, 1.0)] * 2 + [nan] * 2 + [result(1.0, 1.0)] * 3)  # the run recovers
    assert ck.saved["last.pth"] == 7 and "iter_0000003.pth" not in ck.saved  # no save of a skipped step
    with pytest.raises(NonFiniteLossError) as e, caplog.at_level(logging.WARNING, logger="detector.engine"):
        run_steps(hooks, state, [nan] * 3)
    msg = str(e.value)
    assert "\n" not in msg and "3 non-finite losses in a row" in msg and "at iteration 10" in msg
    # Steps 8-10 failed; resuming from 7 would repeat step 8's forward pass: iteration 6 is named.
    assert f"before the failing steps: {tmp_path / 'checkpoints' / 'iter_0000006.pth'} (iteration 6)" in msg
    assert "step skipped (2 in a row)" in caplog.text


def test_guard_never_names_a_poisoned_state(tmp_path):
    module = Params()
    ck = make_checkpointer(tmp_path, module)
    hooks = [NonFiniteGuard(2, ck), PeriodicCheckpointer(ck, period=1)]
    state = LoopState(max_iter=100)
    run_steps(hooks, state, [result(1.0, 1.0)] * 3)
    with torch.no_grad():
        module.w.fill_(float("nan"))  # step 4 was finite but left NaN weights: not saved
    run_steps(hooks, state, [result(1.0, 1.0)])
    assert ck.saved["last.pth"] == 3
    with pytest.raises(NonFiniteLossError, match=r"before the failing steps: .*last.pth \(iteration 3\)"):
        run_steps(hooks, state, [result(float("nan"), 1.0)] * 2)
    named = torch.load(tmp_path / "checkpoints" / "last.pth", weights_only=True)
    assert torch.isfinite(named["model"]["w"]).all()


def test_guard_saves_the_untouched_state_when_no_checkpoint_exists(tmp_path):
    ck = make_checkpointer(tmp_path, Params())
    state = LoopState(max_iter=100)
    with pytest.raises(NonFiniteLossError, match="weights before the failing steps are saved in .*last.pth \\(iteration 2\\)"):
        run_steps([NonFiniteGuard(2, ck)], state, [result(float("inf"), 1.0)] * 2)
    assert ck.saved == {"last.pth": 2}


def test_guard_stops_a_run_whose_every_step_was_skipped(tmp_path):
    """Fewer skipped steps than the limit, but all of them: the run trained nothing and
    must not end as finished (a short run, or a resumed one near max_iter)."""
    nan = result(float("nan"), 1.0, float("nan"))
    ck = make_checkpointer(tmp_path / "a", Params())
    with pytest.raises(NonFiniteLossError) as e:
        run_steps([NonFiniteGuard(5, ck)], LoopState(max_iter=3), [nan] * 3)
    assert "all 3 steps of this run had a non-finite loss" in str(e.value) and "\n" not in str(e.value)
    resumed = LoopState(max_iter=12, iteration=10, start_iter=10)
    with pytest.raises(NonFiniteLossError, match="all 2 steps of this run .* at iteration 12"):
        run_steps([NonFiniteGuard(5, make_checkpointer(tmp_path / "b", Params()))], resumed, [nan] * 2)
    # Controls: one finite step trained something; a run not at its end goes on.
    run_steps([NonFiniteGuard(5, make_checkpointer(tmp_path / "c", Params()))], LoopState(max_iter=3),
              [result(1.0, 1.0), nan, nan])
    run_steps([NonFiniteGuard(5, make_checkpointer(tmp_path / "d", Params()))], LoopState(max_iter=4), [nan] * 3)


# --------------------------------------------------------------------------- evaluation


def test_failing_evaluation_is_one_line_and_costs_no_checkpoint(tmp_path, caplog):
    ck = make_checkpointer(tmp_path, Params())
    calls = []

    def evaluate(iteration):
        calls.append(iteration)
        raise FileNotFoundError(f"image not found: /data/val/{iteration}.jpg\nsecond line")

    writers = EventWriters(jsonl=JSONLWriter(tmp_path / "metrics.jsonl"))
    ev = EvalHook(evaluate, ck, period=2, best_metric="AP", writers=writers,
                  eval_command="python tools/eval.py --config run/config.yaml --weights {weights}")
    hooks = [PeriodicCheckpointer(ck, period=2), ev]
    state = LoopState(max_iter=3)
    with caplog.at_level(logging.ERROR, logger="detector.engine"):
        run_steps(hooks, state, [result(1.0, 1.0)] * 3)  # periodic evaluation at 2 fails: training goes on
    assert calls == [2] and state.iteration == 3
    last = tmp_path / "checkpoints" / "last.pth"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"evaluation at iteration 2 failed (FileNotFoundError: image not found: /data/val/2.jpg); "
                      f"no checkpoint is lost: evaluate later with: "
                      f"python tools/eval.py --config run/config.yaml --weights {last}"]
    state.status = "finished"
    with pytest.raises(EvaluationError) as e:
        for h in hooks:
            h.after_train(state)
    msg = str(e.value)
    assert "\n" not in msg and "evaluation at iteration 3 failed" in msg and str(last) in msg
    assert torch.load(last, weights_only=True) is not None and ck.saved["last.pth"] == 3  # written before
    assert not (tmp_path / "metrics.jsonl").exists()  # no eval record from a failed evaluation


def test_best_checkpoint_follows_the_best_metric(tmp_path):
    module = Params()
    ck = make_checkpointer(tmp_path, module)
    values = iter([0.1, 0.3, 0.2])

    def evaluate(iteration):
        with torch.no_grad():
            module.w.fill_(iteration)
        return {"AP": next(values), "AP50": 0.5}

    writers = EventWriters(jsonl=JSONLWriter(tmp_path / "metrics.jsonl"))
    ev = EvalHook(evaluate, ck, period=1, best_metric="AP", writers=writers)
    state = LoopState(max_iter=4)
    run_steps([ev], state, [result(1.0, 1.0)] * 3)
    best = torch.load(tmp_path / "checkpoints" / "best.pth", weights_only=True)
    assert best["model"]["w"].tolist() == [2.0] * 4 and ev.best_value == 0.3
    assert [(r["iteration"], r["AP"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 0.1), (2, 0.3), (3, 0.2)]
    assert ev.last_metrics == {"AP": 0.2, "AP50": 0.5}


def test_no_evaluation_when_stopping_or_disabled(tmp_path):
    ck = make_checkpointer(tmp_path, Params())
    calls = []
    ev = EvalHook(lambda it: calls.append(it) or {}, ck, period=1, best_metric="AP", writers=EventWriters())
    state = LoopState(max_iter=5)
    run_steps([ev], state, [result(1.0, 1.0, stop=True)])
    state.status = "interrupted"
    ev.after_train(state)
    off = EvalHook(lambda it: calls.append(it) or {}, ck, period=-1, best_metric="AP", writers=EventWriters())
    state = LoopState(max_iter=1, iteration=1, status="finished")
    off.after_train(state)
    assert calls == []


# --------------------------------------------------------------------------- signals


def test_signal_hook_requests_a_stop_and_restores_handlers():
    previous = signal.getsignal(signal.SIGTERM)
    hook = SignalHook()
    state = LoopState(max_iter=10)
    hook.before_train(state)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert state.stop_requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second signal: stop at once
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        hook.after_train(state)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_signal_after_the_loop_ended_acts_at_once(caplog):
    """A SIGTERM during the final evaluation (the loop has ended, status finished) was
    logged as 'stopping after this iteration' and the evaluation ran on to exit 0: it
    goes to the handler in place before training (a tool's: error, status 143)."""
    class Stopped(BaseException):
        pass

    def before(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, before)
    # Ctrl-C's handler, as in a terminal (a test run started in the background inherits an ignored SIGINT)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    hook = SignalHook()
    state = LoopState(max_iter=10)
    try:
        hook.before_train(state)
        state.status = "finished"
        with pytest.raises(Stopped), caplog.at_level(logging.WARNING, logger="detector"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert state.stop_requested is None and "received SIGTERM" not in caplog.text
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        hook.after_train(state)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_a_sigterm_while_the_run_ends_after_an_error_changes_nothing(caplog):
    """A SIGTERM while the hooks end a failed run (torchrun's, to the survivor of a lost
    rank, whose collective just failed) neither asks for a stop nor raises: the error
    goes on to the tool, which reports it. SIGINT (Ctrl-C) still interrupts."""
    hook = SignalHook()
    state = LoopState(max_iter=10)
    try:
        hook.before_train(state)
        state.status, state.error = "failed", "Connection closed by peer"
        with caplog.at_level(logging.DEBUG, logger="detector"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert state.stop_requested is None and "received SIGTERM while ending after an error" in caplog.text
        assert "checkpoint" not in caplog.text
        state.stop_requested = "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        hook.after_train(state)


def test_signal_hook_does_nothing_in_a_forked_worker(caplog):
    """A data-loader worker forked after the handlers were installed gets the terminal's
    Ctrl-C too: it neither logs nor stops (the main process logs the signal once)."""
    hook = SignalHook()
    state = LoopState(max_iter=10)
    hook.before_train(state)
    try:
        pid = os.fork()
        if pid == 0:  # the worker
            records = []
            logging.getLogger("detector").addHandler(logging.Handler())
            logging.getLogger("detector").handlers[-1].emit = records.append
            try:
                os.kill(os.getpid(), signal.SIGINT)
                code = 0 if state.stop_requested is None and not records else 1
            except BaseException:
                code = 2
            os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert state.stop_requested is None
        with caplog.at_level(logging.WARNING, logger="detector"):
            os.kill(os.getpid(), signal.SIGINT)  # the main process: logged once
        assert state.stop_requested == "SIGINT" and caplog.text.count("received SIGINT") == 1
    finally:
        hook.after_train(state)


def _eval_hook_rank(rank: int, world_size: int, folder: str, failing_rank: int) -> None:
    """A spawned rank: its evaluation fails on ``failing_rank`` only; every rank must
    return that failure (and none waits in ``_keep_best``'s collective)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ck = make_checkpointer(os.path.join(folder, f"r{rank}"), Params())

        def evaluate(iteration):
            if rank == failing_rank:
                raise RuntimeError(f"scoring failed on rank {rank}")
            return {"AP": 0.5} if rank == 0 else {}

        ev = EvalHook(evaluate, ck, period=1, best_metric="AP", writers=EventWriters(),
                      is_main=rank == 0, world_size=world_size)
        error = ev.run(3)
        with open(os.path.join(folder, f"result{rank}.txt"), "w") as f:
            f.write(str(error))
        dist.barrier()  # neither rank tears the group down while its peer still uses it
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_evaluation_failing_on_one_rank_fails_on_every_rank(tmp_path, failing_rank):
    import torch.multiprocessing as mp

    mp.spawn(_eval_hook_rank, args=(2, str(tmp_path), failing_rank), nprocs=2, join=True)
    results = [(tmp_path / f"result{r}.txt").read_text() for r in range(2)]
    assert results[0] == results[1] and f"scoring failed on rank {failing_rank}" in results[0], results
    assert not (tmp_path / "r0" / "checkpoints" / "best.pth").exists()


def test_log_lines_are_wrapped_at_a_readable_width(tmp_path, capsys):
    """Console and log.txt lines are at most LOG_WIDTH characters; no word is lost."""
    words = [f"metric_{i} {i / 7:.4f}" for i in range(40)]
    setup_logging(tmp_path, 0)
    logging.getLogger("detector.test").info("  ".join(words))
    for text in (capsys.readouterr().out, (tmp_path / "log.txt").read_text()):
        lines = text.rstrip("\n").splitlines()
        assert len(lines) > 1 and all(len(line) <= LOG_WIDTH for line in lines), lines
        assert all(line.startswith("    ") for line in lines[1:])
        assert " ".join(text.split()).endswith(" ".join(" ".join(words).split()))


def test_metrics_file_keeps_its_records_up_to_the_resumed_iteration(tmp_path):
    """On a resume, metrics.jsonl keeps the records up to the checkpoint's iteration and
    drops the rest, and any line that is no record: cut by a crash, bytes that are no text
    (garbage left by a power loss), JSON that is no object or whose iteration is no number."""
    path = tmp_path / "metrics.jsonl"
    good = [{"iteration": i, "loss": 0.5} for i in (1, 2, 3)]
    lines = [json.dumps(good[0]).encode(), b'{"iteration": 2, "lo', json.dumps(good[1]).encode(), b"\xff\xfe\x00garbage",
             b"[1, 2]", b"7", b'{"iteration": "2"}', json.dumps({"type": "eval", "AP": 0.1}).encode(),
             json.dumps(good[2]).encode(), b"\x00" * 40]
    path.write_bytes(b"\n".join(lines) + b"\n")
    writer = JSONLWriter(path)
    assert writer.truncate_after(2) == 7
    assert read_jsonl(path) == [good[0], good[1], {"type": "eval", "AP": 0.1}]
    assert writer.truncate_after(2) == 0  # what is left is all records


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail: disk full)")
def test_a_full_disk_under_the_logs_is_one_line_naming_the_file(capsys):
    """metrics.jsonl: an OSError naming no file ('[Errno 28] No space left on device'),
    log.txt: logging's '--- Logging error ---' traceback for every record."""
    from detector.engine.log import LogFileHandler
    from detector.files import OutputError

    with pytest.raises(OutputError) as e:
        JSONLWriter("/dev/full").write({"iteration": 1})
    assert str(e.value) == "cannot write /dev/full: no space left on the device"
    log = logging.getLogger("detector.test_full_disk")
    handler = LogFileHandler("/dev/full")
    log.addHandler(handler)
    try:
        for i in range(3):
            log.warning("record %d", i)
    finally:
        log.removeHandler(handler)
        handler.close()
    err = capsys.readouterr().err
    assert err == ("warning: cannot write /dev/full: no space left on the device; the log goes on on the console "
                   "only\n"), err


def device_flagged(a: float, b: float, grad_norm: float, skipped: bool, nonfinite: bool) -> StepResult:
    """A step as ``train.cuda_graphs`` returns it: flags on the device, host flags False."""
    return StepResult(torch.tensor([a + b, a, b]), NAMES, torch.tensor(grad_norm), False, False, False,
                      skip_flag=torch.tensor(float(skipped)), nonfinite_flag=torch.tensor(float(nonfinite)))


def test_device_flags_mean_what_the_host_flags_mean(tmp_path):
    """A float16 overflow (skipped, not non-finite: finite losses, no finite norm) and a
    NaN loss, flagged on the device, give the record the same steps give with host
    flags: the overflow's losses count, its gradient norm does not, only the NaN is
    counted."""
    steps = [(1.0, 2.0, 4.0, False, False), (3.0, 4.0, float("inf"), True, False),
             (float("nan"), 1.0, float("nan"), True, True)]
    host = [StepResult(torch.tensor([a + b, a, b]), NAMES, torch.tensor(g), s, n, False) for a, b, g, s, n in steps]
    records = []
    for name, results in (("host", host), ("device", [device_flagged(*s) for s in steps])):
        opt = torch.optim.SGD([{"params": [Params().w], "lr": 0.1, "name": "default"}])
        hook = MetricsWriter(3, opt, EventWriters(jsonl=JSONLWriter(tmp_path / f"{name}.jsonl")), torch.device("cpu"))
        state = LoopState(max_iter=3)
        hook.before_train(state)
        run_steps([hook], state, results)
        records.append({k: v for k, v in read_jsonl(tmp_path / f"{name}.jsonl")[0].items()
                        if k in ("total_loss", "loss_a", "loss_b", "grad_norm", "nonfinite_skipped")})
    assert records[0] == records[1] == {"total_loss": 5.0, "loss_a": 2.0, "loss_b": 3.0, "grad_norm": 4.0,
                                        "nonfinite_skipped": 1}


def test_device_flagged_overflows_do_not_stop_training(tmp_path):
    """``train.max_nonfinite_steps`` counts non-finite steps, not float16 overflows (the
    scale's calibration skips several steps in a row at the start of a run)."""
    model = Params()
    ck = make_checkpointer(tmp_path, model)
    state = LoopState(max_iter=10)
    run_steps([NonFiniteGuard(2, ck)], state, [device_flagged(1.0, 1.0, float("inf"), True, False)] * 4)
    with pytest.raises(NonFiniteLossError):
        run_steps([NonFiniteGuard(2, ck)], state, [device_flagged(float("nan"), 1.0, 1.0, True, True)] * 2)
