"""``Trainer`` runs the loop with the pieces it is given: a hand-made model, loader,
step and hook (no config, no files), from the start and from a resumed position."""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

from detector.engine.step import TrainStep
from detector.engine.train_loop import HookBase, LoopState, Trainer


class Sampler:
    """The loader's batch sampler: records ``set_epoch`` / ``set_start``."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(("epoch", epoch))

    def set_start(self, start: int) -> None:
        self.calls.append(("start", start))
        self.start = start


class Loader:
    """``n`` batches an epoch; batch ``i`` is one image filled with ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.batch_sampler = Sampler()
        self.generator = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.batch_sampler.start, self.n):
            yield [torch.full((3, 2, 2), float(i))], [{"i": i}]


class Scale(nn.Module):
    """``loss = w * mean(image)``: the gradient of ``w`` is the batch's value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, images, targets):
        return {"loss": self.w * torch.stack([im.mean() for im in images]).sum()}


class Record(HookBase):
    def __init__(self) -> None:
        self.seen: List[tuple] = []

    def after_step(self, state: LoopState) -> None:
        self.seen.append((state.iteration, state.epoch, state.epoch_position))


def make(state: LoopState, hooks=None):
    """``(trainer, model, hook)``: plain SGD on ``Scale`` over ``Loader(2)``, with a
    ``Record`` hook or, given, ``hooks`` (then ``hook`` is None)."""
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0))
    hook = Record() if hooks is None else None
    return Trainer(model, Loader(2), step, [hook] if hooks is None else list(hooks), state, data_seed=7), model, hook


@pytest.mark.parametrize("start, values", [
    (LoopState(max_iter=5), [0, 1, 0, 1, 0]),
    (LoopState(max_iter=5, iteration=3, epoch=1, epoch_position=1), [1, 0]),
])
def test_loop_feeds_batches_in_order_across_epochs(start, values):
    first = (start.iteration, start.epoch, start.epoch_position)
    trainer, model, hook = make(start)
    result = trainer.train()
    assert (result.status, result.iteration) == ("finished", 5)
    # Plain SGD on w: each step subtracts lr * (the batch's value).
    assert model.w.item() == pytest.approx(1.0 - 0.1 * sum(values))
    assert [s[0] for s in hook.seen] == list(range(first[0] + 1, 6))
    assert hook.seen[-1][1:] == (2, 1)  # iteration 5: the first batch of epoch 2
    epochs = [c[1] for c in trainer.loader.batch_sampler.calls if c[0] == "epoch"]
    assert epochs == list(range(first[1], 3))
    assert trainer.loader.batch_sampler.calls[1] == ("start", first[2])


def test_empty_loader_is_one_line():
    trainer, _, _ = make(LoopState(max_iter=1))
    trainer.loader.n = 0
    with pytest.raises(ValueError, match="the training loader yields no batches") as e:
        trainer.train()
    assert "\n" not in str(e.value) and trainer.state.status == "failed"


def test_accumulation_feeds_whole_cycles_and_steps_on_their_mean():
    """accumulate_steps=2 over 5 batches an epoch: steps on (0, 1), (2, 3); batch 4 is not
    used; the next epoch starts over. The step's gradient is the mean of the cycle's."""
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0))
    hook = Record()
    trainer = Trainer(model, Loader(5), step, [hook], LoopState(max_iter=3), data_seed=7, accumulate_steps=2)
    result = trainer.train()
    assert (result.status, result.iteration) == ("finished", 3)
    assert hook.seen == [(1, 0, 2), (2, 0, 4), (3, 1, 2)]
    assert model.w.item() == pytest.approx(1.0 - 0.1 * (0.5 + 2.5 + 0.5))
    assert trainer.state.batch_images == 2


def test_fewer_batches_than_accumulation_steps_is_one_line():
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0))
    trainer = Trainer(model, Loader(2), step, [], LoopState(max_iter=1), accumulate_steps=3)
    with pytest.raises(ValueError, match="fewer than solver.accumulate_steps=3") as e:
        trainer.train()
    assert "\n" not in str(e.value)


class Ends(HookBase):
    """Records the statuses its ``after_train`` saw; ``fail``: raises at ``finished`` (as a
    failing final evaluation does)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.statuses = fail, []

    def after_train(self, state: LoopState) -> None:
        self.statuses.append(state.status)
        if self.fail and state.status == "finished":
            raise RuntimeError("final evaluation failed")


def test_a_hook_failing_at_the_end_fails_the_run_for_every_hook():
    """A failing final evaluation (an after_train that raises) was the one failure after
    which the other hooks never heard of it: no "stopped" record in metrics.jsonl, the
    signal handlers of the hooks after it left in place."""
    before, failing, after = Ends(), Ends(fail=True), Ends()
    trainer, _, _ = make(LoopState(max_iter=2), hooks=[before, failing, after])
    with pytest.raises(RuntimeError, match="final evaluation failed"):
        trainer.train()
    assert (trainer.state.status, trainer.state.error) == ("failed", "final evaluation failed")
    assert before.statuses == ["finished", "failed"]
    assert failing.statuses == ["finished", "failed"]
    assert after.statuses == ["failed"]
