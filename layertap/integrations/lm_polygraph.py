"""lm-polygraph adapter: ``VLLMWithUncertainty`` with layertap as the hidden-state source.

lm-polygraph (PyPI ``lm-polygraph``, 0.7) wraps a vLLM ``LLM`` in ``VLLMWithUncertainty`` and gets hidden
states either from a *second* forward pass (speculators' ``VllmHiddenStatesGenerator``, the main engine put
to sleep meanwhile) or from forward hooks in a worker extension (``enforce_eager=True``; prefix-cache hits
filled from a text-keyed cache, short rows zero-padded). This adapter replaces both with ``Tap.generate``:
the states come from the pass that generated the tokens, in compiled mode, with prefix caching on, and each
sample's rows are proven by token digest.

    from layertap import Tap
    from layertap.integrations.lm_polygraph import LayertapVLLMWithUncertainty
    tap = Tap(model=PATH, layers=[2, 4], post_norm_last=False)
    model = LayertapVLLMWithUncertainty(tap, [VLLMLogprobsExtractionCalculator(), EntropyCalculator()],
                                        MeanTokenEntropy())
    res = model.generate(prompts, SamplingParams(max_tokens=32, n=2))
    res[i].uncertainty_scores; res[i].outputs[j].deps["vllm_hidden_states_output"]["hidden_states"]

Payload (what lm-polygraph's own capture produces, ``deps["vllm_hidden_states_output"]``):
``{"hidden_states": [tensor [P + G, hidden] per layer id, in tap.layers order], "layer_ids": tap.layers}``.
Rows follow layertap's alignment (``layertap.analysis``); the last sampled token never ran through the
model, so its row is zeros (lm-polygraph pads short captures the same way) unless ``pad_last_row=False``,
which gives the ``P + G - 1`` real rows. Layer ids are layertap's: id ``i`` is the residual stream entering
decoder layer ``i`` (= the output of ``model.layers[i - 1]``, hidden + residual).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from layertap.tap import Tap

INSTALL_HINT = ("the lm-polygraph adapter needs lm-polygraph: pip install lm-polygraph (it adds ~60 packages, "
                "spacy and datasets among them; a separate venv is wise)")

try:
    from lm_polygraph.utils.vllm_with_uncertainty import VLLMWithUncertainty as _Base
except ImportError as _e:  # optional extra: fail on use, with the hint
    _IMPORT_ERROR: ImportError | None = _e

    class _Base:  # type: ignore[no-redef]
        def __init__(self, *a: Any, **k: Any) -> None:
            raise ImportError(INSTALL_HINT) from _IMPORT_ERROR
else:
    _IMPORT_ERROR = None


def polygraph_payload(comp: Any, layer_ids: list[int], *, pad_last_row: bool = True) -> dict[str, Any]:
    """lm-polygraph's per-sample hidden-state payload from a ``Tap.generate`` ``CompletionOutput``."""
    hs = comp.hidden_states
    if pad_last_row:  # the last sampled token has no row (it never ran): zeros, as lm-polygraph pads
        hs = torch.cat([hs, hs.new_zeros((1, *hs.shape[1:]))], dim=0)
    return {"hidden_states": [hs[:, j].contiguous() for j in range(hs.shape[1])], "layer_ids": list(layer_ids)}


class LayertapVLLMWithUncertainty(_Base):
    """``VLLMWithUncertainty`` whose generation and hidden states come from a layertap ``Tap``."""

    def __init__(self, tap: "Tap", stat_calculators: list, estimator: Any, *, n_logprobs: int = 0,
                 prompt_logprobs: bool = False, pad_last_row: bool = True):
        # output_hidden_states=False here: the base would demand speculators or an eager hook extension.
        super().__init__(llm=tap.llm, stat_calculators=stat_calculators, estimator=estimator,
                         n_logprobs=n_logprobs, prompt_logprobs=prompt_logprobs, output_hidden_states=False)
        self.tap = tap
        self.output_hidden_states = True
        self.hs_layer_ids = list(tap.layers)
        self.pad_last_row = pad_last_row

    def _raw_generate(self, prompts: Any, sampling_params: Any = None):
        """The base's contract: (outputs, per-sample payloads, prompt lengths, prompt texts)."""
        from vllm import SamplingParams

        prompts_list = self._normalize_prompts(prompts)
        sp = (sampling_params or SamplingParams()).clone()
        sp.logprobs = max(sp.logprobs or 0, self.n_logprobs) or 20  # the base's fallback
        if self.prompt_logprobs:
            sp.prompt_logprobs = sp.logprobs
        outputs = self.tap.generate(prompts_list, sp)
        payloads = [[polygraph_payload(c, self.hs_layer_ids, pad_last_row=self.pad_last_row) for c in ro.outputs]
                    for ro in outputs]
        return outputs, payloads, [len(ro.prompt_token_ids) for ro in outputs], prompts_list
