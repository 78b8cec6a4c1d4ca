"""Scalar heads on our backbone: a value model for the critic (one score per token, like transformers'
*ForTokenClassification) and a reward model (the score at each sequence's last token, like
*ForSequenceClassification). Parameter names are transformers' (`model.*`, `score.*`), so both
checkpoint kinds load and save as-is."""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.hf_filled import filled_hf_model
from hybridflow.models.native.config import NativeConfig, from_hf
from hybridflow.models.native.model import Backbone, NativeModule


class NativeScoreModel(NativeModule):
    def __init__(self, config: NativeConfig, num_labels: int = 1, *, bias: bool) -> None:
        """bias=True matches *ForTokenClassification's head, bias=False *ForSequenceClassification's."""
        super().__init__()
        self.config = config
        self.num_labels = num_labels
        self.model = Backbone(config)
        self.score = nn.Linear(config.hidden_size, num_labels, bias=bias)

    def token_scores(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """Packed input ([N], [N], [B + 1]) -> one score per token [N, num_labels]."""
        return self.score(self.hidden_states(input_ids, position_ids, cu_seqlens))

    def scores_at(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed input -> the scores at packed `positions` [B] (default: each sequence's last token),
        [B, num_labels]. The head runs on those rows only."""
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens)  # [N, H]
        if positions is None:
            positions = cu_seqlens[1:].long().to(hidden.device) - 1
        return self.score(hidden.index_select(0, positions))

    def forward(self, input_ids, position_ids, cu_seqlens) -> torch.Tensor:
        return self.token_scores(input_ids, position_ids, cu_seqlens)


def score_model_from_hf(hf_model) -> NativeScoreModel:
    """Our copy of a transformers token- or sequence-classification model of a supported family."""
    state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    weight = state["score.weight"]
    model = _empty(from_hf(hf_model.config), weight.shape[0], "score.bias" in state, weight)
    model.load_state_dict(state, strict=True)
    return model.eval()


def value_model_from_causal_lm(policy: NativeModule) -> NativeScoreModel:
    """A value model whose backbone is a copy of the policy's and whose head starts at zero
    (initial values are 0); shaped like transformers' token classification (head with bias)."""
    weight = next(policy.parameters())
    model = _empty(policy.config, 1, True, weight)
    model.model.load_state_dict(policy.model.state_dict())
    nn.init.zeros_(model.score.weight)
    nn.init.zeros_(model.score.bias)
    return model


def to_hf_score_model(model: NativeScoreModel | dict[str, torch.Tensor], hf_config):
    """The transformers model (token classification when the head has a bias, else sequence
    classification) holding our weights, for `save_pretrained`: from our model or its state dict."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    state = model if isinstance(model, dict) else model.state_dict()
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    config.num_labels = state["score.weight"].shape[0]
    cls = AutoModelForTokenClassification if "score.bias" in state else AutoModelForSequenceClassification
    return filled_hf_model(cls, config, state)


def _empty(config: NativeConfig, num_labels: int, bias: bool, like: torch.Tensor) -> NativeScoreModel:
    with torch.device("meta"):
        model = NativeScoreModel(config, num_labels, bias=bias)
    return model.to_empty(device=like.device).to(like.dtype)
