"""plumbing.models' frozen reference model: resident on the training device (--reference-on-device True) or parked in
pinned CPU memory and copied in for its passes (False); the same log-probs either way, and a parked reference's
visit copies nothing back."""

import pytest
import torch

from plumbing import models, training


def test_resident_and_parked_references_give_the_same_log_probs(tiny_model_dir):
    samples = [
        {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23]},
    ]
    logps = {}
    for on_device in (True, False):
        _, _, reference = models.load_policy(str(tiny_model_dir), None, "cpu", 1e-4, reference_on_device=on_device)
        assert not any(p.requires_grad for p in reference.parameters())
        with models.on_device(reference):
            logps[on_device] = training.sample_logprobs(reference, samples, 8, 0.7, 0)
    assert all(torch.equal(a, b) for a, b in zip(logps[True], logps[False]))
    assert models.load_policy(str(tiny_model_dir), None, "cpu", 0.0, reference_on_device=False)[2] is None  # --beta 0


def test_a_parked_reference_visits_the_device_and_keeps_its_cpu_tensors(tiny_model_dir, monkeypatch):
    reference, _ = models.load_model(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    pinned, copies = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: pinning recorded, not performed
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned.append(tensor.shape) or tensor.clone())
    models.park(reference, "cuda")
    tensors = [*reference.parameters(), *reference.buffers()]
    assert len(pinned) == len(tensors) > 0  # every parameter and buffer, once, at load
    host = [t.data_ptr() for t in tensors]  # where each tensor's data lives (t.data is a new alias at each call)
    # the copies to the device: recorded, and made on the CPU
    monkeypatch.setattr(
        torch.Tensor, "to", lambda tensor, *args, **kwargs: copies.append((args, kwargs)) or tensor.clone()
    )
    with models.on_device(reference):
        assert all(t.data_ptr() != pointer for t, pointer in zip(tensors, host))
    assert copies == [((torch.device("cuda"),), {"non_blocking": True})] * len(tensors)  # in, asynchronously; none back
    assert [t.data_ptr() for t in tensors] == host  # the very CPU tensors again: the module holds no copy
    with pytest.raises(RuntimeError, match="inside"), models.on_device(reference):
        raise RuntimeError("inside")  # a failing pass leaves the reference on the CPU too
    assert [t.data_ptr() for t in tensors] == host
    assert len(pinned) == len(tensors)  # a visit pins nothing again


def test_on_a_cpu_a_parked_reference_moves_nothing(tiny_model_dir):
    _, _, reference = models.load_policy(str(tiny_model_dir), None, "cpu", 1e-4, reference_on_device=False)
    pointers = [t.data_ptr() for t in reference.parameters()]
    with models.on_device(reference):
        assert [t.data_ptr() for t in reference.parameters()] == pointers
