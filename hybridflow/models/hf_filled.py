"""A transformers model built to hold weights we already have (for `save_pretrained`), without the
random initialisation `from_config` runs (1.2-1.6 s of each export of the 135M policy on the CPU,
growing with the model), since every weight is overwritten right after."""

from __future__ import annotations

import torch


def _no_random_init():
    """transformers' own switch for building a model whose weights are loaded next (5.x keeps it in
    `initialization`, 4.x in `modeling_utils`)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def filled_hf_model(auto_class, config, state: dict[str, torch.Tensor]):
    """`auto_class.from_config(config)` holding `state` (dtype of its tensors). A parameter that
    `state` does not name must be tied to one it does (a tied LM head): anything else would be left
    as uninitialised memory, so it stops here."""
    with _no_random_init():
        model = auto_class.from_config(config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    held = model.state_dict()
    loaded = {t.data_ptr() for name, t in held.items() if name in state}
    unfilled = [k for k in missing if held[k].data_ptr() not in loaded]
    if unfilled or unexpected:
        raise ValueError(
            f"{type(model).__name__} from these weights: not in them {unfilled[:5]}, not in the model {unexpected[:5]}"
        )
    return model
