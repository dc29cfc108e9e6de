"""TEST-ONLY: a CPU ``PlatformBase`` for verl 0.9.1 (verl has none).

:func:`register_platform` registers it with verl's ``PlatformRegistry`` (a ``main_ppo`` run selects it with
``VERL_PLATFORM=cpu``); :func:`cpu_platform` is an instance for in-process tests (verl's ``set_platform``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

NAME = "cpu"


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _none(*_: Any, **__: Any) -> None:
    return None


CPUDeviceModule = type(
    "CPUDeviceModule",
    (),
    {
        **{k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")},
        "max_memory_allocated": staticmethod(_zero),
        "max_memory_reserved": staticmethod(_zero),
        "memory_allocated": staticmethod(_zero),
        "memory_reserved": staticmethod(_zero),
        "mem_get_info": staticmethod(lambda *_: (1 << 34, 1 << 34)),
        "reset_peak_memory_stats": staticmethod(_none),
        "empty_cache": staticmethod(_none),
        "get_device_name": staticmethod(lambda *_: "CPU"),
        "is_available": staticmethod(lambda: True),
        "device_count": staticmethod(lambda: 1),
        "current_device": staticmethod(lambda: "cpu"),
        "set_device": staticmethod(_none),
        "synchronize": staticmethod(_none),
        "manual_seed": staticmethod(torch.manual_seed),
        "manual_seed_all": staticmethod(torch.manual_seed),
        # verl's checkpoint manager restores the device RNG under the device's name, which is "cpu" here
        "get_rng_state": staticmethod(torch.get_rng_state),
        "set_rng_state": staticmethod(torch.set_rng_state),
    },
)


def register_platform() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(platform=NAME)(platform_class())


def cpu_platform() -> Any:
    """A platform instance (``verl.plugin.platform.set_platform(cpu_platform())``)."""
    return platform_class()()


@functools.cache
def platform_class() -> type:
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):  # type: ignore[misc]
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUDeviceModule

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"  # the run declares one logical GPU; nothing uses CUDA

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU
