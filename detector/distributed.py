"""Process-group set-up and small collective helpers.

Launch modes understood by ``init_distributed``:

- one plain process (``python tools/train.py``): world size 1, no process group;
- ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
- SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, with the
  master address taken from ``MASTER_ADDR`` or the first host of ``SLURM_NODELIST``.

Backend (``train.dist_backend``): ``auto`` is NCCL on CUDA and gloo on the CPU. NCCL
needs one GPU per rank: rank ``r`` of a node uses ``cuda:LOCAL_RANK``, and a launch with
more ranks per node than GPUs stops before any work with one line that says so. gloo on
CUDA lets ranks share GPUs (rank ``r`` uses ``cuda:(LOCAL_RANK mod GPU count)``), e.g. to
test DDP and SyncBatchNorm on one GPU. Every helper works (as the identity, or a no-op)
when no process group is initialised.

Faults: ``lost_rank_message`` turns the error a collective raises when a peer process
died into one line naming the lost rank. Under ``torchrun --max-restarts`` on one node,
the process group's store keys are kept apart per restart (``_restart_store``), so
restarted workers never read a dead worker's address.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from detector.config import AMPConfig, ConfigError
from detector.dist_faults import lost_rank_message, report_lost_rank, wake_stopped_peers, watch  # noqa: F401
from detector.messages import DetectorError

# lost_rank_message, report_lost_rank, wake_stopped_peers and watch live in detector.dist_faults; re-exported
# for the tools.


BACKENDS = ("auto", "nccl", "gloo")

# A rank that stops because another rank of its node has no GPU waits this long before
# exiting, so that the rank that reports the problem prints its line before the launcher
# (torchrun) stops the others.
QUIET_STOP_WAIT_S = 10.0


class LaunchError(DetectorError, RuntimeError):
    """The launch asks for something this machine cannot give (one-line message).

    ``report`` is False on the ranks that stop because another rank reports the problem:
    one line in all, printed by the rank that reports.
    """

    def __init__(self, message: str, report: bool = True) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    peers: Tuple[Tuple[str, int], ...] = ()  # (host name, process id) of each rank, when distributed
    backend: str = ""  # "nccl" / "gloo"; "" without a process group
    local_world_size: int = 1
    shared_gpus: int = 0  # >0: gloo ranks share this many GPUs (more local ranks than GPUs)
    timeout_s: float = 1800.0  # the process group's timeout (train.dist_timeout_s)

    def describe(self) -> str:
        """One line for the log: world size, backend, this rank's device, and how the
        ranks of a node map onto shared GPUs."""
        text = f"rank {self.rank} of {self.world_size} on {self.device}"
        if self.backend:
            text += f" (backend {self.backend})"
        if self.shared_gpus:
            text += (f"; {self.local_world_size} ranks per node share {self.shared_gpus} GPU(s): "
                     f"rank r uses cuda:(LOCAL_RANK mod {self.shared_gpus})")
        return text


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0].split("[")[0]


def resolve_backend(backend: str, device_type: str) -> str:
    """``train.dist_backend`` for a device type: ``auto`` -> ``nccl`` on CUDA, ``gloo`` otherwise.

    NCCL runs on CUDA only: asking for it with a CPU device is an error.
    """
    if backend not in BACKENDS:
        raise ValueError(f"config key 'train.dist_backend' is {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"train.dist_backend=nccl needs CUDA, but the device is {device_type}; "
                         "use train.dist_backend=gloo (or auto) on the CPU")
    return backend


def amp_dtype(amp: AMPConfig, device: torch.device | str) -> torch.dtype:
    """The autocast dtype of ``train.amp.dtype`` on ``device``: ``auto`` is bfloat16
    where the device supports it (``torch.cuda.is_bf16_supported()``; always on the CPU),
    else float16. Used by training (``detector.engine.amp.resolve_amp``) and by the
    evaluation's ``eval.amp``."""
    device = torch.device(device)
    if amp.dtype == "auto":
        bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu"
        return torch.bfloat16 if bf16 else torch.float16
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[amp.dtype]


def cuda_index_for_rank(local_rank: int, local_world_size: int, device_count: int, backend: str) -> int:
    """The CUDA device index of the rank with ``local_rank`` on a node with ``device_count``
    GPUs and ``local_world_size`` ranks (``--nproc_per_node``).

    - ``gloo``: ``local_rank mod device_count`` (ranks may share a GPU);
    - ``nccl``: ``local_rank``; with more ranks than GPUs every rank of the node raises
      ``LaunchError`` (only the first rank without a GPU with ``report=True``).
    """
    if device_count < 1:
        raise LaunchError("CUDA is available but no GPU is visible (CUDA_VISIBLE_DEVICES?)")
    if backend == "gloo":
        return local_rank % device_count
    local_world_size = max(local_world_size, local_rank + 1)
    if local_world_size > device_count:
        last = local_world_size - 1
        ranks = f"LOCAL_RANK {device_count}" + (f"..{last}" if last > device_count else "")
        raise LaunchError(
            f"{ranks} has no GPU: {device_count} GPU(s) seen but --nproc_per_node {local_world_size} asked for; "
            f"run at most {device_count} processes per node (--nproc_per_node {device_count}), "
            "or set train.dist_backend=gloo to let ranks share GPUs (for testing)",
            report=local_rank == device_count,
        )
    return local_rank


def available_devices() -> List[str]:
    """The devices this machine has, in ``train.device`` syntax: ``cpu``, then
    ``cuda:0`` ... and ``mps`` where present."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def check_device(name: str) -> torch.device:
    """``train.device`` (other than ``auto``) as a ``torch.device``, if this machine has it.

    Raises:
        ConfigError: one line naming ``train.device`` and the devices that exist (a
            device type torch does not know, ``cuda`` without CUDA, ``cuda:7`` on a
            machine with fewer GPUs).
    """
    have = available_devices()
    where = f"this machine has {', '.join(have)}; use one of them or 'auto'"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"config key 'train.device' is {name!r}, which is not a device: {where}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'train.device' is {name!r} but CUDA is not available: {where}")
    if device.type not in ("cpu", "cuda") and device.type not in have:
        raise ConfigError(f"config key 'train.device' is {name!r} but {where}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"config key 'train.device' is {name!r} but {where}")
    return device


def resolve_device(name: str, local_rank: int = 0, backend: str = "auto", local_world_size: int = 1) -> torch.device:
    """``auto`` -> CUDA when available, else ``cpu``. ``cuda`` (no index) becomes this
    rank's GPU (``cuda_index_for_rank``); an explicit ``cuda:N`` is kept.

    A device this machine lacks is a ``ConfigError`` (``check_device``), not a silent
    fallback. Nothing touches a GPU before the checks pass.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = check_device(name)
    if device.type == "cuda":
        if device.index is None:
            index = cuda_index_for_rank(local_rank, local_world_size, torch.cuda.device_count(),
                                        resolve_backend(backend, "cuda"))
            device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def init_distributed(device_name: str = "auto", timeout_minutes: int = 30, backend: str = "auto",
                     timeout_s: Optional[float] = None) -> DistInfo:
    """Initialise the default process group from the environment, if launched so.

    ``backend`` is ``train.dist_backend`` (``auto``, ``nccl`` or ``gloo``); ``timeout_s``
    (``train.dist_timeout_s``, default ``timeout_minutes``) is how long a collective
    waits for the other ranks before it fails (``lost_rank_message`` names the rank
    that did not answer). Returns rank,
    world size, local rank, the device this process should use and the backend.
    Raises ``LaunchError`` before any collective when this node has fewer GPUs than
    NCCL ranks; a rank that does not report it waits ``QUIET_STOP_WAIT_S`` first.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        os.environ.setdefault("MASTER_PORT", "29500")
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", default=local_rank + 1)
    try:
        device = resolve_device(device_name, local_rank, backend, local_world_size)
    except LaunchError as exc:
        if not exc.report:
            time.sleep(QUIET_STOP_WAIT_S)
        raise
    resolved = resolve_backend(backend, device.type)
    shared = 0
    if device.type == "cuda" and resolved == "gloo" and local_world_size > torch.cuda.device_count():
        shared = torch.cuda.device_count()
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        kwargs: Dict[str, Any] = {}
        if resolved == "nccl":
            kwargs["device_id"] = device
        timeout = timedelta(seconds=timeout_s if timeout_s is not None else 60.0 * timeout_minutes)
        store = _restart_store(timeout)
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = "env://"
        dist.init_process_group(backend=resolved, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    peers: Tuple[Tuple[str, int], ...] = ()
    if world_size > 1:
        peers = tuple(tuple(p) for p in all_gather_object((socket.gethostname(), os.getpid())))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, peers=peers,
                    backend=resolved if world_size > 1 else "", local_world_size=local_world_size,
                    shared_gpus=shared if world_size > 1 else 0,
                    timeout_s=timeout_s if timeout_s is not None else 60.0 * timeout_minutes)


def _restart_store(timeout: timedelta) -> Optional[dist.Store]:
    """The process group's store under ``torchrun --max-restarts`` on one node, or None.

    torchrun's agent keeps one store for all restarts, and the keys a process group
    leaves in it (each rank's address) outlive the workers, so a restarted worker can
    read a dead worker's address and fail to connect (pytorch/pytorch#135712). Here the
    keys of each restart go under their own prefix. The restart count is the same on
    every worker when one agent runs them all; with several nodes it may differ, so
    multi-node elastic runs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the agents
    instead (then each restart gets a fresh store and this returns None).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"detector/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def node_of_process() -> Tuple[str, int]:
    """``(node name, local rank)`` of this process, from the launcher's environment (as
    ``init_distributed`` reads it): the node name is the host name plus torchrun's
    ``GROUP_RANK`` (SLURM: ``SLURM_NODEID``), so two "nodes" launched on one host stay
    apart; the local rank is ``LOCAL_RANK`` (SLURM: ``SLURM_LOCALID``), 0 without a launcher."""
    group = os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or ""
    return f"{socket.gethostname()}/{group}", _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier(info: Optional[DistInfo] = None) -> None:
    """Wait for every rank (``watch``-ed: a slow wait is logged; ``info`` names the ranks)."""
    if is_dist() and get_world_size() > 1:
        with watch("barrier", info):
            dist.barrier()


def all_gather_object(obj: Any, info: Optional[DistInfo] = None) -> List[Any]:
    """Gather any picklable object from every rank; returns a list indexed by rank
    (``watch``-ed; ``info`` names the ranks and sets the slow threshold)."""
    if not is_dist() or get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size()
    with watch("all_gather_object", info):
        dist.all_gather_object(out, obj)
    return out


def all_gather_padded(tensor: torch.Tensor, info: Optional[DistInfo] = None) -> List[torch.Tensor]:
    """``all_gather`` for tensors whose first dimension differs between ranks.

    Each rank's tensor ``[N_r, ...]`` is padded to the largest ``N`` before the
    collective and cut back afterwards; returns ``[tensor_r for r in ranks]``. Both
    collectives are ``watch``-ed (``info`` as in ``all_gather_object``).
    """
    if not is_dist() or get_world_size() == 1:
        return [tensor]
    size = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(get_world_size())]
    with watch("all_gather_padded", info):
        dist.all_gather(sizes, size)
        n_max = int(max(s.item() for s in sizes))
        padded = tensor.new_zeros((n_max, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded)
    return [g[: int(s.item())] for g, s in zip(gathered, sizes)]


def reduce_dict(values: Dict[str, torch.Tensor], average: bool = True,
                info: Optional[DistInfo] = None) -> Dict[str, torch.Tensor]:
    """All-reduce a dict of scalar tensors (same keys on every rank); mean by default
    (``watch``-ed; ``info`` as in ``all_gather_object``)."""
    if not is_dist() or get_world_size() == 1:
        return values
    names = sorted(values)
    stacked = torch.stack([values[k].detach().float() for k in names])
    with watch("reduce_dict", info):
        dist.all_reduce(stacked)
    if average:
        stacked /= get_world_size()
    return dict(zip(names, stacked))


def _flat_in_place(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run ``collective`` (in place) once per dtype on the flat concatenation of
    ``tensors`` and copy the result back into them."""
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        collective(flat)
        pieces = flat.split([t.numel() for t in group])
        torch._foreach_copy_(group, [piece.view_as(t) for t, piece in zip(group, pieces)])


@torch.no_grad()
def all_reduce_mean_(tensors: Sequence[torch.Tensor], world_size: int) -> None:
    """Average ``tensors`` over the ranks of the default process group, in place.

    Every rank passes tensors of the same shapes, dtypes and order (the gradients of one
    model: ``[p.grad for p in params]``). They are concatenated per dtype into one flat
    buffer (one extra copy of them), all-reduced once per dtype, divided by
    ``world_size`` and copied back: the mean DDP computes, without its buckets and
    without overlapping the backward pass. A no-op for ``world_size <= 1``."""
    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat)
        flat.div_(world_size)

    if world_size > 1 and tensors:
        _flat_in_place(tensors, mean)


@torch.no_grad()
def broadcast_(tensors: Sequence[torch.Tensor], world_size: int, src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s, in place, one broadcast per
    dtype of their flat concatenation (DDP's ``broadcast_buffers`` for a model's buffers,
    e.g. BatchNorm's running statistics). A no-op for ``world_size <= 1``."""
    if world_size > 1 and tensors:
        _flat_in_place(tensors, lambda flat: dist.broadcast(flat, src))


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (CPU and CUDA) with ``seed + rank``; returns it."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    return s


def cleanup() -> None:
    if is_dist():
        dist.destroy_process_group()
