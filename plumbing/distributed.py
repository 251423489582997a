"""Many processes: `torchrun --nproc_per_node N script.py ...` starts N copies of a script, one per GPU (or N CPU
processes over gloo). Each rank samples and grades its own share of an iteration's questions; whatever the
definitions take over the iteration batch (whitening, the loss's token and sequence counts, the SPO-tree buffer)
is summed or gathered over ranks by these helpers, so N ranks make the update one process would make from the
union of their samples. Plain `python script.py` is world size 1: no process group, and every helper below is
the identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from plumbing import UsageError, shown


def init_distributed(args=None) -> str:
    """Join torchrun's process group when it started this process (WORLD_SIZE > 1); returns the device to train on
    ("cuda" is then this rank's own GPU, LOCAL_RANK). Before joining, torchrun's variables are checked (launch_problem:
    a shell left from another launch would wait for ranks that never come); after, every rank's settings (`args`, a
    script's Args) are compared with rank 0's (settings_difference). Collectives time out after
    --collective-timeout-minutes, so a mismatch that slips through ends with an error, not never."""
    if (problem := launch_problem(os.environ)) is not None:
        raise UsageError(problem)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        minutes = getattr(args, "collective_timeout_minutes", 30.0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=minutes))
    if args is not None and world_size() > 1:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, dataclasses.asdict(args))
        if (difference := settings_difference(everyone)) is not None:
            raise UsageError(difference)
    return "cuda" if torch.cuda.is_available() else "cpu"


def launch_problem(env) -> str | None:
    """What is wrong with torchrun's variables in `env` (os.environ), or None: WORLD_SIZE must be a positive integer;
    above 1 the process must have been started by torchrun (TORCHELASTIC_RUN_ID), with RANK below WORLD_SIZE and
    MASTER_ADDR and MASTER_PORT set."""
    unset = (
        "unset WORLD_SIZE RANK LOCAL_RANK MASTER_ADDR MASTER_PORT (left from another launch), or launch with torchrun"
    )
    world = env.get("WORLD_SIZE")
    if world is None:
        return None
    if not world.isdigit() or int(world) < 1:
        return f"WORLD_SIZE={world!r} is not a positive integer: {unset}"
    if int(world) == 1:
        return None
    if "TORCHELASTIC_RUN_ID" not in env:
        return (
            f"WORLD_SIZE={world} is set, but this process was not started by torchrun (no TORCHELASTIC_RUN_ID): {unset}"
        )
    rank, missing = env.get("RANK", ""), [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        return f"WORLD_SIZE={world} without {' and '.join(missing)}: {unset}"
    if not rank.isdigit() or int(rank) >= int(world):
        return f"RANK={rank} is not below WORLD_SIZE={world}: {unset}"
    return None


def settings_difference(per_rank: list[dict]) -> str | None:
    """The settings in which ranks differ from rank 0 (each rank's settings as a dict, in rank order), in one line, or
    None when every rank has rank 0's.

    >>> settings_difference([{"lr": 1e-6, "seed": 1}, {"lr": 1e-3, "seed": 1}]).split(": ", 1)[1]
    '--lr on rank 1 (rank 0 has 1e-06); every rank must run the same command line'
    """
    first, differing = per_rank[0], {}
    for rank_index, values in enumerate(per_rank[1:], 1):
        for name in first:
            if values.get(name) != first[name]:
                differing.setdefault(name, []).append(rank_index)
    if not differing:
        return None
    named = ", ".join(
        f"--{name.replace('_', '-')} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"(rank 0 has {first[name]!r})"
        for name, ranks in differing.items()
    )
    return f"the processes were given different settings: {named}; every rank must run the same command line"


# What gloo and NCCL say when a peer process died (its sockets closed) or stopped answering (a collective timed out).
PEER_FAILURE_TEXT = ("connection reset by peer", "connection closed by peer", "timed out", "broken pipe", "watchdog")


def peer_failure(error: BaseException) -> str | None:
    """The first line of what a collective raised because another rank died or hung (torch's DistError, or gloo's
    RuntimeError that names a closed connection or a timeout), without gloo's source location; None for any other
    error, or in a single-process run."""
    if not dist.is_initialized():
        return None
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if not isinstance(error, getattr(dist, "DistError", ())) and not (
        isinstance(error, RuntimeError) and any(phrase in text.lower() for phrase in PEER_FAILURE_TEXT)
    ):
        return None
    # "[/path/gloo/transport/tcp/pair.cc:537] Read error ...": the location says nothing to a user
    # "[/path/gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer. This is typically ...": the
    # location and the advice after the first sentence say nothing to a user of this script
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ", 1)[0]


def resume_command(script: str, run_dir: Path, world: int, env=os.environ) -> str:
    """The command that continues `run_dir` with the world size it was started with: python for one process,
    torchrun with the same processes per node (and node count) for more."""
    if world == 1:
        return f"python {script} --resume {run_dir}"
    local = env.get("LOCAL_WORLD_SIZE", "")
    per_node = int(local) if local.isdigit() and 0 < int(local) < world else world
    nodes = f"--nnodes {world // per_node} (and this launch's rendezvous flags) " if per_node < world else ""
    return f"torchrun {nodes}--nproc-per-node {per_node} {script} --resume {run_dir}"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _collective_device() -> torch.device:
    """Where a collective's tensors must live: the rank's GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_seed(seed: int) -> int:
    """`seed` made this rank's own: rank 0 keeps it (a single-process run's), rank r adds r times an odd 32-bit
    constant. The ranks must differ in the low 32 bits: torch's CPU generator (mt19937) reads only those, so seeds
    that differ above them (seed + (rank << 32)) give every rank the same stream."""
    return seed + rank() * 0x9E3779B1


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over ranks, as a new tensor on values' device (world size 1: values itself)."""
    if world_size() == 1:
        return values
    total = values.detach().to(_collective_device(), copy=True)
    dist.all_reduce(total)
    return total.to(values.device)


def sum_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """A dict of numbers, each summed over ranks (one collective)."""
    if world_size() == 1:
        return stats
    keys = sorted(stats)
    total = all_sum(torch.tensor([float(stats[key]) for key in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


def gather(items):
    """Every rank's list (or tensor, concatenated along dim 0), in rank order, on every rank."""
    if world_size() == 1:
        return items
    parts = [None] * world_size()
    dist.all_gather_object(parts, items)
    if isinstance(items, torch.Tensor):
        return torch.cat([part.to(items.device) for part in parts])
    return [item for part in parts for item in part]


def shard(items: list) -> list:
    """This rank's contiguous share of `items` (sizes differ by at most one): the shards of ranks 0..N-1,
    concatenated, are `items` again, which is how gather() puts results back in order."""
    n, r, w = len(items), rank(), world_size()
    return items[r * n // w : (r + 1) * n // w]


def broadcast(value):
    """Rank 0's `value` (any picklable object) on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(line: str, write=print) -> None:
    """Print one line on rank 0 only (under torchrun every rank runs the same lines), its control characters escaped
    (plumbing.shown: a path or name it quotes may come from a received run directory)."""
    if rank() == 0:
        write(shown(line))


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def world_size_problems(args, per_rank: dict[str, int]) -> list[str]:
    """Under torchrun: settings that must split evenly over the ranks (so every rank takes the same number of
    optimizer steps). At world size 1: --fsdp (nothing to shard over)."""
    world = world_size()
    if world == 1:
        return (
            ["--fsdp shards the model over processes: launch with torchrun --nproc_per_node N (N >= 2), or drop --fsdp"]
            if getattr(args, "fsdp", False)
            else []
        )
    return [
        f"{flag} ({value}) must be a multiple of the number of processes ({world}) under torchrun"
        for flag, value in per_rank.items()
        if value % world
    ]


def check_world_size(checkpoint: Path, saved: int) -> None:
    """Refuse to resume a checkpoint trained by `saved` processes at another world size: each rank's questions and
    random streams depend on it, so the run would not continue as it started."""
    if saved != world_size():
        launch = (
            "python SCRIPT.py"
            if saved == 1
            else f"torchrun --nproc_per_node {saved} SCRIPT.py (or that many processes over nodes)"
        )
        raise UsageError(
            f"--resume: {checkpoint} was trained by {saved} process(es), this is {world_size()}; the split of "
            f"questions and the random streams per rank depend on it, so resume with {launch}, or start a new run"
        )


def all_reduce_gradients(*models: torch.nn.Module) -> None:
    """Sum every parameter's gradient over ranks, once per optimizer step (what DDP does; the scripts call the
    base model and the LM head separately, which DDP's wrapper would not see). Each rank's loss is already
    divided by the whole batch's counts, so the sum is the gradient of the whole batch. Parameters sharded by
    fully_shard_model are left alone: FSDP has already summed their gradients in the backward pass."""
    if world_size() == 1:
        return
    from torch.distributed.tensor import DTensor

    replicated = [p for model in models for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    for p in replicated:
        if p.grad is None:  # a rank without samples in this step adds zeros
            p.grad = torch.zeros_like(p)
    works = [dist.all_reduce(p.grad, async_op=True) for p in replicated]
    for work in works:
        work.wait()


# FSDP2 (--fsdp): the parameters, their gradients and so AdamW's state are split over the ranks (each holds 1/N),
# for models whose replica does not fit one GPU. Each transformer block is one unit, gathered for its own forward
# and backward; the rest (embeddings, final norm, LM head, a critic's value head) is the root unit, gathered for
# the whole forward and backward. The root must be called as a whole: plumbing.training's response_logprobs then takes
# the last hidden state from the root's forward (is_sharded) instead of calling model.base_model. Sampling and
# the no-grad log-prob passes call the model a different number of times on each rank, so the sampler (HF or vLLM)
# gathers the whole model once while it is awake (gather_parameters) and releases it when it sleeps (for the update).


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether fully_shard_model sharded `model` (its forward must then be called on the whole model)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fully_shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` (a causal LM or a critic around a transformer) over all ranks with FSDP2's fully_shard, in
    place: one unit per transformer block (the model's _no_split_modules), the rest in the root. Gradients are
    summed over ranks, not averaged, as all_reduce_gradients sums them. Create the optimizer after this, from the
    shards (on_shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(_collective_device().type, (world_size(),))
    blocks = {name for m in model.modules() if isinstance(m, PreTrainedModel) for name in (m._no_split_modules or [])}
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss already divides by the global counts
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no pre-multiplied sum)
    # FSDP picks its root at the first forward; the sampler calls the base model first, so pick it now.
    model._get_fsdp_state()._lazy_init()
    # Its warning that an in-place op on a returned view would skip a gather: no caller here writes into an output.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def gather_parameters(model: torch.nn.Module, gathered: bool) -> None:
    """gathered=True: every rank holds the whole parameters of a sharded model (all-gathered once) and keeps them
    through forwards, so sampling and no-grad passes run no collectives; False: back to the shards, each unit
    gathered only for its own forward and backward (the root stays gathered from its forward to its backward,
    where the LM head is applied in chunks). A model that is not sharded is left alone."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        if gathered:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        else:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)
    model.gathered_by_spo = gathered and bool(units)


@contextlib.contextmanager
def on_shards(model: torch.nn.Module):
    """The model on its shards for the `with` block, then gathered again if it was (the awake sampler's). While a
    model is gathered, FSDP registers whole tensors as its parameters in place of the sharded DTensors: an
    optimizer must be made from the shards (the update's gradients reach those; one made from the whole tensors
    never changes the model), and its state is read and written against them. A model that is not sharded is left
    alone.

        with distributed.on_shards(model):
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    """
    gathered = getattr(model, "gathered_by_spo", False)
    if gathered:
        gather_parameters(model, False)
    try:
        yield model
    finally:
        if gathered:
            gather_parameters(model, True)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's state dict, on the CPU, for saving: gathered from the shards (a collective: every rank
    calls it; rank 0 receives it, the others an empty dict) when sharded, else model.state_dict()."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with on_shards(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict for a checkpoint: optimizer.state_dict(), or for a sharded model the whole state
    gathered to rank 0 (a collective; keyed by parameter name), which load_optimizer_state puts back."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    with on_shards(model):  # the optimizer's parameters are found among the model's by identity
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore what optimizer_state saved (every rank reads the same checkpoint and keeps its own shard)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    with on_shards(model):
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
