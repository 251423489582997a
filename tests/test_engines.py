"""plumbing/engines.py's Sampler protocol is the one statement of the rollout engines' contract: every engine's
sample() takes its parameters (same names, kinds and defaults; an engine may add its own after them) and every
engine has the sleep / wake_up / load_weights cycle and the `generator` training.reseed seeds."""

import inspect

import pytest

from plumbing import engines
from plumbing.hf_engine import HFSampler
from plumbing.vllm_engine import VLLMSampler


def contract_parameters() -> list[inspect.Parameter]:
    return list(inspect.signature(engines.Sampler.sample).parameters.values())


@pytest.mark.parametrize("engine", [HFSampler, VLLMSampler], ids=lambda c: c.__name__)
def test_every_engine_takes_the_contract_of_sample(engine):
    contract = contract_parameters()
    taken = list(inspect.signature(engine.sample).parameters.values())
    assert [(p.name, p.kind, p.default) for p in taken[: len(contract)]] == [
        (p.name, p.kind, p.default) for p in contract
    ]
    assert all(p.default is not inspect.Parameter.empty for p in taken[len(contract) :])  # additions are optional
    for method in ("sleep", "wake_up", "load_weights"):
        assert callable(getattr(engine, method, None)), f"{engine.__name__} lacks {method}"


def test_every_engine_has_the_generator_reseed_sets(tiny_model_dir):
    from plumbing import models, training

    model, tokenizer = models.load_model(str(tiny_model_dir))
    sampler = HFSampler(model, tokenizer, seed=0)
    training.reseed(3, 1, sampler)
    first = sampler.sample([[1, 2, 3]], 2, temperature=1.0, top_p=1.0, max_new_tokens=4)
    training.reseed(3, 1, sampler)
    assert [c.ids for c in sampler.sample([[1, 2, 3]], 2, temperature=1.0, top_p=1.0, max_new_tokens=4)[0]] == [
        c.ids for c in first[0]
    ]
    assert "self.generator = " in inspect.getsource(VLLMSampler.__init__)  # the fake-engine tests run it
