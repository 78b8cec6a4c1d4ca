"""float16 compute with a dynamic loss scale (roles/loss_scale.py): gradients that float16 would
flush to zero train as in float32, an overflow is taken again at half the scale, and the scale's
rules by hand."""

import copy

import pytest
import torch

from hybridflow.batch import TrainingBatch, pad_ragged
from hybridflow.config.schema import ActorConfig
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.roles.actor import Actor
from hybridflow.roles.loss_scale import GROWTH_INTERVAL, INITIAL_SCALE, LossScale

BASE = from_hf_model(tiny_model("qwen2", seed=3))
PROMPTS = [[5, 9, 200, 17], [44, 2, 7]]
RESPONSES = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34]]


def _update(compute_dtype: str, advantage: float, *, scaled: bool = True):
    """One Adam step (lr 1e-2, no weight decay) on two responses with advantages +a and -a; the
    weights' changes and the actor."""
    model = copy.deepcopy(BASE)
    cfg = ActorConfig(max_tokens_per_microbatch=24, compute_dtype=compute_dtype)
    cfg.optim.lr, cfg.optim.weight_decay = 1e-2, 0.0
    actor = Actor(model, cfg, total_steps=1, max_response_tokens=10, pad_token_id=0)
    if not scaled:  # what float16 did before the loss scale
        actor.loss_scale.enabled, actor.loss_scale.scale = False, 1.0
    mask = pad_ragged([[1.0] * 6, [1.0] * 4])
    actor.update(
        TrainingBatch(PROMPTS, RESPONSES, mask, advantages=torch.tensor([[advantage], [-advantage]]) * mask)
    )
    deltas = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), BASE.parameters())])
    return deltas, actor


def _agreement(deltas, reference) -> float:
    """The share of weights that moved the way float32's update moved them (Adam's first step is
    lr x the gradient's sign, so a flushed gradient does not move its weight)."""
    return ((deltas.sign() == reference.sign()) | (reference.abs() < 1e-6)).float().mean().item()


@pytest.mark.parametrize("advantage", [1e-4, 1e-6])
def test_small_gradients_train_as_in_float32(advantage):
    reference, _ = _update("float32", advantage)
    scaled, actor = _update("float16", advantage)
    assert actor.loss_scale.scale == INITIAL_SCALE
    assert _agreement(scaled, reference) > 0.999  # float16 rounding flips a few near-zero gradients
    flushed, _ = _update("float16", advantage, scaled=False)
    assert _agreement(flushed, reference) < 0.8  # without the scale most of these gradients are zero


def test_an_overflow_is_taken_again_at_half_the_scale():
    reference, _ = _update("float32", 1e3)
    deltas, actor = _update("float16", 1e3)  # 1e3 x 2^16 overflows float16's 65,504
    assert actor.loss_scale.scale < INITIAL_SCALE
    assert _agreement(deltas, reference) > 0.999  # the mini-batch was trained, not skipped


def test_the_scales_rules_by_hand():
    scale = LossScale("float16")
    assert scale.overflowed() and scale.scale == INITIAL_SCALE / 2
    for _ in range(GROWTH_INTERVAL):
        scale.stepped()
    assert scale.scale == INITIAL_SCALE and scale.good_updates == 0
    scale.scale = 1.0
    assert not scale.overflowed()  # at 1 a non-finite gradient is the model's: the step is skipped
    for dtype in ("bfloat16", "float32", "auto"):
        off = LossScale(dtype)
        assert not off.enabled and off.scale == 1.0 and not off.overflowed()
        loss = torch.tensor(3.0)
        assert off.scaled(loss) is loss
