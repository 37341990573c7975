"""What a push into one engine (sender.py) and into a fleet (broadcast.py) share: its tensors,
its deadline, its result, the engine's error markers, and the rendezvous address."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

from vime.weight_sync.errors import PoisonedEngine

# Messages vime.weight_sync.gloo_engine answers with (kept in sync by hand: importing it would
# import vLLM): before it touches the model, and after a staged transfer that loaded nothing.
NOT_INITIALIZED = "gloo weight transfer not initialized"
POISONED = "gloo weight transfer poisoned"
NOT_LOADED = "gloo weight transfer not loaded"

DEFAULT_BUCKET_BYTES = 64 << 20

# A push's deadline: rendezvous_s + bytes / floor rate. The floor is a rate no healthy link
# falls under (loopback gloo moves ~1 GB/s, a 10 GbE link ~1 GB/s): far under it means stuck.
ENV_FLOOR_MBPS = "VIME_PUSH_FLOOR_MBPS"
ENV_RENDEZVOUS_S = "VIME_PUSH_RENDEZVOUS_S"
DEFAULT_FLOOR_MBPS = 50.0
DEFAULT_RENDEZVOUS_S = 30.0


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"${name}={raw!r} must be > 0")
    return value


def push_deadline(nbytes: int, floor_mbps: float | None = None,
                  rendezvous_s: float | None = None) -> float:
    """Seconds a push of nbytes may take: rendezvous_s + nbytes / floor rate (MB = 1e6 bytes).
    Unset arguments come from $VIME_PUSH_FLOOR_MBPS / $VIME_PUSH_RENDEZVOUS_S, else 50 / 30."""
    floor = floor_mbps if floor_mbps is not None else _env_float(ENV_FLOOR_MBPS, DEFAULT_FLOOR_MBPS)
    fixed = rendezvous_s if rendezvous_s is not None else _env_float(ENV_RENDEZVOUS_S, DEFAULT_RENDEZVOUS_S)
    return fixed + nbytes / (floor * 1e6)

NamedTensors: TypeAlias = Iterable[tuple[str, torch.Tensor]] | torch.nn.Module | Mapping[str, torch.Tensor]
Progress = Callable[[str, dict], None]


ENV_RENDEZVOUS = "VIME_RENDEZVOUS_ADDRESS"


def detached(e: BaseException) -> BaseException:
    """e without its traceback (whose frames could keep the process group alive)."""
    e.__traceback__ = None
    e.__context__ = None
    return e


def local_address_towards(host: str) -> str:
    """The address of this machine that `host` can reach us on (loopback for a local engine)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent for UDP connect
        return s.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_uri(host: str, port: int) -> str:  # == vllm.utils.network_utils.get_tcp_uri
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"tcp://[{host}]:{port}"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def named_tensor_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """(name, detached tensor) pairs from a Module (named_parameters), a mapping or an iterable.
    References only: nothing is copied here."""
    if isinstance(named_tensors, torch.nn.Module):
        items = named_tensors.named_parameters()
    elif isinstance(named_tensors, Mapping):
        items = named_tensors.items()
    else:
        items = named_tensors
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        # Refused before any engine is contacted: a broadcast would otherwise fail on every
        # receiver at once (then again in its redo) and leave them all to be pushed again.
        if t.is_nested or t.layout is not torch.strided:
            raise ValueError(f"{name!r} is a {'nested' if t.is_nested else t.layout} tensor; push dense tensors "
                             "(call .to_dense(), or unbind a nested one)")
        if t.is_quantized:
            raise ValueError(f"{name!r} is quantized: its bytes alone lose its scale and zero point; push "
                             "t.dequantize(), or the checkpoint's own tensors")
        if t.is_meta:
            raise ValueError(f"{name!r} is on the meta device and holds no data; materialize the "
                             "model's weights before pushing them")
        out.append((str(name), t.detach()))
    if not out:
        raise ValueError("no tensors to push: pass the model's named parameters or a name -> tensor mapping")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the push")
    return out


@dataclass
class PushResult:
    url: str
    version: str
    ok: bool = False
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    group_inits: int = 0  # rendezvous done by this push (0: the group was reused)
    steps: dict[str, float] = field(default_factory=dict)  # seconds per step
    error: BaseException | None = None
    # Fleet pushes (FleetSender) only: "ok", "intact" (not loaded, old weights, resumed: safe to
    # push again), "poisoned" (half-loaded: restart it) or "unreachable" (died, stopped, timed
    # out); redone: it got the version in the second broadcast, over the survivors.
    status: str = ""
    redone: bool = False
    deadline_s: float = 0.0
    bound_s: float = 0.0  # the whole push's bound, announced and enforced (fleet pushes)

    @property
    def poisoned(self) -> bool:
        return isinstance(self.error, PoisonedEngine)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds else 0.0
